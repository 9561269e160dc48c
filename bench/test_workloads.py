"""Steady-state step time of every workload × size × mode, with pytest-benchmark.

Each test checks its mode's output against eager's (a twin built from the same seed, run
through the same iterations) before it times anything.
"""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.benchmarks.child import MODES, WARMUP_STEPS
from adaptive_eager.benchmarks.workloads import SIZES, WORKLOADS

# Enough steps for a segment to turn hot (HOT_THRESHOLD) and be sent to the compiler.
RECORD_STEPS = 5


def _prepare(mode: str, fn):
    """(a callable that runs one step in ``mode``, the scope to run it in)."""
    if mode == "compile":
        torch._dynamo.reset()       # workloads share code objects: stay under recompile limits
        return torch.compile(fn), contextlib.nullcontext
    if mode == "adaptive":
        ae.reset()
        # No ae.sync() after each step: no program pays its ~5 us every step. Deferred work a
        # round leaves lands in the next round's time, as it does in the program.
        return fn, ae.enabled
    return fn, contextlib.nullcontext


def _warm_up(run, case, iterations):
    """Record, wait for compiles (adaptive), warm up; the last warm-up step's output."""
    for _ in range(RECORD_STEPS):
        run(*case.inputs(next(iterations)))
    if ae.is_enabled():
        ae.sync(wait_compiles=600)
    for _ in range(WARMUP_STEPS):
        output = run(*case.inputs(next(iterations)))
    return output


def _eager_output(twin, steps: int):
    for iteration in range(steps):
        output = twin.step(iteration)
    return output


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_step(benchmark, name, size, mode):
    workload = WORKLOADS[name]
    missing = workload.missing_requirement()
    if missing:
        pytest.skip(missing)
    case, twin = workload.build(size, "cpu"), workload.build(size, "cpu")
    run, scope = _prepare(mode, case.fn)
    iterations = itertools.count()
    benchmark.group = f"{name} {size}"
    benchmark.extra_info.update(workload=name, size=size, mode=mode)
    with scope():
        output = _warm_up(run, case, iterations)
        torch.testing.assert_close(output, _eager_output(twin, RECORD_STEPS + WARMUP_STEPS),
                                   rtol=workload.tolerance.rtol, atol=workload.tolerance.atol)
        benchmark(lambda: run(*case.inputs(next(iterations))))
        if mode == "adaptive":
            benchmark.extra_info.update(compiles=ae.stats().compiles,
                                        fused_executions=ae.stats().fused_executions)
