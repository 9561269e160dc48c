"""Note [Lifted scalars] (runtime/scalars.py): floats that change every step are kernel
inputs, so an optimizer step keeps one key and fuses, and computes what eager computes."""
import copy

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from helpers import assert_equal

pytestmark = pytest.mark.usefixtures("backend")

STEPS = 16


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


OPTIMIZERS = {
    "adamw": lambda params: (torch.optim.AdamW(params, lr=1e-2, foreach=True), None),
    "adam_cosine": lambda params: _with_schedule(
        torch.optim.Adam(params, lr=1e-2, foreach=True),
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)),
    "sgd_momentum_steplr": lambda params: _with_schedule(
        torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=True),
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)),
}


def _with_schedule(optimizer, make_schedule):
    return optimizer, make_schedule(optimizer)


def _train(model, make_optimizer, keys_per_step=None):
    optimizer, schedule = make_optimizer(model.parameters())
    torch.manual_seed(1)
    data, target = torch.randn(32, 8), torch.randn(32, 4)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
        losses.append(loss.detach().clone())
        if keys_per_step is not None:
            ae.sync()
            keys_per_step.append(ae.stats().keys_seen)
    return losses, optimizer


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_steps_keep_one_key_fuse_and_match_eager(name, compiler):
    model = _model()
    eager_model = copy.deepcopy(model)
    eager_losses, eager_optimizer = _train(eager_model, OPTIMIZERS[name])
    keys = []
    with ae.enabled():
        losses, optimizer = _train(model, OPTIMIZERS[name], keys)
    for loss, eager_loss in zip(losses, eager_losses):
        assert_equal(loss, eager_loss, bitwise=True)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert_equal(p, q, bitwise=True)
    for state, eager_state in zip(optimizer.state.values(), eager_optimizer.state.values()):
        for field, value in state.items():
            assert_equal(value, eager_state[field], bitwise=True)
    stats = ae.stats()
    assert stats.lifted_positions > 0
    assert keys[-1] == keys[-4], f"new keys in the last steps: {keys}"
    lifted_graphs = [g for g in compiler.graphs
                     if any(n.target is torch.ops.aten._local_scalar_dense.default
                            for n in g.graph.nodes)]
    assert lifted_graphs, "no kernel reads a lifted scalar"
    assert not [n for g in lifted_graphs for n in g.graph.nodes     # Note [Lifted foreach
                if getattr(n.target, "_overloadname", "") == "ScalarList"]   # scalars]
    assert stats.fused_executions > 0


@pytest.mark.inductor
def test_lifted_optimizer_scalars_compile_into_inductor_kernels():
    """Note [Lifted foreach scalars] (runtime/graph.py): with Inductor, AdamW's update
    compiles, runs fused and follows its changing bias corrections (Inductor's results are
    close to eager's, not bitwise)."""
    model = _model()
    eager_model = copy.deepcopy(model)
    _train(eager_model, OPTIMIZERS["adamw"])
    with config.patch(KEEP_UNPROFITABLE=True), ae.enabled():   # judged elsewhere
        _train(model, OPTIMIZERS["adamw"])
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q)
    stats = ae.stats()
    assert stats.lifted_positions > 0 and stats.compile_failures == 0, stats
    assert stats.fused_executions > 0, stats
