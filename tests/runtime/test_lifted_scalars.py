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
    # the CPU's default: one op per parameter, bias corrections passed for Tensor arguments
    "adamw_for_loop": lambda params: (torch.optim.AdamW(params, lr=1e-2, foreach=False), None),
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
def test_optimizer_steps_keep_one_key_fuse_and_match_eager(name, compiler, backend):
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
    if backend == "cpp":            # the C++ hot path matches the lifted floats itself
        assert stats.native_fused_executions == stats.fused_executions, stats


@pytest.mark.inductor
@pytest.mark.parametrize("name", ["adamw", "adamw_for_loop"])
def test_lifted_optimizer_scalars_compile_into_inductor_kernels(name):
    """Note [Lifted foreach scalars] (runtime/graph.py): with Inductor, AdamW's update
    compiles, runs fused and follows its changing bias corrections (Inductor's results are
    close to eager's, not bitwise); the for-loop form's, passed for Tensor arguments, are
    read from 0-dim tensors (Note [Lifted scalars])."""
    model = _model()
    eager_model = copy.deepcopy(model)
    _train(eager_model, OPTIMIZERS[name])
    with config.patch(KEEP_UNPROFITABLE=True), ae.enabled():   # judged elsewhere
        _train(model, OPTIMIZERS[name])
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q)
    stats = ae.stats()
    assert stats.lifted_positions > 0 and stats.compile_failures == 0, stats
    assert stats.fused_executions > 0, stats


def test_a_float_for_a_tensor_argument_lifts_only_beside_a_dimensioned_float(compiler, backend):
    """Note [Lifted scalars]: ``x / s`` passes ``s`` as a wrapped number, lifted as a 0-dim
    float64 tensor. Beside a 0-dim or an integer tensor such a tensor would promote the
    result to float64 (a wrapped number does not): there ``s`` stays a key part."""
    vector, scalar, integers = torch.randn(64), torch.tensor(1.5), torch.arange(64)

    scales = [1.0 + k / 7 for k in range(12)]
    expected = [[(x * 2 + 1) / s for x in (vector, scalar, integers)] for s in scales]
    with ae.enabled():
        for s, eager_results in zip(scales, expected):
            for x, eager_result in zip((vector, scalar, integers), eager_results):
                assert_equal((x * 2 + 1) / s, eager_result, bitwise=True)   # (a segment each)
    stats = ae.stats()
    assert stats.lifted_positions > 0 and stats.fused_executions > 0, stats
