"""Where the time goes on tiny tensors: per-op cost of each layer, side by side.

    python bench/overhead.py [--numel 4096] [--steps 2000]

Times an 8-op pointwise chain per step: plain eager; under a do-nothing TorchDispatchMode
(the floor any Python interception pays); the C++ interception backend passing ops through
(a paused thread) and calling a do-nothing Python callback per op; under the runtime with
compilation off (cold path: record + key every op) on each backend; and under the runtime,
fused (hot path: match + defer + one kernel; on cpp, Note [The C++ hot path]).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import adaptive_eager as ae
from adaptive_eager.benchmarks.workloads import pointwise_chain
from adaptive_eager.config import config
from adaptive_eager.dispatch.mode import PassThroughMode

OPS_PER_STEP = 8


def _per_step_us(step, steps: int) -> float:
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(steps // 5):
            result = step()
            del result
        ae.sync()                  # the last deferred run, inside the sample's time
        samples.append((time.perf_counter() - started) / (steps // 5))
    return statistics.median(samples) * 1e6


def _cpp_rows(step, steps: int) -> list:
    """The C++ fallback alone: pass-through (paused) and a do-nothing Python callback."""
    from adaptive_eager.dispatch import native
    ext = native.prepare(wait_s=native.BUILD_TIMEOUT_S)
    if ext is None:
        print(f"(no C++ backend: {native.failure()})")
        return []
    rows = []
    ext.set_callbacks(lambda func, args, kwargs: func(*args, **kwargs), lambda: None, 1 << 30)
    ext.set_included(True)
    try:
        ext.set_paused(True)
        rows.append(("C++ fallback, paused (pass-through)", _per_step_us(step, steps)))
        ext.set_paused(False)
        rows.append(("C++ fallback + no-op Python callback", _per_step_us(step, steps)))
    finally:
        ext.set_paused(False)
        ext.set_included(False)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2000)
    options = parser.parse_args()
    step = pointwise_chain(options.numel)
    rows = [("eager", _per_step_us(step, options.steps))]
    with PassThroughMode():
        rows.append(("no-op dispatch mode", _per_step_us(step, options.steps)))
    rows += _cpp_rows(step, options.steps)
    for backend in ("python", "cpp"):
        with config.patch(COMPILE=False, BACKEND=backend), ae.enabled():
            rows.append((f"runtime ({ae.stats().backend}), compile off",
                         _per_step_us(step, options.steps)))
    for backend in ("python", "cpp"):
        ae.reset()
        # The hot path's cost itself: force the tiny segment to compile (the policy would not).
        with config.patch(MIN_SEGMENT_US=0, MIN_US_PER_OP=0, KEEP_UNPROFITABLE=True,
                          ASYNC=False, BACKEND=backend), ae.enabled():
            for _ in range(8):
                step()
            ae.sync()
            rows.append((f"runtime ({ae.stats().backend}), fused (hot path)",
                         _per_step_us(step, options.steps)))
            stats = ae.stats()
            assert stats.fused_executions > 0
            assert backend == "python" or stats.native_fused_executions > 0, stats
    eager = rows[0][1]
    print(f"8-op pointwise chain, {options.numel} fp32 elements, torch {torch.__version__}")
    print(f"{'path':<36}{'us/step':>9}{'us/op':>8}{'x eager':>9}")
    for name, micros in rows:
        print(f"{name:<36}{micros:>9.1f}{micros / OPS_PER_STEP:>8.1f}{micros / eager:>9.2f}")


if __name__ == "__main__":
    main()
