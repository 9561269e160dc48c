"""The same path on CUDA tensors (skipped without a GPU; CI has none)."""
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
def test_cuda_inductor_training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.LayerNorm(64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    data = torch.randn(16, 32, device="cuda")
    with ae.enabled():
        for _ in range(4):
            opt.zero_grad()
            model(data).pow(2).mean().backward()
            opt.step()
    assert ae.stats().fused_executions >= 1 and ae.stats().compile_failures == 0
