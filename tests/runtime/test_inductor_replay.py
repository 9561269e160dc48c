"""The hot path with real TorchInductor kernels: buffers written in place, inputs mutated,
views, divergence. (Slow: each new graph compiles for a second or more.)"""
import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import config
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


def test_outputs_autograd_saved_keep_their_versions():
    """A fused forward whose outputs a later segment's ops save for backward (LayerNorm saves
    its input, addmm the LayerNorm's output): Inductor's writes into the output buffers bumped
    their version counters, and backward raised "modified by an inplace operation"."""
    torch.manual_seed(0)
    lin, norm = torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)

    def step(x):
        y = norm(torch.nn.functional.gelu(lin(x)) + x)
        (y.sum() + lin(y).sum()).backward()
        grads = [p.grad.clone() for p in (*lin.parameters(), *norm.parameters())]
        for p in (*lin.parameters(), *norm.parameters()):
            p.grad = None
        return grads

    inputs = [torch.randn(8, 64) for _ in range(5)]
    expected = [step(x) for x in inputs]
    with ae.enabled():
        got = [step(x) for x in inputs]
        assert ae.stats().fused_executions >= 2
    for g, e in zip(got, expected):
        for actual, wanted in zip(g, e):
            torch.testing.assert_close(actual, wanted)


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


def test_a_loop_that_drops_its_results_fuses_through_the_worker():
    # Nothing is live when each segment ends: its final result counts as live (Note [Results
    # thrown away]). Before, the worker's kernel had no output, could not be saved, and the
    # key failed for good.
    x = torch.randn(4096)
    chain = lambda t: ((t * 2 + 1).sin() * 3).cos()       # noqa: E731
    with config.patch(ASYNC=True, COMPILE_TIMEOUT_S=120), ae.enabled():
        for _ in range(4):
            chain(x)
        ae.sync(wait_compiles=120)
        for _ in range(3):
            chain(x)
        kept = chain(x)
        ae.sync()
    stats = ae.stats()
    assert stats.compiles == 1 and stats.compile_failures == 0
    assert stats.fused_executions >= 3
    assert_equal(kept, chain(x))


def test_a_cat_with_a_legacy_empty_tensor_keeps_eagers_layout_in_the_kernel():
    """Transformers' key cache starts as ``torch.tensor([])``: eager's ``cat([empty, k])``
    returns a contiguous tensor, Inductor's decomposition a clone in ``k``'s own (transposed)
    layout, so the reshape that ``matmul`` records with eager's strides could not be traced:
    GPT-2's attention failed to compile."""
    empty = torch.tensor([])

    def attend(x, q):
        k = (x * 2).view(2, 12, 4, 8).transpose(1, 2)
        k = torch.cat([empty, k], dim=-2)
        return torch.matmul(q, k.transpose(-1, -2) * 0.5).softmax(-1)

    x, q = torch.randn(2, 12, 32), torch.randn(2, 4, 12, 8)
    expected = attend(x, q)
    with ae.enabled():
        got = [attend(x, q) for _ in range(4)]
        ae.sync()
    stats = ae.stats()
    assert stats.compile_failures == 0 and stats.fused_executions >= 2
    for result in got:
        torch.testing.assert_close(result, expected)
