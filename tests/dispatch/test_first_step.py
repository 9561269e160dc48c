"""An optimizer's first step, which builds its state, runs plainly (Note [First optimizer step])."""
import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import adaptive_eager as ae
from adaptive_eager.dispatch.mode import AdaptiveMode
from helpers import assert_equal


def _model_and_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.randn(5, 8), torch.randn(5, 4)


def _ops_seen_by_step(optimizer_class, steps: int, **options) -> tuple[list, list]:
    """Ops the runtime saw during each optimizer step, and the parameters after training."""
    model, data, target = _model_and_batch()
    opt = optimizer_class(model.parameters(), **options)
    seen = []
    with ae.enabled():
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(data), target).backward()
            before = ae.stats().ops_seen
            opt.step()
            seen.append(ae.stats().ops_seen - before)
        params = [p.detach().clone() for p in model.parameters()]
    return seen, params


def _eager_params(optimizer_class, steps: int, **options) -> list:
    model, data, target = _model_and_batch()
    opt = optimizer_class(model.parameters(), **options)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(data), target).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


# The step's record_function range: its enter runs before the optimizer's pre-hooks, its exit
# after the post-hooks, so both reach the mode whatever the step does.
PROFILER_RANGE_OPS = 2


@pytest.mark.parametrize("optimizer_class, options", [
    (torch.optim.AdamW, {"foreach": True}),
    (torch.optim.AdamW, {"foreach": False}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
])
def test_the_first_step_runs_plainly_and_later_ones_are_watched(optimizer_class, options):
    seen, params = _ops_seen_by_step(optimizer_class, 3, **options)
    assert seen[0] == PROFILER_RANGE_OPS
    assert seen[1] > PROFILER_RANGE_OPS and seen[2] > PROFILER_RANGE_OPS
    for got, expected in zip(params, _eager_params(optimizer_class, 3, **options)):
        assert_equal(got, expected)


def test_an_optimizer_without_state_sits_out_once_not_every_step():
    seen, _ = _ops_seen_by_step(torch.optim.SGD, 3, lr=0.1)     # no momentum: state stays empty
    assert seen[0] == PROFILER_RANGE_OPS
    assert seen[1] > PROFILER_RANGE_OPS and seen[2] > PROFILER_RANGE_OPS


def test_an_optimizer_with_loaded_state_is_watched_from_its_first_step():
    model, data, target = _model_and_batch()
    trained = torch.optim.AdamW(model.parameters())
    torch.nn.functional.mse_loss(model(data), target).backward()
    trained.step()
    resumed = torch.optim.AdamW(model.parameters())
    resumed.load_state_dict(trained.state_dict())
    with ae.enabled():
        before = ae.stats().ops_seen
        resumed.step()
        assert ae.stats().ops_seen - before > PROFILER_RANGE_OPS


class _FailingFirstStep(torch.optim.SGD):
    def step(self, closure=None):
        if not getattr(self, "failed_once", False):
            self.failed_once = True
            raise RuntimeError("first step fails")
        return super().step(closure)


@pytest.mark.python_mode          # checks the mode stack
def test_a_first_step_that_raises_gives_the_mode_back_at_the_next_control_point():
    model, data, target = _model_and_batch()
    opt = _FailingFirstStep(model.parameters(), lr=0.1)
    with ae.enabled():
        with pytest.raises(RuntimeError, match="first step fails"):
            opt.step()
        assert not isinstance(_get_current_dispatch_mode(), AdaptiveMode)   # still sitting out
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()                                   # a control point: back from here
        assert isinstance(_get_current_dispatch_mode(), AdaptiveMode)
        before = ae.stats().ops_seen
        opt.step()
        assert ae.stats().ops_seen - before > PROFILER_RANGE_OPS
    assert not ae.is_enabled()


class _Outer(torch.optim.Optimizer):
    """Steps an inner optimizer inside its own step, as wrappers (ZeRO, lookahead) do."""

    def __init__(self, inner):
        super().__init__(inner.param_groups[0]["params"], {})
        self.inner = inner
        self.mode_during_inner_step_end = None

    def step(self, closure=None):
        self.inner.step()
        self.mode_during_inner_step_end = _get_current_dispatch_mode()


@pytest.mark.python_mode          # checks the mode stack
def test_an_inner_optimizer_step_does_not_end_the_outer_ones_sitting_out():
    model, data, target = _model_and_batch()
    outer = _Outer(torch.optim.AdamW(model.parameters()))
    with ae.enabled():
        torch.nn.functional.mse_loss(model(data), target).backward()
        outer.step()
        assert outer.mode_during_inner_step_end is None          # still plain after inner
        assert isinstance(_get_current_dispatch_mode(), AdaptiveMode)   # back after outer


@pytest.mark.python_mode          # checks the mode stack
def test_disabling_during_the_first_step_leaves_the_mode_off():
    model, data, target = _model_and_batch()

    class DisablingSGD(torch.optim.SGD):
        def step(self, closure=None):
            ae.disable()
            return super().step(closure)
    opt = DisablingSGD(model.parameters(), lr=0.1)
    ae.enable()
    torch.nn.functional.mse_loss(model(data), target).backward()
    opt.step()
    assert not ae.is_enabled()
    assert _get_current_dispatch_mode() is None


def test_the_first_step_of_an_optimizer_without_weak_references_is_watched(monkeypatch):
    from adaptive_eager.dispatch import control

    class NoWeakRefs:
        def add(self, _optimizer):
            raise TypeError("cannot create weak reference")

        def __contains__(self, _optimizer):
            return False
    monkeypatch.setattr(control, "_stepped", NoWeakRefs())
    seen, params = _ops_seen_by_step(torch.optim.AdamW, 2)
    assert seen[0] > PROFILER_RANGE_OPS
    for got, expected in zip(params, _eager_params(torch.optim.AdamW, 2)):
        assert_equal(got, expected)
