"""Helpers for comparing the runtime against plain eager PyTorch, the oracle."""
from __future__ import annotations

import copy
from typing import Callable

import torch

import adaptive_eager as ae


def assert_equal(actual, expected, bitwise: bool = False) -> None:
    """Same structure and values; ``bitwise`` demands identical bits (compilation off)."""
    if isinstance(expected, torch.Tensor):
        assert type(actual) is type(expected), (type(actual), type(expected))
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        if bitwise:
            assert torch.equal(actual, expected) or (
                actual.isnan().equal(expected.isnan())
                and torch.equal(actual.nan_to_num(), expected.nan_to_num())), \
                f"max diff {(actual.double() - expected.double()).abs().max()}"
        else:
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_equal(a, e, bitwise)
    else:
        assert actual == expected


def run_both(make_state: Callable[[], object], step: Callable[[object], object], iters: int):
    """Run ``step`` ``iters`` times on two identical states, eagerly and under the runtime.

    Returns (eager results, adaptive results, eager state, adaptive state)."""
    eager_state = make_state()
    adaptive_state = copy.deepcopy(eager_state)
    eager_results = [step(eager_state) for _ in range(iters)]
    with ae.enabled():
        adaptive_results = [step(adaptive_state) for _ in range(iters)]
    return eager_results, adaptive_results, eager_state, adaptive_state


# Tests of the mechanics run tiny tensors, which the adaptive policy's cost gates would
# (rightly) keep per-op, and want compiles to happen now, in the test's thread. The
# fresh_runtime fixture applies these in-process; subprocesses get them as MECHANICS_ENV.
MECHANICS = {"MIN_SEGMENT_US": 0, "MIN_US_PER_OP": 0, "MAX_EXTERN_PERCENT": 100,
             "KEEP_UNPROFITABLE": True, "ASYNC": False, "PAUSE": False, "COMPILE_COST_MS": 0}
MECHANICS_ENV = {f"NEURON_ADAPTIVE_EAGER_{name}": str(int(value))
                 for name, value in MECHANICS.items()}
