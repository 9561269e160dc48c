"""A complete small training loop under the runtime equals eager, step for step."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import adaptive_eager as ae
from helpers import assert_equal

# Both interception backends (tests/conftest.py: backend).
pytestmark = pytest.mark.usefixtures("backend")


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 4))
    return model, data


def _train(model, data, epochs=3):
    torch.manual_seed(1)                            # same shuffling and dropout masks
    loader = DataLoader(data, batch_size=8, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    losses = []
    for _ in range(epochs):
        for inputs, targets in loader:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(model(inputs).float(), targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            opt.step()
            schedule.step()
            losses.append(loss.item())
    return losses, opt


def test_dataloader_autocast_clipping_scheduler_loop_equals_eager():
    model, data = _setup()
    eager_model = copy.deepcopy(model)
    eager_losses, eager_opt = _train(eager_model, data)
    with ae.enabled():
        losses, opt = _train(model, data)
    assert losses == eager_losses                   # bitwise: the same floats
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert_equal(p, q, bitwise=True)
    for state, eager_state in zip(opt.state.values(), eager_opt.state.values()):
        assert_equal(state["exp_avg_sq"], eager_state["exp_avg_sq"], bitwise=True)
    stats = ae.stats()
    assert stats.fused_executions > 0 and stats.fallbacks["random"] > 0   # dropout stays eager
