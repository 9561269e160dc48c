"""Plan the runs, start one fresh child process per workload × size × mode, check each mode's
output against eager's, and turn the measurements into report rows.

Fresh processes with empty caches are what make first-iteration latency and time-to-N honest:
nothing compiled by an earlier run (Inductor's cache, our kernel cache) can be reused.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import TextIO

from adaptive_eager.benchmarks import results
from adaptive_eager.benchmarks.child import EAGER_MALLOC, MODES
from adaptive_eager.benchmarks.results import FAILED, MISMATCH, SKIPPED, Row

# The main command's embedded default (about two minutes on 2 cores, four modes): the two
# workloads the runtime is built for, at the size where fusion pays, and a training step and
# a transformer block, where it does not pay yet, so a newcomer sees both.
DEFAULT_CASES = (("chain8", "large"), ("ln_gelu_residual", "large"),
                 ("train_step", "medium"), ("transformer_block", "medium"))
DEFAULT_ITERS = 10
CHILD_TIMEOUT_S = 1800


class PlanError(ValueError):
    """Arguments that name no runnable benchmark; the message says what is accepted."""


@dataclasses.dataclass(frozen=True)
class Plan:
    cases: tuple[tuple[str, str], ...]     # (workload, size)
    modes: tuple[str, ...]      # eager first: it is the reference
    iters: int
    device: str = "cpu"

    def runs(self) -> list[tuple[str, str, str]]:
        return [(w, s, m) for w, s in self.cases for m in self.modes]


def choose(kind: str, given, accepted, default) -> tuple[str, ...]:
    """``given`` (in order, without repeats), or ``default`` when nothing is given; PlanError
    naming what is accepted when a name is not."""
    chosen = tuple(dict.fromkeys(given)) if given else tuple(default)
    unknown = [name for name in chosen if name not in accepted]
    if unknown:
        raise PlanError(f"unknown {kind} {', '.join(map(repr, unknown))}; "
                        f"choose from {', '.join(accepted)}")
    return chosen


def make_plan(workloads=None, sizes=None, modes: str | None = None, iters: int = DEFAULT_ITERS,
              run_all: bool = False, device: str = "cpu") -> Plan:
    """Validate the command's arguments into a Plan (PlanError: one line saying why not)."""
    from adaptive_eager.benchmarks.workloads import SIZES, WORKLOADS
    if iters < 1:
        raise PlanError(f"--iters must be at least 1, got {iters}")
    default_names = tuple(dict.fromkeys(name for name, _ in DEFAULT_CASES))
    names = choose("workload", workloads, list(WORKLOADS),
                   WORKLOADS if run_all else default_names)
    chosen_sizes = choose("size", sizes, SIZES, SIZES if run_all else ("large",))
    if workloads or sizes or run_all:
        cases = tuple((name, size) for name in names for size in chosen_sizes)
    else:
        cases = DEFAULT_CASES
    given_modes = [m.strip() for m in modes.split(",") if m.strip()] if modes else None
    chosen_modes = choose("mode", given_modes, MODES, MODES)
    # Eager always runs, first: every other mode is checked and timed against it.
    ordered = ("eager",) + tuple(m for m in chosen_modes if m != "eager")
    return Plan(cases, ordered, iters, device)


# ---------------------------------------------------------------------- one child

def child_env(directory: str) -> dict[str, str]:
    """The child's environment: the caller's, with empty caches of its own."""
    env = dict(os.environ)
    env.pop("NEURON_ADAPTIVE_EAGER", None)   # the start-up hook would make every mode adaptive
    # The child is our own process, so it may move Inductor's cache for the whole of it: the
    # torch.compile mode must start as cold as ours (which always uses its own inside
    # NEURON_ADAPTIVE_EAGER_CACHE_DIR: Note [Our Inductor cache] in cache/inductor_dir.py).
    env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(directory, "inductor")
    env["NEURON_ADAPTIVE_EAGER_CACHE_DIR"] = os.path.join(directory, "adaptive-eager")
    # Inductor's gcc ISA probes cost ~10 s per fresh process and tell nothing about the modes;
    # skipped for adaptive and compile alike (set it to 0 to pay them).
    env.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


@dataclasses.dataclass(frozen=True)
class FreshRun:
    """What a module run in a fresh process left: its ``result.json``, or why there is none."""

    result: dict | None         # None: the process failed or timed out
    error: str = ""
    wall_s: float = 0.0


def run_module(module: str, arguments: list[str], directory: str) -> FreshRun:
    """``python -m module *arguments`` in a fresh process with empty caches in ``directory``,
    which the module writes its ``result.json`` into."""
    command = [sys.executable, "-m", module, *arguments]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=child_env(directory), capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return FreshRun(None, f"timed out after {CHILD_TIMEOUT_S} s",
                        time.perf_counter() - started)
    wall = time.perf_counter() - started
    result_path = os.path.join(directory, "result.json")
    if done.returncode != 0 or not os.path.exists(result_path):
        return FreshRun(None, _last_error_line(done.stderr, done.returncode), wall)
    with open(result_path) as file:
        return FreshRun(json.load(file), wall_s=wall)


def _last_error_line(stderr: str, returncode: int) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {returncode}"


@dataclasses.dataclass(frozen=True)
class ChildOutcome:
    measurement: dict | None     # None: the child failed
    output_path: str
    error: str = ""
    wall_s: float = 0.0


def run_child(workload: str, size: str, mode: str, plan: Plan, directory: str,
              warmup: int | None = None) -> ChildOutcome:
    """One mode's fresh process; ``warmup``: its warm-up steps (None: it picks them, as the
    eager reference does)."""
    os.makedirs(directory)
    arguments = ["--workload", workload, "--size", size, "--mode", mode,
                 "--iters", str(plan.iters), "--device", plan.device, "--out", directory]
    if warmup is not None:
        arguments += ["--warmup", str(warmup)]
    run = run_module("adaptive_eager.benchmarks.child", arguments, directory)
    if run.result is None:
        return ChildOutcome(None, "", run.error, run.wall_s)
    return ChildOutcome(run.result, os.path.join(directory, "output.pt"), wall_s=run.wall_s)


# ---------------------------------------------------------------------- a workload × size

class Progress:
    """One line per child on stderr: ``[3/12] chain8 large adaptive … 4.2 s``."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.done, self.stream = total, 0, stream

    def start(self, *what: str) -> None:
        self.done += 1
        print(f"[{self.done}/{self.total}] {' '.join(what)} … ", end="", file=self.stream,
              flush=True)

    def finish(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


def _check(outcome: ChildOutcome, eager: ChildOutcome, tolerance) -> str | None:
    import torch
    actual = torch.load(outcome.output_path, weights_only=False)
    expected = torch.load(eager.output_path, weights_only=False)
    return results.compare_outputs(actual, expected, tolerance.rtol, tolerance.atol)


def _judge(outcome: ChildOutcome, eager: ChildOutcome, tolerance) -> Row:
    mismatch = _check(outcome, eager, tolerance)
    if mismatch:
        return results.measured_row(outcome.measurement, eager.measurement, MISMATCH,
                                    f"output differs from eager: {mismatch}")
    return results.measured_row(outcome.measurement, eager.measurement)


def _run_mode(workload, size: str, mode: str, plan: Plan, eager: ChildOutcome | None,
              directory: str) -> tuple[Row, ChildOutcome | None]:
    """One mode's child and its row; ``eager``: the reference outcome (None for eager itself)."""
    if eager is not None and eager.measurement is None:
        return Row(workload.name, size, mode, FAILED, "the eager reference failed"), None
    if mode == EAGER_MALLOC:
        from adaptive_eager.runtime.allocator import why_left_alone
        reason = why_left_alone()
        if reason:
            return Row(workload.name, size, mode, SKIPPED, reason), None
    warmup = None if eager is None else eager.measurement["warmup_steps"]
    outcome = run_child(workload.name, size, mode, plan, os.path.join(directory, mode), warmup)
    if outcome.measurement is None:
        return Row(workload.name, size, mode, FAILED, outcome.error), outcome
    if eager is None:
        return results.measured_row(outcome.measurement, outcome.measurement), outcome
    return _judge(outcome, eager, workload.tolerance), outcome


def _progress_text(row: Row, outcome: ChildOutcome | None) -> str:
    if outcome is None:
        return f"not run: {row.detail}"
    if row.status == FAILED:
        return f"FAILED after {outcome.wall_s:.1f} s: {row.detail}"
    return f"{outcome.wall_s:.1f} s" + ("  OUTPUT MISMATCH" if row.status == MISMATCH else "")


def run_case(workload, size: str, plan: Plan, progress: Progress, directory: str) -> list[Row]:
    """Every mode of one workload at one size; eager's child first (the reference)."""
    missing = workload.missing_requirement()
    if missing:
        for mode in plan.modes:
            progress.start(workload.name, size, mode)
            progress.finish(f"skipped: {missing}")
        return [Row(workload.name, size, mode, SKIPPED, missing) for mode in plan.modes]
    rows, eager = [], None
    for mode in plan.modes:
        progress.start(workload.name, size, mode)
        row, outcome = _run_mode(workload, size, mode, plan, eager, directory)
        progress.finish(_progress_text(row, outcome))
        rows.append(row)
        if mode == "eager":
            eager = outcome
    return rows


def run(plan: Plan, stream: TextIO | None = None) -> list[Row]:
    """Run the plan, progress on ``stream`` (stderr); rows in plan order."""
    from adaptive_eager.benchmarks.workloads import WORKLOADS
    progress = Progress(len(plan.runs()), stream or sys.stderr)
    if "adaptive" in plan.modes:
        build_extension(progress.stream)
    rows = []
    for name, size in plan.cases:
        with tempfile.TemporaryDirectory(prefix=f"ae-bench-{name}-{size}-") as directory:
            rows += run_case(WORKLOADS[name], size, plan, progress, directory)
    return rows


def build_extension(stream: TextIO) -> None:
    """The C++ extension is part of the install, built once per user and torch version
    (Note [Building the extension]): the adaptive children run with it, as a user's program
    does from its second run on, and none spends its time on the build (a build beside a
    child measures the Python mode and a compiler)."""
    from adaptive_eager.config import config
    from adaptive_eager.dispatch import native
    if config.BACKEND == "python" or native.prepare() is not None or native.failure():
        return
    print("building the C++ extension (once per user and torch version) … ", end="",
          file=stream, flush=True)
    started = time.perf_counter()
    ext = native.prepare(wait_s=native.BUILD_TIMEOUT_S)
    outcome = "done" if ext is not None else f"failed: {native.failure()}"
    print(f"{outcome} ({time.perf_counter() - started:.0f} s)", file=stream, flush=True)
