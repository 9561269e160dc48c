"""Measure one workload × size × mode in this (fresh) process.

    python -m adaptive_eager.benchmarks.child --workload chain8 --size large --mode adaptive \
        --iters 20 --out DIR

Writes ``DIR/result.json`` (a ``Measurement``) and ``DIR/output.pt`` (the last step's output,
for the parent's check against eager). The schedule is the same in every mode, so a training
step's state after it is comparable too:

1. cold: ``iters`` steps timed one by one from the first (first-iteration latency, total time);
2. adaptive only: wait for background compiles (``ae.sync(wait_compiles=...)``), timed;
3. warm-up: as many steps as take about WARMUP_S in eager (``warmup_steps``), timed as a
   whole, with a second wait for compiles half-way (adaptive only, timed): new kernels are
   judged profitable or not here, and a program with nothing to fuse pauses;
4. steady: ``iters`` more steps timed one by one (their median is the step time);
5. adaptive only: two rounds of four blocks of more steps, plain eager (``ae.paused()``),
   the runtime's, the runtime's, plain eager, each step timed alone: a ratio to eager from
   one process and one stretch of time, which the machine's drift between processes cannot
   skew (a 2-core machine here slowed eager's step 1.4x after ~20 s of load, so the later
   child looked slower). A block is ``iters // 2`` steps, or more where they take less than
   PAIRED_BLOCK_S: that machine's speed moves up to 2x over seconds, and with blocks of 5
   steps of ~20 us one row read 1.44, then 0.99 and 1.01 when rerun. A block's first step is
   not counted: switching in or out of ``ae.paused()`` costs it what no program that stays in
   one mode pays (steps alternated one by one ran the runtime's up to 4x slower than its
   steady steps).

The eager child, the reference, runs first and picks the warm-up's length from its own cold
steps; the parent hands it to the other modes (``--warmup``), so every mode runs the same
steps on the same inputs.

Each step is timed as a program runs it. On CUDA it ends with a device synchronize. Under the
runtime it does not end with ``ae.sync()``, which no program calls every step: on a ~20 us
step its ~5 us (a control point, Note [Natural boundaries] in dispatch/control.py) made the
runtime look 15-25% slower than eager, and its control point every step made a bare loop of
tensor ops, which passes none, run unlike the program itself. Deferred work a step leaves lands
in the next step's time, as it does in the program; each block of steps ends with one
``ae.sync()``, counted in its last step, so the block's total holds all its work.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import resource
import statistics
import sys
import time
from typing import Any, Callable

# Warm-up: about this long in eager, and within these bounds. The runtime settles within a
# few hundred segments: a new kernel's trial takes 7 runs (Note [Side by side]), and a pause
# comes after PAUSE_WINDOW (256) segments with nothing worth fusing; 3 steps of a tiny
# workload measured a runtime still on trial, and 3 steps of a 30 ms one take 0.1 s. After its
# compiles, the runtime times steps intercepting against paused (Note [Judged by the step]):
# four windows of 16 control points, ~20 steps of a GPT-2 training step; 0.5 s measured the
# runtime in the middle of that.
WARMUP_S = 3.0
WARMUP_STEPS = 3
MOST_WARMUP_STEPS = 500
EAGER_MALLOC = "eager+malloc"     # eager with the thresholds MALLOC_TUNING=1 sets
MODES = ("eager", EAGER_MALLOC, "adaptive", "compile")


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one child measured (seconds unless named otherwise)."""

    workload: str
    size: str
    mode: str
    cold_step_s: tuple          # the first ``iters`` steps, one by one
    compile_wait_s: float       # adaptive: waiting for background compiles after the cold
                                # steps and half-way through the warm-up
    warmup_steps: int
    warmup_s: float             # the warm-up steps, all together
    steady_step_s: tuple        # steps after warm-up, one by one
    compiles: int
    compile_s: float | None     # None: torch.compile did not say
    peak_mib: float             # this process's peak RSS (+ peak CUDA allocation on CUDA)
    torch_threads: int
    paired_eager_s: tuple = ()      # adaptive: step 5, the plain eager steps
    paired_adaptive_s: tuple = ()   # and the runtime's between them

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Mode:
    """How one mode runs a step: ``call`` on a step's arguments, ``settle`` to end each step
    (a device synchronize), ``finish`` to end a block of steps (the runtime's deferred work),
    ``scope`` around the whole schedule, ``counts`` → (compiles, compile seconds),
    ``outside`` around what is not the program's (building a step's inputs)."""

    call: Callable[..., Any]
    settle: Callable[[], None]
    scope: Callable[[], contextlib.AbstractContextManager]
    counts: Callable[[], tuple[int, float]]
    finish: Callable[[], None] = lambda: None
    wait_for_compiles: Callable[[], None] = lambda: None
    outside: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    pairs: bool = False                # run step 5 (``outside`` is plain eager)


def _device_sync(device: str) -> Callable[[], None]:
    import torch
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def _eager_mode(fn, device: str) -> _Mode:
    return _Mode(fn, _device_sync(device), contextlib.nullcontext, lambda: (0, 0.0))


def _eager_malloc_mode(fn, device: str) -> _Mode:
    """Plain eager with glibc's malloc thresholds where MALLOC_TUNING=1 sets them (Note
    [Allocator thresholds]). The runtime's kernels write buffers it pools, so on large tensors
    part of what it gains over eager is memory reuse: this row shows how much of that eager
    gets from the allocator alone. The runner skips it where they cannot be set."""
    from adaptive_eager.runtime.allocator import keep_freed_memory
    if not keep_freed_memory():
        raise RuntimeError("glibc's malloc thresholds could not be set in this process")
    return _eager_mode(fn, device)


def _adaptive_mode(fn, device: str) -> _Mode:
    import adaptive_eager as ae
    device_sync = _device_sync(device)

    def finish() -> None:
        ae.sync()
        device_sync()

    def counts() -> tuple[int, float]:
        stats = ae.stats()
        return stats.compiles, stats.compile_seconds
    return _Mode(fn, device_sync, ae.enabled, counts, finish=finish,
                 wait_for_compiles=lambda: ae.sync(wait_compiles=600), outside=ae.paused,
                 pairs=True)


def _compile_mode(fn, device: str) -> _Mode:
    import torch
    from torch._dynamo.utils import counters

    def counts() -> tuple[int, float | None]:
        try:    # private API: compile time is a nice-to-have, the count is what matters
            from torch._dynamo.utils import calculate_time_spent
            seconds = calculate_time_spent().get("total_wall_time", 0.0)
        except Exception:
            seconds = None
        return counters["stats"]["unique_graphs"], seconds
    return _Mode(torch.compile(fn), _device_sync(device), contextlib.nullcontext, counts)


_MODE_BUILDERS = {"eager": _eager_mode, EAGER_MALLOC: _eager_malloc_mode,
                  "adaptive": _adaptive_mode, "compile": _compile_mode}


def _timed_steps(mode: _Mode, case, iterations: range) -> tuple[list[float], Any]:
    """Run these iterations, each timed alone. Their arguments are built ahead, outside the
    timing and the interception (the same tensors in every mode): stepping out of the runtime
    for them (``ae.paused()``) finishes deferred work, untimed. So a block's arguments are
    built at its start, in chunks of FRESH_INPUTS_AHEAD where the case makes fresh ones; a
    chunk's finish is counted in its last step."""
    times, output = [], None
    ahead = FRESH_INPUTS_AHEAD if case.fresh_inputs else max(1, len(iterations))
    for first in range(0, len(iterations), ahead):
        with mode.outside():
            chunk = [case.inputs(iteration) for iteration in iterations[first:first + ahead]]
        for args in chunk:
            started = time.perf_counter()
            output = mode.call(*args)      # kept alive, as a program would keep its result
            mode.settle()
            times.append(time.perf_counter() - started)
        started = time.perf_counter()
        mode.finish()
        times[-1] += time.perf_counter() - started
    return times, output


# Fresh inputs built at a time: bounded memory (a large variable_shape input is ~3 MB), and
# one step out of the runtime per this many steps.
FRESH_INPUTS_AHEAD = 16


def _paired_steps(mode: _Mode, case, first: int, iters: int,
                  step_s: float) -> tuple[list[float], list[float]]:
    """Step 5 from iteration ``first``: blocks of plain eager (``mode.outside()``) and of the
    mode's steps, in the order PLAIN_FIRST, each of ``paired_block_steps``. Returns (eager
    times, the mode's times), each block's first step left out."""
    block = paired_block_steps(iters, step_s)
    times: dict[bool, list[float]] = {True: [], False: []}
    for number, plain in enumerate(PLAIN_FIRST):
        block_from = first + number * block
        with mode.outside() if plain else contextlib.nullcontext():
            steps, _ = _timed_steps(mode, case, range(block_from, block_from + block))
        times[plain] += steps[1:]
    return times[True], times[False]


# Step 5's blocks: is each plain eager? Symmetric, so a steady drift of the machine's speed
# weighs on both alike.
PLAIN_FIRST = (True, False, False, True) * 2
PAIRED_BLOCK_S = 0.05         # a block lasts at least this long at the steady step's median
MOST_PAIRED_BLOCK_STEPS = 2000


def paired_block_steps(iters: int, step_s: float) -> int:
    """Steps in one of step 5's blocks: ``iters // 2``, or as many as take PAIRED_BLOCK_S."""
    wanted = math.ceil(PAIRED_BLOCK_S / step_s) if step_s > 0 else MOST_PAIRED_BLOCK_STEPS
    return max(2, iters // 2, min(MOST_PAIRED_BLOCK_STEPS, wanted))


def _peak_rss_mib() -> float:
    """This process's peak resident memory. Linux's VmHWM belongs to this program's memory
    map; ru_maxrss survives exec, so a child would report its parent's peak if larger."""
    try:
        with open("/proc/self/status") as file:
            for line in file:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024            # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024   # bytes on macOS, else KiB


def _peak_mib(device: str) -> float:
    mib = _peak_rss_mib()
    if device.startswith("cuda"):
        import torch
        mib += torch.cuda.max_memory_allocated() / 2**20
    return mib


def warmup_steps_for(cold_step_s) -> int:
    """How many warm-up steps take about WARMUP_S at the median of these cold steps."""
    step = sorted(cold_step_s)[len(cold_step_s) // 2]
    wanted = math.ceil(WARMUP_S / step) if step > 0 else MOST_WARMUP_STEPS
    return max(WARMUP_STEPS, min(MOST_WARMUP_STEPS, wanted))


def measure(workload: str, size: str, mode_name: str, iters: int, device: str = "cpu",
            warmup: int | None = None):
    """Run the schedule; return (Measurement, the last step's output). ``warmup``: the
    warm-up's steps (None: the reference picks them, warmup_steps_for)."""
    import torch

    from adaptive_eager.benchmarks.workloads import WORKLOADS
    case = WORKLOADS[workload].build(size, device)
    mode = _MODE_BUILDERS[mode_name](case.fn, device)
    with mode.scope():
        cold, _ = _timed_steps(mode, case, range(iters))
        warmup = warmup_steps_for(cold) if warmup is None else warmup
        half, steady_from = iters + warmup // 2, iters + warmup
        waited = _timed_wait(mode)
        warmup_s = sum(_timed_steps(mode, case, range(iters, half))[0])
        waited += _timed_wait(mode)
        warmup_s += sum(_timed_steps(mode, case, range(half, steady_from))[0])
        steady, output = _timed_steps(mode, case, range(steady_from, steady_from + iters))
        output = _detached(output)        # (the paired steps go on changing a model's state)
        paired_from = steady_from + iters
        paired = _paired_steps(mode, case, paired_from, iters, statistics.median(steady)) \
            if mode.pairs else ((), ())
        compiles, compile_s = mode.counts()
    measurement = Measurement(workload, size, mode_name, tuple(cold), waited, warmup, warmup_s,
                              tuple(steady), compiles, compile_s, _peak_mib(device),
                              torch.get_num_threads(), *map(tuple, paired))
    return measurement, output


def _timed_wait(mode: _Mode) -> float:
    started = time.perf_counter()
    mode.wait_for_compiles()
    return time.perf_counter() - started


def _detached(output: Any) -> Any:
    import torch
    if isinstance(output, torch.Tensor):
        return output.detach().cpu().clone()
    if isinstance(output, (tuple, list)):
        return tuple(_detached(item) for item in output)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--size", required=True)
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--iters", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default: the reference's "
                        "choice, about WARMUP_S of its cold steps)")
    parser.add_argument("--out", required=True, help="directory for result.json and output.pt")
    options = parser.parse_args(argv)
    measurement, output = measure(options.workload, options.size, options.mode, options.iters,
                                  options.device, options.warmup)
    import torch
    torch.save(output, os.path.join(options.out, "output.pt"))
    with open(os.path.join(options.out, "result.json"), "w") as file:
        json.dump(measurement.as_dict(), file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
