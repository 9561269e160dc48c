"""The per-thread state machine (adaptive_eager/thread_state.py): its moves, and the phases
the public API puts an enable() in."""
import pytest
import torch

import adaptive_eager as ae
from adaptive_eager import thread_state
from adaptive_eager.thread_state import Enabled, InvalidTransition, Phase
from helpers import chain


@pytest.mark.parametrize("start, end", [
    (Phase.INTERCEPTING, Phase.PAUSED), (Phase.PAUSED, Phase.INTERCEPTING),
    (Phase.INTERCEPTING, Phase.ASIDE), (Phase.ASIDE, Phase.INTERCEPTING),
    (Phase.INTERCEPTING, Phase.SITTING_OUT), (Phase.SITTING_OUT, Phase.INTERCEPTING),
    (Phase.PAUSED, Phase.STOOD_ASIDE), (Phase.STOOD_ASIDE, Phase.STOOD_ASIDE),
    (Phase.PAUSED, Phase.ASIDE), (Phase.ASIDE, Phase.PAUSED),   # ae.paused() while paused
])
def test_the_listed_moves_are_made(start, end):
    enabled = Enabled(runtime=None, interceptor=None, phase=start)
    enabled.move(end)
    assert enabled.phase is end


def test_only_a_new_pause_counts_as_one_begun():
    """A key's rate is not sampled across a pause (control.pauses_begun); back from an
    ae.paused() block inside a pause, the same pause goes on."""
    from adaptive_eager.dispatch import control
    enabled = Enabled(runtime=None, interceptor=None, phase=Phase.INTERCEPTING)
    before = control.pauses_begun()
    enabled.move(Phase.PAUSED)
    assert control.pauses_begun() == before + 1
    enabled.move(Phase.ASIDE)
    enabled.move(Phase.PAUSED)
    assert control.pauses_begun() == before + 1


@pytest.mark.parametrize("start, end", [
    (Phase.PAUSED, Phase.SITTING_OUT), (Phase.ASIDE, Phase.SITTING_OUT),
    (Phase.SITTING_OUT, Phase.PAUSED), (Phase.STOOD_ASIDE, Phase.INTERCEPTING),
])
def test_any_other_move_is_a_bug_that_says_so(start, end):
    enabled = Enabled(runtime=None, interceptor=None, phase=start)
    with pytest.raises(InvalidTransition, match=f"{start.value} to {end.value}"):
        enabled.move(end)
    assert enabled.phase is start


def test_enable_paused_and_disable_move_the_phase():
    x = torch.randn(16)
    assert thread_state.top() is None
    with ae.enabled():
        enabled = thread_state.top()
        assert enabled.phase is Phase.INTERCEPTING
        with ae.paused():
            assert enabled.phase is Phase.ASIDE and not enabled.interceptor.is_active()
            with ae.paused():                      # nested: nothing more to step aside from
                assert enabled.phase is Phase.ASIDE
            chain(x)
        assert enabled.phase is Phase.INTERCEPTING and enabled.interceptor.is_active()
        chain(x)
    assert thread_state.top() is None


def test_paused_when_the_flush_itself_pauses_the_runtime(monkeypatch):
    """ae.paused() flushes first; ending a cold run harvests its counts, and a harvest that
    finds a pause requested pauses the runtime there. The block then runs paused (eager), and
    the runtime comes back from its own pause, not from ae.paused()'s."""
    x = torch.randn(16)
    with ae.enabled():
        enabled = thread_state.top()
        runtime = enabled.runtime
        flush = runtime.flush

        def flush_that_pauses(*args, **kwargs):
            flush(*args, **kwargs)
            if enabled.phase is Phase.INTERCEPTING and not runtime.pause_requested:
                runtime.pause_requested = True
                thread_state.control_point()        # (which flushes again)

        monkeypatch.setattr(runtime, "flush", flush_that_pauses)
        with ae.paused():
            assert enabled.phase is Phase.PAUSED and ae.is_paused()
            torch.testing.assert_close(chain(x), chain(x))
        monkeypatch.undo()
        assert enabled.phase is Phase.PAUSED       # its own pause: ended at a control point
    assert thread_state.top() is None
