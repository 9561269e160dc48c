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


# For subprocesses that test mechanics on tiny tensors: the cost gates of the adaptive policy
# would (rightly) keep such segments per-op. The fresh_runtime fixture does this in-process.
MECHANICS_ENV = {"NEURON_ADAPTIVE_EAGER_MIN_SEGMENT_US": "0",
                 "NEURON_ADAPTIVE_EAGER_KEEP_UNPROFITABLE": "1",
                 "NEURON_ADAPTIVE_EAGER_ASYNC": "0"}
