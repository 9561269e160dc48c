"""Judging the runtime by the program's steps (Note [Judged by the step] in
runtime/step_judge.py): intercepting and paused windows of control points, side by side; the
runtime pauses when paused steps are faster. Times are stated (FakeClock), never measured."""
import math

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.runtime import engine, step_judge
from adaptive_eager.runtime.step_judge import (FIRST_PROBE_S, KEEP_FIRST_S, PAUSE_FIRST_S,
                                               WINDOW, Action, Judge, State)
from helpers import assert_equal


def _probe(judge: Judge, start: float, intercepting_s: float, paused_s: float,
           answers: int = 0, plain_s: float | None = None) -> list:
    """Pass the control points of one probe (each window's points evenly spaced in time);
    the actions the judge asked for, in order, with the point's index. ``plain_s``: a pause
    would keep kernels, and a plain paused window takes this long (``paused_s`` is then the
    window that keeps them)."""
    now, actions = start, []
    kernels = plain_s is not None
    assert judge.at_point(now, True, answers, kernels=kernels) is Action.NONE   # starts it
    seconds_of = (intercepting_s, paused_s) + ((plain_s,) if kernels else ())
    for window in range(len(seconds_of) * step_judge.ROUNDS):
        seconds = seconds_of[window % len(seconds_of)]
        for point in range(WINDOW):
            now += seconds / WINDOW
            action = judge.at_point(now, True, answers, kernels=kernels)
            if action is not Action.NONE:
                actions.append((window * WINDOW + point, action))
    return actions


def test_paused_windows_that_are_faster_give_a_pause_that_doubles():
    judge = Judge.starting_at(0.0)
    actions = _probe(judge, FIRST_PROBE_S, intercepting_s=1.0, paused_s=0.9)
    last = 4 * WINDOW - 1
    assert actions == [(WINDOW - 1, Action.PAUSE_WINDOW), (2 * WINDOW - 1, Action.RESUME),
                       (3 * WINDOW - 1, Action.PAUSE_WINDOW), (last, Action.PAUSE)]
    assert judge.last_times == pytest.approx((2.0, 1.8))
    assert (judge.paused_for(), judge.paused_for()) == (PAUSE_FIRST_S, 2 * PAUSE_FIRST_S)
    assert judge.verdicts == 1


@pytest.mark.parametrize("paused_s", [1.1, 0.99])     # slower; faster but within MARGIN
def test_no_pause_unless_paused_windows_win_by_the_margin(paused_s):
    judge = Judge.starting_at(0.0)
    actions = _probe(judge, FIRST_PROBE_S, intercepting_s=1.0, paused_s=paused_s)
    assert actions[-1] == (4 * WINDOW - 1, Action.RESUME)       # back from its paused window
    assert judge.verdicts == 0 and not judge.probing
    end = FIRST_PROBE_S + 2 * (1.0 + paused_s)
    assert judge.at_point(end + KEEP_FIRST_S - 0.01, True, 0) is Action.NONE
    assert not judge.probing                                    # the next probe waits
    judge.at_point(end + KEEP_FIRST_S + 0.01, True, 0)
    assert judge.probing


def _window_starts(rounds_of: tuple, verdict: Action) -> list:
    """The actions of a probe whose rounds are windows starting with ``rounds_of``, then
    ``verdict`` at its last point."""
    starts = [rounds_of[(window + 1) % len(rounds_of)]
              for window in range(len(rounds_of) * step_judge.ROUNDS - 1)]
    ends = [(window + 1) * WINDOW - 1 for window in range(len(starts) + 1)]
    return list(zip(ends, starts + [verdict]))


_ROUND_WITH_KERNELS = (Action.RESUME, Action.PAUSE_WINDOW, Action.PLAIN_WINDOW)


@pytest.mark.parametrize("kernels_s, plain_s, verdict", [
    (0.85, 0.89, Action.PAUSE),         # kernels kept: faster than plain by the margin
    (0.9, 0.89, Action.PAUSE_PLAIN),    # kernels not clearly faster than plain: plain
    (0.9, 0.8, Action.PAUSE_PLAIN),     # plain beats kernels kept
    (0.99, 0.9, Action.PAUSE_PLAIN),    # plain beats intercepting, kernels kept do not
    (1.2, 1.1, Action.RESUME),          # intercepting is fastest
])
def test_a_pause_that_would_keep_kernels_is_timed_without_them_too(kernels_s, plain_s, verdict):
    """Paused windows that keep kernels and plain ones (the key out), in turn with the
    intercepting ones; the fastest state wins, by the margin over the state before it."""
    judge = Judge.starting_at(0.0)
    actions = _probe(judge, FIRST_PROBE_S, intercepting_s=1.0, paused_s=kernels_s,
                     plain_s=plain_s)
    assert actions == _window_starts(_ROUND_WITH_KERNELS, verdict)
    assert judge.verdicts == (verdict is not Action.RESUME)
    assert judge.last_times == pytest.approx((2.0, 2 * min(kernels_s, plain_s)))
    assert not judge.probing


def _probe_by_points(judge: Judge, now: float, point_s) -> tuple[list, dict]:
    """Run a probe whose points take ``point_s(state, window number)`` each; the actions
    asked for, and how many points each state's windows ran."""
    judge.at_point(now, True, 0, kernels=True)
    points, actions, windows = dict.fromkeys(State, 0), [], 0
    while judge.probing:
        points[judge.window] += 1
        now += point_s(judge.window, windows)
        action = judge.at_point(now, True, 0, kernels=True)
        if action is not Action.NONE:
            actions.append(action)
            windows += 1
    return actions, points


def test_a_paused_window_that_loses_by_far_ends_early_and_a_state_that_always_loses_is_out():
    """Kernels that run 10x faster than plain eager: each plain window ends once it took
    LOSING times the fastest window, and plain, lost in both rounds, is out of the verdict."""
    judge = Judge.starting_at(0.0)
    step_s = {State.INTERCEPTING: 0.01, State.KERNELS: 0.01, State.PLAIN: 0.1}
    actions, points = _probe_by_points(judge, FIRST_PROBE_S, lambda state, _: step_s[state])
    assert 0 < points[State.PLAIN] <= 6     # LOSING x 16 fast points at 10x: ~2 a window
    assert actions == list(_ROUND_WITH_KERNELS[1:] + _ROUND_WITH_KERNELS) + [Action.RESUME]
    assert judge.last_totals[State.PLAIN] == float("inf") and judge.verdicts == 0


def test_a_window_lost_to_a_slow_stretch_does_not_rule_its_state_out():
    """The machine slows 3x through the first plain window only: that window is lost, the
    second is whole, and plain (faster than the other states) is the verdict."""
    judge = Judge.starting_at(0.0)
    step_s = {State.INTERCEPTING: 0.01, State.KERNELS: 0.009, State.PLAIN: 0.008}

    def point_s(state, window):
        return step_s[state] * (3 if window == 2 else 1)     # window 2: the first plain one

    actions, points = _probe_by_points(judge, FIRST_PROBE_S, point_s)
    assert points[State.PLAIN] < 2 * WINDOW                    # its first window was lost
    assert actions[-1] is Action.PAUSE_PLAIN and judge.verdicts == 1
    assert judge.last_totals[State.PLAIN] == pytest.approx(2 * WINDOW * 0.008)


def test_a_probe_is_abandoned_from_its_plain_window_back_to_intercepting():
    judge = Judge.starting_at(0.0)
    now = FIRST_PROBE_S
    judge.at_point(now, True, 0, kernels=True)
    for _ in range(2 * WINDOW):                                 # into the plain window
        now += 0.01
        judge.at_point(now, True, 0, kernels=True)
    assert judge.window is State.PLAIN and judge.paused_window
    assert judge.at_point(now + 0.01, True, answers=1, kernels=True) is Action.RESUME
    assert judge.window is None and judge.verdicts == 0


def test_no_probe_before_the_first_delay_or_while_compiles_run():
    judge = Judge.starting_at(10.0)
    judge.at_point(10.0 + FIRST_PROBE_S - 0.01, settled=True, answers=0)
    assert not judge.probing
    judge.at_point(10.0 + FIRST_PROBE_S, settled=False, answers=0)
    assert not judge.probing
    judge.at_point(10.0 + FIRST_PROBE_S, settled=True, answers=0)
    assert judge.probing


def test_a_compile_answered_mid_probe_abandons_it_and_resumes():
    judge = Judge.starting_at(0.0)
    now = FIRST_PROBE_S
    judge.at_point(now, True, answers=3)
    for _ in range(WINDOW):                                     # into the paused window
        now += 0.01
        judge.at_point(now, True, answers=3)
    assert judge.paused_window
    assert judge.at_point(now + 0.01, True, answers=4) is Action.RESUME
    assert not judge.probing and judge.verdicts == 0


# ------------------------------------------------------------ in a training loop

def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _train(model, steps: int, step_s=None, fake_clock=None) -> list:
    """AdamW steps on fixed data (two control points a step: backward and the optimizer
    step); ``step_s(paused)`` is the time a step takes, stated on the fake clock."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if fake_clock is not None:
            fake_clock.advance(step_s(ae.is_paused()))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("paused_faster", [True, False])
def test_a_training_loop_pauses_only_if_its_paused_steps_are_faster(fake_clock, paused_faster):
    """The kernels here keep pausing's own window empty (KEEP_UNPROFITABLE: never judged
    unprofitable), so only the judge can pause it; its steps are 100 ms intercepting and 80
    ms (or 120 ms) paused. Results are eager's either way."""
    expected_model = _model()
    expected = _train(expected_model, 160)
    model = _model()
    with config.patch(PAUSE=True), ae.enabled():
        losses = _train(model, 160, lambda paused: (0.08 if paused_faster else 0.12)
                        if paused else 0.1, fake_clock)
        [runtime] = engine.live_runtimes()
        judge = runtime.judge
        fused = ae.stats().fused_executions
    assert fused > 0
    assert judge.verdicts == (1 if paused_faster else 0), judge
    intercepting_s, paused_s = judge.last_times             # of the probe's verdict
    assert intercepting_s > 0 and (paused_s < intercepting_s) == paused_faster, judge
    for got, want in zip(losses, expected):
        assert_equal(got, want, bitwise=True)
    for got, want in zip(model.parameters(), expected_model.parameters()):
        assert_equal(got, want, bitwise=True)


def test_no_probe_while_a_kernel_waits_for_its_verdict(fake_clock, monkeypatch):
    """A kernel on trial (Note [Side by side]) runs per-op beside its fused runs and pays
    one-time costs in its first: windows timed then would not compare the runtime as it will
    run. Here verdicts never come (the trial's judging is switched off): the judge never
    probes, though its paused steps would be faster."""
    from adaptive_eager.runtime import profit
    monkeypatch.setattr(profit.ProfitTrial, "judge", lambda self, variant: None)
    expected = _train(_model(), 160)
    model = _model()
    with config.patch(PAUSE=True, KEEP_UNPROFITABLE=False), ae.enabled():
        losses = _train(model, 160, lambda paused: 0.08 if paused else 0.1, fake_clock)
        [runtime] = engine.live_runtimes()
        assert ae.stats().fused_executions > 0 and engine.shared_table().kernels_on_trial
        assert runtime.judge.verdicts == 0 and runtime.judge.last_times == (0.0, 0.0)
    for got, want in zip(losses, expected):
        assert_equal(got, want, bitwise=True)


@pytest.mark.parametrize("plain_s, verdict", [(0.8, Action.PAUSE_PLAIN),
                                              (0.89, Action.PAUSE_PLAIN),  # (a tie: plain)
                                              (0.95, Action.PAUSE)])
def test_a_pause_of_pausings_that_keeps_kernels_is_timed_without_them(plain_s, verdict):
    """A paused probe: windows kept with the kernels and plain ones, in turn; the verdict
    keeps the kernels where they are faster than plain by the margin, and leaves the pause's
    length (and the judge's own pauses) as they were."""
    judge = Judge.starting_at(0.0)
    now = FIRST_PROBE_S
    assert judge.at_point(now, True, 0, paused=True) is Action.NONE and judge.probing
    actions, seconds_of = [], {State.KERNELS: 0.9, State.PLAIN: plain_s}
    while judge.probing:
        now += seconds_of[judge.window] / WINDOW
        action = judge.at_point(now, True, 0)
        if action is not Action.NONE:
            actions.append(action)
    assert actions == [Action.PLAIN_WINDOW, Action.KERNELS_WINDOW, Action.PLAIN_WINDOW,
                       verdict]
    assert judge.last_totals == pytest.approx({State.KERNELS: 1.8, State.PLAIN: 2 * plain_s})
    assert judge.verdicts == 0 and judge.paused_for() == PAUSE_FIRST_S
    assert judge.at_point(now + KEEP_FIRST_S - 0.01, True, 0, paused=True) is Action.NONE
    assert not judge.probing                                    # the next probe waits


def test_an_abandoned_paused_probe_leaves_the_pause_as_it_is():
    judge = Judge.starting_at(0.0)
    now = FIRST_PROBE_S
    judge.at_point(now, True, 0, paused=True)
    for _ in range(WINDOW):                                     # into its plain window
        now += 0.01
        judge.at_point(now, True, 0)
    assert judge.window is State.PLAIN
    assert judge.at_point(now + 0.01, True, answers=1) is Action.NONE     # not RESUME
    assert not judge.probing


def test_windows_of_short_steps_last_the_shortest_window_in_whole_multiples_of_points():
    """Points 1 ms apart: each window runs until SHORTEST_WINDOW_S, in multiples of WINDOW
    points, and states compare per point (kernels 0.9 ms a point win over 1 ms)."""
    judge = Judge.starting_at(0.0)
    now, point_s = FIRST_PROBE_S, {State.INTERCEPTING: 1e-3, State.KERNELS: 0.9e-3}
    judge.at_point(now, True, 0)
    points, actions = [0], []
    while judge.probing:
        points[-1] += 1
        now += point_s[judge.window]
        action = judge.at_point(now, True, 0)
        if action is not Action.NONE:
            actions.append(action)
            points.append(0)
    whole = math.ceil(step_judge.SHORTEST_WINDOW_S / 1e-3 / WINDOW) * WINDOW
    assert points[:-1] == [whole, math.ceil(step_judge.SHORTEST_WINDOW_S / 0.9e-3 / WINDOW)
                           * WINDOW] * 2
    assert actions[-1] is Action.PAUSE
    assert judge.last_times == pytest.approx((2 * WINDOW * 1e-3, 2 * WINDOW * 0.9e-3))
