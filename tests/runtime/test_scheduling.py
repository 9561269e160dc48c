"""When a hot key compiles (Note [When to compile] in runtime/scheduling.py)."""
from types import SimpleNamespace

import pytest

from adaptive_eager.config import config
from adaptive_eager.runtime import scheduling


def _waiting_key(ops: int, banked_s: float) -> SimpleNamespace:
    return SimpleNamespace(segment=SimpleNamespace(ops=[None] * ops), banked_s=banked_s)


@pytest.mark.parametrize("ops", [2, 8, 23, 64])
def test_a_compile_costs_the_same_whatever_the_segments_length(ops):
    """Compiles take 0.2-4 s on a lent core whether a segment has 8 ops or 64: a key is due
    once it banked COMPILE_COST_MS, however long."""
    with config.patch(COMPILE_COST_MS=2000):
        assert not scheduling.is_due(_waiting_key(ops, banked_s=1.99))
        assert scheduling.is_due(_waiting_key(ops, banked_s=2.0))


def test_watching_a_key_costs_less_on_the_cpp_backend(monkeypatch):
    """A key saving 20 us an op is worth watching on the C++ backend (~10 us an op), not
    through Python's dispatch mode (~50 us an op)."""
    monkeypatch.setattr(scheduling, "predicted_saving_s",
                        lambda entry: len(entry.segment.ops) * 20e-6)
    key = _waiting_key(23, banked_s=0.0)
    assert scheduling.worth_watching(key, "cpp")
    assert not scheduling.worth_watching(key, "python")


def test_a_keys_rate_is_measured_while_watched_not_across_pauses(fake_clock):
    """Note [When to compile]: while paused, a waiting key banks at the rate it ran while
    watched. Seen 10 times a second for 2 s, then paused for 60 s, then seen 10 times a
    second again: its rate is 10 runs a second, not the ~1 a second of its whole history."""
    from adaptive_eager.dispatch import control
    from adaptive_eager.runtime.entries import KeyEntry
    control.permanent_point()
    entry = KeyEntry(segment=None)

    def watched(runs):
        for _ in range(runs):
            fake_clock.advance(0.1)
            entry.sighted(1)
            control.permanent_point()
    watched(20)
    assert scheduling.runs_per_second(entry) == pytest.approx(10, rel=0.01)
    control.pause_begun()
    fake_clock.advance(60.0)
    watched(5)
    assert scheduling.runs_per_second(entry) == pytest.approx(10, rel=0.01)


def test_a_keys_rate_adds_up_over_short_watched_stretches(fake_clock):
    """A runtime that resumes for a step or two between pauses (POINTS_BEFORE_PAUSE) sees a
    per-step key twice a stretch: seen 10 times a second, two runs a stretch, 10 s paused
    between stretches, its rate is still 10 a second (over its whole history: ~0.2)."""
    from adaptive_eager.dispatch import control
    from adaptive_eager.runtime.entries import KeyEntry
    control.permanent_point()
    entry = KeyEntry(segment=None)
    for _ in range(4):
        for _ in range(2):
            fake_clock.advance(0.1)
            entry.sighted(1)
            control.permanent_point()
        control.pause_begun()
        fake_clock.advance(10.0)
    assert scheduling.runs_per_second(entry) == pytest.approx(10, rel=0.01)


def test_a_bare_loops_key_that_comes_back_after_a_pause_has_its_watched_rate(fake_clock):
    """A loop that passes no control point crosses no step: a key seen again after a pause
    began recurs all the same, and banks while paused at its watched rate. Stretches of one
    run a pause apart, then a stretch of two runs 0.1 s apart: 10 a second (over its whole
    history, mostly paused: ~0.7)."""
    from adaptive_eager.dispatch import control
    from adaptive_eager.runtime.entries import KeyEntry
    entry = KeyEntry(segment=None)
    entry.sighted(1)
    assert scheduling.runs_per_second(entry) == 0.0
    for _ in range(3):
        control.pause_begun()
        fake_clock.advance(2.0)
        entry.sighted(1)
    assert entry.last_point == entry.first_point            # no control point passed
    fake_clock.advance(0.1)
    entry.sighted(1)
    assert scheduling.runs_per_second(entry) == pytest.approx(10, rel=0.01)


def test_a_key_seen_only_within_one_stretch_of_a_bare_loop_banks_nothing(fake_clock):
    """Keys made of one step's scalars come in a burst and never again: with no control
    point and no pause in between, nothing says they recur."""
    from adaptive_eager.runtime.entries import KeyEntry
    entry = KeyEntry(segment=None)
    for _ in range(6):
        fake_clock.advance(0.01)
        entry.sighted(1)
    assert scheduling.runs_per_second(entry) == 0.0
