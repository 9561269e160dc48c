"""Hot loops under the runtime equal eager, and the stats prove they really ran fused."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae
from adaptive_eager.config import config
from helpers import assert_equal

# Both interception backends (tests/conftest.py: backend).
pytestmark = pytest.mark.usefixtures("backend")

ITERS = 6


def pointwise_chain(x):
    y = (x * 1.5 + 0.25).sin()
    y = y * y - 0.5
    return torch.tanh(y) * 3.0 + x


class Block(torch.nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + F.gelu(self.linear(self.norm(x)))


def attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(scores, dim=-1) @ v


def _fused_ran(min_runs=1):
    stats = ae.stats()
    assert stats.compiles >= 1, stats
    assert stats.fused_executions >= min_runs, stats
    return stats


def test_pointwise_chain_runs_fused():
    x = torch.randn(64, 32)
    expected = pointwise_chain(x)
    with ae.enabled():
        results = [pointwise_chain(x) for _ in range(ITERS)]
    for got in results:
        assert_equal(got, expected)
    stats = _fused_ran(min_runs=ITERS - 3)
    assert stats.divergences == 0


def test_inference_mode_runs_fused():
    x = torch.randn(64, 32)
    expected = pointwise_chain(x)
    with torch.inference_mode(), ae.enabled():
        acc = torch.zeros(64, 32)
        results = []
        for _ in range(ITERS):
            out = pointwise_chain(x)
            acc.add_(out)
            results.append(out)
    for got in results:
        assert_equal(got, expected)
    assert_equal(acc, expected * ITERS)
    _fused_ran(min_runs=ITERS - 3)


def test_layernorm_gelu_residual_forward_and_backward():
    torch.manual_seed(0)
    eager_block = Block()
    block = copy.deepcopy(eager_block)
    x = torch.randn(8, 32, requires_grad=True)
    eager_block(x).sum().backward()
    expected_grads = [p.grad.clone() for p in eager_block.parameters()] + [x.grad.clone()]
    with ae.enabled():
        for _ in range(ITERS):
            block.zero_grad(set_to_none=True)
            x.grad = None
            out = block(x)
            out.sum().backward()
    assert_equal(out, eager_block(x))
    for got, want in zip([p.grad for p in block.parameters()] + [x.grad], expected_grads):
        assert_equal(got, want)
    _fused_ran(min_runs=2)


def test_softmax_attention():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    expected = attention(q, k, v)
    with ae.enabled():
        results = [attention(q, k, v) for _ in range(ITERS)]
    for got in results:
        assert_equal(got, expected)
    _fused_ran()


def test_autocast_bfloat16_block():
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = block(x)
        with ae.enabled():
            results = [block(x) for _ in range(ITERS)]
    assert block.linear(x).dtype == torch.float32   # outside autocast again
    for got in results:
        assert got.dtype == expected.dtype
        assert_equal(got, expected)
    _fused_ran(min_runs=2)


def _train(model, optimizer, data, target, steps):
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(data), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def test_training_with_adamw_foreach_equals_eager():
    data, target = torch.randn(8, 16), torch.randn(8, 4)
    eager_model, eager_opt = _model_and_optimizer()
    model, opt = _model_and_optimizer()
    eager_losses = _train(eager_model, eager_opt, data, target, ITERS)
    with ae.enabled():
        losses = _train(model, opt, data, target, ITERS)
    assert_equal(losses, eager_losses)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert type(p) is torch.nn.Parameter and type(p.grad) is torch.Tensor
        assert_equal(p, q)
        assert_equal(p.grad, q.grad)
        assert p._version == q._version
    for state, eager_state in zip(opt.state.values(), eager_opt.state.values()):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert_equal(state[name], eager_state[name])
    _fused_ran(min_runs=3)


@pytest.mark.inductor
def test_inductor_pointwise_chain():
    x = torch.randn(256, 64)
    expected = pointwise_chain(x)
    with ae.enabled():
        results = [pointwise_chain(x) for _ in range(4)]
    for got in results:
        assert_equal(got, expected)
    _fused_ran(min_runs=2)


def _generated_code(run):
    """``run()``'s result and the kernels' code Inductor generated meanwhile (its FX graph
    cache off: a graph an earlier test compiled would be loaded, not generated)."""
    from torch._inductor.utils import run_and_get_code
    with torch._inductor.config.patch(fx_graph_cache=False):
        return run_and_get_code(run)


def _calls(code: str) -> list[str]:
    """The kernels a generated ``call`` makes, in order: ``cpp_fused`` (Inductor's fused
    C++ kernels) and ``extern_kernels.mm``-like library calls."""
    return ["cpp_fused" if name.startswith("cpp_fused_") else name
            for name in re.findall(r"\b(cpp_fused_\w+|extern_kernels\.\w+)\(", code)]


@pytest.mark.inductor
def test_inductor_matmul_block_calls_the_matmul_between_fused_kernels():
    """A segment with a matmul in it compiles whole: the matmul stays a library call and
    the pointwise work around it fuses (LayerNorm before it; bias, GELU and residual
    after). Its fused runs equal eager."""
    block, x = Block(64), torch.randn(256, 64)
    with torch.no_grad():
        expected = block(x)

        def run():
            with ae.enabled():
                return [block(x) for _ in range(4)]
        results, codes = _generated_code(run)
    for got in results:
        assert_equal(got, expected)
    _fused_ran(min_runs=2)
    assert [_calls(code) for code in codes] == \
        [["cpp_fused", "extern_kernels.addmm", "cpp_fused"]]


@pytest.mark.inductor
def test_inductor_training_step_equals_eager():
    """Forward and backward each compile with their matmuls inside: Inductor calls them as
    library kernels between fused ones (GELU, LayerNorm and the loss, and their
    gradients)."""
    data, target = torch.randn(8, 16), torch.randn(8, 4)
    eager_model, eager_opt = _model_and_optimizer()
    model, opt = _model_and_optimizer()
    eager_losses = _train(eager_model, eager_opt, data, target, 4)

    def run():
        with ae.enabled():
            return _train(model, opt, data, target, 4)
    losses, codes = _generated_code(run)
    assert_equal(losses, eager_losses)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert_equal(p, q)
        assert_equal(p.grad, q.grad)
    stats = _fused_ran(min_runs=2)
    assert stats.compile_failures == 0, stats.fallbacks
    with_matmuls = [calls for calls in map(_calls, codes)
                    if "cpp_fused" in calls and any(c.startswith("extern_kernels.") for c in calls)]
    assert len(with_matmuls) >= 2, [_calls(code) for code in codes]    # forward, backward


def _recycling_chain(x, y):
    a = x * 2
    b = a.sin()
    del a                                  # dead mid-segment: its pooled buffer comes back
    c = b * y
    d = c.exp()
    del c
    return ((d * b).tanh() + x).relu() * y.sigmoid()


def _pooled_chain_under_autograd_equals_eager(chain):
    """``chain`` on two 2 MiB inputs, and its gradients, under the runtime (fused from its
    second call on) equal eager's."""
    def run():
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randn(512, 1024, generator=g, requires_grad=True) for _ in range(2))
        out = chain(x, y)
        out.sum().backward()
        return [out.detach(), x.grad, y.grad]

    expected = run()
    with config.patch(HOT_THRESHOLD=1), ae.enabled():
        runs = [run() for _ in range(5)]
    for got in runs:
        assert_equal(got, expected)
    _fused_ran(min_runs=2)


def test_pooled_buffers_handed_out_again_under_autograd(compiler):
    """Outputs of >= 1 MiB come from the buffer pool, which hands a dead intermediate's buffer
    to a later op of the same deferred run; its gradients equal eager's (on cpp they differed:
    the buffer's earlier output was taken for live, Note [Shallow copies])."""
    _pooled_chain_under_autograd_equals_eager(_recycling_chain)


def _result_kept_only_by_autograd(x, y):
    a = x * 2.0
    b = a * 3.0            # (a product with a number saves nothing: `a` is dead here)
    del a
    c = b.tanh()           # on a's pooled buffer again; tanh's backward keeps its result
    del b
    d = c * 0.5
    del c                  # only autograd's shallow copy of `c` is left
    return (d + x) * y


def test_a_pooled_output_only_autograd_keeps_is_written(compiler):
    """A pooled buffer handed out again whose output only autograd's (unseen) copy keeps
    must still be written: on cpp its backward read the buffer's earlier output (judged
    dead: the pool's Python storage object came back for the use count, adding none)."""
    _pooled_chain_under_autograd_equals_eager(_result_kept_only_by_autograd)
