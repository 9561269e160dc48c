"""The hot path with real TorchInductor kernels: buffers written in place, inputs mutated,
views, divergence. (Slow: each new graph compiles for a second or more.)"""
import pytest
import torch

import adaptive_eager as ae
from helpers import assert_equal

pytestmark = pytest.mark.inductor


def step(x, acc):
    y = (x * 2 + 1).sin()
    acc.add_(y)                             # in-place update of a user tensor
    return y.t()[1:], (y * y).cos()         # a view of an intermediate, and a fresh output


def test_inductor_kernels_write_outputs_views_and_mutated_inputs():
    x = torch.randn(16, 8)
    eager_acc, acc = torch.zeros(16, 8), torch.zeros(16, 8)
    expected = [step(x, eager_acc) for _ in range(5)]
    with ae.enabled():
        got = [step(x, acc) for _ in range(5)]
        arrays = got[-1][1].numpy().copy()
    assert ae.stats().fused_executions >= 2 and ae.stats().compile_failures == 0
    assert_equal(got, expected)
    assert_equal(acc, eager_acc)
    assert acc._version == eager_acc._version
    assert_equal(torch.from_numpy(arrays), expected[-1][1])


def test_inductor_divergence_replays_into_the_same_buffers():
    x = torch.randn(8, 8)
    acc = torch.zeros(8, 8)
    with ae.enabled():
        for _ in range(4):
            step(x, acc)
        other = (x * 2 + 1).sin().exp()     # same first ops, then different
        ae.sync()
    assert ae.stats().divergences >= 1
    assert_equal(other, (x * 2 + 1).sin().exp())
