"""Measure one workload × size × mode in this (fresh) process.

    python -m adaptive_eager.benchmarks.child --workload chain8 --size large --mode adaptive \
        --iters 20 --out DIR

Writes ``DIR/result.json`` (a ``Measurement``) and ``DIR/output.pt`` (the last step's output,
for the parent's check against eager). The schedule is the same in every mode, so a training
step's state after it is comparable too:

1. cold: ``iters`` steps timed one by one from the first (first-iteration latency, total time);
2. adaptive only: wait for background compiles (``ae.sync(wait_compiles=...)``), timed;
3. warm-up: ``WARMUP_STEPS`` untimed steps (a new kernel is judged profitable or not here);
4. steady: ``iters`` more steps timed one by one (their median is the step time).

Each step ends when its work has been done: under the runtime with ``ae.sync()`` (deferred work
would otherwise land in the next step's time), on CUDA with a device synchronize.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import sys
import time
from typing import Any, Callable

WARMUP_STEPS = 3
MODES = ("eager", "adaptive", "compile")


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one child measured (seconds unless named otherwise)."""

    workload: str
    size: str
    mode: str
    cold_step_s: tuple          # the first ``iters`` steps, one by one
    compile_wait_s: float       # adaptive: waiting for background compiles after the cold steps
    steady_step_s: tuple        # steps after warm-up, one by one
    compiles: int
    compile_s: float | None     # None: torch.compile did not say
    peak_mib: float             # this process's peak RSS (+ peak CUDA allocation on CUDA)
    torch_threads: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Mode:
    """How one mode runs a step: ``call`` on a step's arguments, ``settle`` to finish its work,
    ``scope`` around the whole schedule, ``counts`` → (compiles, compile seconds)."""

    call: Callable[..., Any]
    settle: Callable[[], None]
    scope: Callable[[], contextlib.AbstractContextManager]
    counts: Callable[[], tuple[int, float]]
    wait_for_compiles: Callable[[], None] = lambda: None


def _device_sync(device: str) -> Callable[[], None]:
    import torch
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def _eager_mode(fn, device: str) -> _Mode:
    return _Mode(fn, _device_sync(device), contextlib.nullcontext, lambda: (0, 0.0))


def _adaptive_mode(fn, device: str) -> _Mode:
    import adaptive_eager as ae
    device_sync = _device_sync(device)

    def settle() -> None:
        ae.sync()
        device_sync()

    def counts() -> tuple[int, float]:
        stats = ae.stats()
        return stats.compiles, stats.compile_seconds
    return _Mode(fn, settle, ae.enabled, counts,
                 wait_for_compiles=lambda: ae.sync(wait_compiles=600))


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


_MODE_BUILDERS = {"eager": _eager_mode, "adaptive": _adaptive_mode, "compile": _compile_mode}


def _timed_steps(mode: _Mode, arguments: list) -> tuple[list[float], Any]:
    times, output = [], None
    for args in arguments:
        started = time.perf_counter()
        output = mode.call(*args)          # kept alive, as a program would keep its result
        mode.settle()
        times.append(time.perf_counter() - started)
    return times, output


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


def measure(workload: str, size: str, mode_name: str, iters: int, device: str = "cpu"):
    """Run the schedule; return (Measurement, the last step's output)."""
    import torch

    from adaptive_eager.benchmarks.workloads import WORKLOADS
    case = WORKLOADS[workload].build(size, device)
    total = 2 * iters + WARMUP_STEPS
    arguments = [case.inputs(i) for i in range(total)]    # built before any timing
    mode = _MODE_BUILDERS[mode_name](case.fn, device)
    with mode.scope():
        cold, _ = _timed_steps(mode, arguments[:iters])
        started = time.perf_counter()
        mode.wait_for_compiles()
        waited = time.perf_counter() - started
        _timed_steps(mode, arguments[iters:iters + WARMUP_STEPS])
        steady, output = _timed_steps(mode, arguments[iters + WARMUP_STEPS:])
        compiles, compile_s = mode.counts()
    measurement = Measurement(workload, size, mode_name, tuple(cold), waited, tuple(steady),
                              compiles, compile_s, _peak_mib(device), torch.get_num_threads())
    return measurement, output


def _detached(output: Any) -> Any:
    import torch
    if isinstance(output, torch.Tensor):
        return output.detach().cpu()
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
    parser.add_argument("--out", required=True, help="directory for result.json and output.pt")
    options = parser.parse_args(argv)
    measurement, output = measure(options.workload, options.size, options.mode, options.iters,
                                  options.device)
    import torch
    torch.save(_detached(output), os.path.join(options.out, "output.pt"))
    with open(os.path.join(options.out, "result.json"), "w") as file:
        json.dump(measurement.as_dict(), file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
