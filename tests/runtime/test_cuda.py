"""The same path on CUDA tensors (skipped without a GPU; CI has none)."""
import copy

import pytest
import torch

import adaptive_eager as ae
from helpers import assert_equal

pytestmark = pytest.mark.cuda


def chain(x):
    return ((x * 2 + 1).sin() * 3).cos() + x


def test_cuda_chain_runs_fused_and_equals_eager(compiler):
    x = torch.randn(1024, device="cuda")
    expected = chain(x)
    with ae.enabled():
        outs = [chain(x) for _ in range(5)]
    for out in outs:
        assert out.device.type == "cuda"
        assert_equal(out, expected)
    assert ae.stats().fused_executions >= 2


def test_cuda_to_cpu_copy_is_a_boundary(compiler):
    x = torch.randn(64, device="cuda")
    with ae.enabled():
        for _ in range(4):
            y = chain(x).cpu()
    assert ae.stats().fallbacks["cross_device"] >= 4
    assert_equal(y, chain(x).cpu())


@pytest.mark.inductor
def test_cuda_inductor_training_step_equals_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.LayerNorm(64)).cuda()
    reference = copy.deepcopy(model)
    data = torch.randn(16, 32, device="cuda")

    def train(module, steps=4):
        opt = torch.optim.AdamW(module.parameters(), foreach=True)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = module(data).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses
    expected = train(reference)
    with ae.enabled():
        losses = train(model)
    assert ae.stats().fused_executions >= 1 and ae.stats().compile_failures == 0
    # Inductor's fused kernels round differently from eager's: close, not bitwise.
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-4, atol=1e-5)
    for param, eager_param in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, eager_param, rtol=1e-4, atol=1e-5)
