"""Each thread's runtime state, in one place: one explicit state machine per ``enable()``.

A thread's ``enable()`` calls nest; the innermost one is in charge. Each is in one Phase, and
its interceptor intercepts in INTERCEPTING only:

    INTERCEPTING  ops go to its runtime (which records segments and defers along compiled
                  ones: runtime/engine.py)
    ASIDE         ``ae.paused()``: plain eager for the block
    SITTING_OUT   an optimizer's first step runs plainly (Note [First optimizer step] in
                  dispatch/control.py)
    PAUSED        nothing worth fusing (Note [Pausing] in runtime/pausing.py): plain eager
                  until a control point finds the pause over or a kernel landed
    STOOD_ASIDE   a forked child's copy of a runtime (Note [Fork] in runtime/engine.py): plain
                  for good

The moves, and nothing else (any other is a bug: InvalidTransition):

    INTERCEPTING -> PAUSED       at a control point between two ops, the runtime asking
    PAUSED -> INTERCEPTING       at a control point: the pause is over, or a kernel landed
    INTERCEPTING <-> ASIDE       ``ae.paused()`` begins / ends
    INTERCEPTING <-> SITTING_OUT an optimizer's first step begins / ends
    any -> STOOD_ASIDE           in a forked child

A pause never begins outside INTERCEPTING (between_ops() is false there); a pause's state
outlives its ``enable()`` (PauseMemory), so ``with ae.enabled():`` around each step pauses as
one long enable would.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import threading

from adaptive_eager.config import config
from adaptive_eager.dispatch import control, upcalls
from adaptive_eager.dispatch import interceptor as interceptors
from adaptive_eager.runtime import clock, engine
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime.step_judge import Action, State
from adaptive_eager.runtime.stats import counters


class Phase(enum.Enum):
    INTERCEPTING = "intercepting"
    ASIDE = "aside"
    SITTING_OUT = "sitting_out"
    PAUSED = "paused"
    STOOD_ASIDE = "stood_aside"


_MOVES = {(Phase.INTERCEPTING, Phase.PAUSED), (Phase.PAUSED, Phase.INTERCEPTING),
          (Phase.INTERCEPTING, Phase.ASIDE), (Phase.ASIDE, Phase.INTERCEPTING),
          (Phase.PAUSED, Phase.ASIDE), (Phase.ASIDE, Phase.PAUSED),
          (Phase.INTERCEPTING, Phase.SITTING_OUT), (Phase.SITTING_OUT, Phase.INTERCEPTING),
          *((phase, Phase.STOOD_ASIDE) for phase in Phase)}


class InvalidTransition(RuntimeError):
    """A move the state machine does not have: a bug in adaptive_eager."""


@dataclasses.dataclass(eq=False)
class Enabled:
    """One ``enable()`` of a thread: its runtime, its interceptor, and where it stands."""
    runtime: "engine.Runtime"
    interceptor: object
    phase: Phase = Phase.INTERCEPTING
    paused_until: float = 0.0            # PAUSED: clock.monotonic() when the pause ends
    aside_from: Phase = Phase.INTERCEPTING   # ASIDE: the phase ae.paused() goes back to

    def move(self, phase: Phase) -> None:
        if (self.phase, phase) not in _MOVES:
            raise InvalidTransition(f"adaptive_eager: no move from {self.phase.value} to "
                                    f"{phase.value} (please report this bug)")
        if phase is Phase.PAUSED and self.phase is not Phase.ASIDE:
            control.pause_begun()          # (back from ae.paused(): the same pause goes on)
        self.phase = phase


@dataclasses.dataclass(frozen=True)
class PauseMemory:
    """What a thread's last ``disable()`` knew of pausing, for its next ``enable()``."""
    quiet_segments: int
    quiet_count: int
    backoff_s: float
    paused_until: float
    awaited_answers: int | None
    unseen: bool                   # its ops passed unseen (CppInterceptor.deactivate)


@dataclasses.dataclass(frozen=True)
class SitOut:
    enabled: Enabled
    optimizer_id: int
    step_frame: object             # runs the step: control points inside it keep it plain


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[Enabled] = []
        self.memory: PauseMemory | None = None
        self.sitting_out: SitOut | None = None


_thread = _ThreadState()
_last_backend = ""     # the backend of the latest enable() or switch, any thread


def top() -> Enabled | None:
    """This thread's innermost enable(), or None."""
    stack = _thread.stack
    return stack[-1] if stack else None


def backend() -> str:
    """Which interception runs this thread's runtime ("cpp" or "python"); else the latest
    one any thread ran ("" if none)."""
    enabled = top()
    return enabled.interceptor.backend if enabled is not None else _last_backend


def _note_backend(interceptor) -> None:
    global _last_backend
    _last_backend = interceptor.backend


# ---------------------------------------------------------------- enable / disable

def push(runtime) -> Enabled:
    """A new enable() on this thread: intercepting, or paused if the thread's last one was
    and its pause is not over."""
    enabled = Enabled(runtime, interceptors.create(runtime))
    _note_backend(enabled.interceptor)
    _thread.stack.append(enabled)
    if _recall_pause(enabled):
        enabled.phase = Phase.PAUSED
        control.pause_begun()
        enabled.interceptor.deactivate(unseen=_thread.memory.unseen, kernels=True)
    else:
        enabled.interceptor.activate()
    return enabled


def pop() -> Enabled | None:
    """End this thread's innermost enable(); its pausing state is remembered (not a forked
    child's: that pause is not for the child's own enables)."""
    if not _thread.stack:
        return None
    enabled = _thread.stack.pop()
    if enabled.phase is not Phase.STOOD_ASIDE:
        runtime = enabled.runtime
        _thread.memory = PauseMemory(
            runtime.quiet_segments, runtime.quiet_count, runtime.pause_backoff_s,
            enabled.paused_until if enabled.phase is Phase.PAUSED else 0.0,
            runtime.awaited_answers,
            enabled.interceptor.unseen and not enabled.interceptor.asleep)
    return enabled


def _recall_pause(enabled: Enabled) -> bool:
    """Give a new runtime its thread's pausing state; True if it starts paused."""
    memory, runtime = _thread.memory, enabled.runtime
    if memory is None or not config.PAUSE:
        return False
    runtime.quiet_segments, runtime.quiet_count = memory.quiet_segments, memory.quiet_count
    runtime.pause_backoff_s = memory.backoff_s
    runtime.awaited_answers = memory.awaited_answers
    if memory.paused_until > clock.monotonic() and not runtime.awaited_kernel_landed():
        enabled.paused_until = memory.paused_until
        return True
    return False


def forget_pauses() -> None:
    """``reset()``: the next enable() starts with no pausing state."""
    global _last_backend
    _thread.memory = None
    _last_backend = ""


# ---------------------------------------------------------------- ae.paused()

def step_aside() -> Enabled | None:
    """Finish this thread's deferred work and stop intercepting (``ae.paused()``): the
    enable() moved ASIDE, or None when not enabled or another mode is on top. A pause stops
    its kernels for the block (Note [Kernels while paused] in csrc/hot_path.cpp), cannot end
    in it, and goes on after it."""
    enabled = top()
    if enabled is not None and enabled.phase is Phase.PAUSED:
        enabled.runtime.flush()
        enabled.interceptor.deactivate(unseen=True)
        enabled.move(Phase.ASIDE)
        enabled.aside_from = Phase.PAUSED
        return enabled
    enabled = _stop_intercepting(Phase.ASIDE)
    if enabled is not None:
        enabled.aside_from = Phase.INTERCEPTING
    return enabled


def _stop_intercepting(phase: Phase) -> Enabled | None:
    """Move the intercepting top enable() to ``phase`` (ASIDE or SITTING_OUT), its deferred
    work finished first; None when there is none (or another mode is on top)."""
    enabled = top()
    if enabled is None or enabled.phase is not Phase.INTERCEPTING or \
            not enabled.interceptor.is_active():
        return None
    enabled.runtime.flush()
    if enabled.phase is not Phase.INTERCEPTING:
        return None          # the flush ended a cold run whose harvest paused the runtime
    # ae.paused() is plain eager: the key out of the thread's dispatch set (its ops through
    # the extension's fallback cost ~0.2-1 us each, a quarter of a 4 us op). A sit-out, one
    # optimizer step once, keeps it.
    enabled.interceptor.deactivate(unseen=phase is Phase.ASIDE)
    enabled.move(phase)
    return enabled


def step_back(enabled: Enabled) -> None:
    if enabled.phase is not Phase.ASIDE:       # (a fork in the block stood it aside)
        return
    enabled.move(enabled.aside_from)
    if enabled.phase is Phase.PAUSED:
        _deactivate_paused(enabled)
    else:
        enabled.interceptor.activate()


# ---------------------------------------------------------------- first optimizer steps

def sit_out(optimizer, step_frame) -> None:
    """Note [First optimizer step] (dispatch/control.py): run ``optimizer``'s first step
    plainly, on this thread; ``stop_sitting_out(optimizer)`` puts the mode back. ``step_frame``
    runs the step: while it is on the stack, control points leave the mode off."""
    if _thread.sitting_out is not None:
        return                         # an outer optimizer's step sits out already
    enabled = _stop_intercepting(Phase.SITTING_OUT)
    if enabled is None:
        return                         # nothing to take off
    _thread.sitting_out = SitOut(enabled, id(optimizer), step_frame)
    decide("first_step_plain", optimizer=type(optimizer).__name__)


def stop_sitting_out(optimizer=None) -> None:
    """End ``sit_out(optimizer)``; with None (a control point), only if its step is over
    (it raised, so no post-hook ended it)."""
    sitting_out = _thread.sitting_out
    if sitting_out is None:
        return
    if optimizer is not None and sitting_out.optimizer_id != id(optimizer):
        return                         # an inner optimizer's step ended, not this one's
    if optimizer is None and control.is_running(sitting_out.step_frame):
        return                         # a control point inside the step
    _thread.sitting_out = None
    enabled = sitting_out.enabled
    if enabled.phase is Phase.SITTING_OUT:      # (not disabled or stood aside meanwhile)
        enabled.move(Phase.INTERCEPTING)
        if top() is enabled:
            enabled.interceptor.activate()


# ---------------------------------------------------------------- control points

def control_point() -> None:
    """Pause or resume this thread's runtime, if it asked to / its pause is over."""
    stop_sitting_out()                 # a first optimizer step that raised: back from here
    enabled = top()
    if enabled is None:
        return
    end_segment()                      # Note [Natural boundaries] (dispatch/control.py)
    runtime, interceptor = enabled.runtime, enabled.interceptor
    if _judged_by_the_step(enabled):
        pass
    elif enabled.phase is Phase.INTERCEPTING and runtime.pause_requested and \
            interceptor.between_ops():
        seconds = runtime.paused_for()
        _pause(enabled, seconds)
        decide("paused", seconds=seconds)
    elif enabled.phase is Phase.PAUSED:
        landed = _banked_a_kernel(runtime)
        if landed or clock.monotonic() >= enabled.paused_until:
            if runtime.judge.probing and runtime.judge.paused_probe:
                runtime.judge.abandon(clock.monotonic())   # (a probe of this pause's)
            _resume(enabled, kernel_landed=landed)
        elif not runtime.judge.probing:         # (the judge is timing them)
            _drop_kernels_that_do_not_pay(enabled)
    if isinstance(interceptor, interceptors.PythonInterceptor) and interceptors.switch_ready(
            interceptor):
        _switch_backend()
        if top().interceptor is interceptor:        # not now (sitting out): at a later op
            interceptor.mode.switch_pending = True
    if control.pause_hooks_installed() and \
            not any(r.pause_requested for r in engine.live_runtimes()):
        control.no_pause_pending()


def _judged_by_the_step(enabled) -> bool:
    """Note [Judged by the step] (runtime/step_judge.py): time this control point for the
    runtime's judge, and pause or resume as it says. True if the phase changed here."""
    runtime, judge = enabled.runtime, enabled.runtime.judge
    intercepting = enabled.phase is Phase.INTERCEPTING
    # a pause of pausing's own that keeps kernels: the judge may time it without them too
    paused_with_kernels = enabled.phase is Phase.PAUSED and not judge.probing and \
        enabled.interceptor.kernels
    now = clock.monotonic()
    if not config.PAUSE or runtime.pause_requested or not (
            intercepting or paused_with_kernels or
            (enabled.phase is Phase.PAUSED and judge.paused_window)):
        if judge.probing and not judge.paused_window:
            judge.abandon(now)          # pausing's own pause (or a sit-out) came between
        return False
    table = runtime.table
    settled = not (table.compiles_in_flight or table.compiles_due or table.kernels_on_trial)
    # (whether a pause would keep kernels matters only where a probe may start)
    kernels = not judge.probing and enabled.interceptor.has_kernels()
    action = judge.at_point(now, settled, table.compiles_answered, kernels=kernels,
                            paused=paused_with_kernels)
    if action is Action.PAUSE_WINDOW:
        if not (intercepting and enabled.interceptor.between_ops()):
            judge.abandon(now)
            return False
        _pause(enabled, runtime.paused_by_judge(window=True))
    elif action is Action.PLAIN_WINDOW:
        _go_on_without_kernels(enabled)
    elif action is Action.KERNELS_WINDOW:
        _kernels_back(enabled)
    elif action in (Action.PAUSE, Action.PAUSE_PLAIN):
        if action is Action.PAUSE and not enabled.interceptor.kernels and \
                State.PLAIN in judge.last_totals:
            _kernels_back(enabled)              # the plain window came last
        elif action is Action.PAUSE_PLAIN:           # (a plain window came last: plain now)
            counters.add("pauses_without_kernels")   # timed slower with them than without
        if judge.paused_probe:                  # pausing's pause goes on, as long as it was
            decide("paused_kernels_judged", kernels=action is Action.PAUSE,
                   **{f"{state.value}_s": round(seconds, 4)
                      for state, seconds in judge.last_totals.items()})
            return True
        enabled.paused_until = now + runtime.paused_by_judge(window=False)
        decide("paused", seconds=enabled.paused_until - now, judged="step",
               kernels=action is Action.PAUSE, **{f"{state.value}_s": round(seconds, 4)
                                                  for state, seconds in
                                                  judge.last_totals.items()})
    elif action is Action.RESUME and enabled.phase is Phase.PAUSED:
        _resume(enabled, kernel_landed=False)
    else:
        return False
    return True


def _pause(enabled, seconds: float) -> None:
    """Stop intercepting for ``seconds`` (control_point flushed the runtime already)."""
    _deactivate_paused(enabled)
    enabled.move(Phase.PAUSED)
    enabled.paused_until = clock.monotonic() + seconds


def _deactivate_paused(enabled) -> None:
    """A runtime's own pause: its kernels run on, as long as they pay for it; the key out
    where a control point or the waker ends it (CppInterceptor.deactivate)."""
    runtime, interceptor = enabled.runtime, enabled.interceptor
    unseen = runtime.control_points_pass()
    if runtime.kernels_unpaid:            # (back from ae.paused() into this pause)
        interceptor.drop_kernels(unseen)
        return
    interceptor.deactivate(unseen=unseen, kernels=True)
    if interceptor.kernels:
        runtime.keeps_kernels_paused()


def _drop_kernels_that_do_not_pay(enabled) -> None:
    """Note [Kernels that do not pay while paused] (runtime/paused_kernels.py)."""
    interceptor, runtime = enabled.interceptor, enabled.runtime
    if interceptor.kernels and not runtime.kernels_pay_while_paused(
            interceptor.take_paused_ops()):
        _drop_kernels(enabled)


def _kernels_back(enabled) -> None:
    """The step judge's verdict or window: the pause goes on with its kernels again."""
    enabled.runtime.judge_keeps_kernels(True)
    _deactivate_paused(enabled)


def _go_on_without_kernels(enabled) -> None:
    """The step judge's plain window (Note [Judged by the step]): the pause goes on with the
    key out, no kernel run; a pause that kept none goes on as it was."""
    enabled.runtime.judge_keeps_kernels(False)
    if enabled.interceptor.kernels:
        _drop_kernels(enabled)


def _drop_kernels(enabled) -> None:
    interceptor, runtime = enabled.interceptor, enabled.runtime
    runtime.flush()                   # a run deferred along a kernel's path: ended first
    interceptor.drop_kernels(unseen=runtime.control_points_pass())


def _resume(enabled, kernel_landed: bool) -> None:
    enabled.move(Phase.INTERCEPTING)
    enabled.runtime.resumed(kernel_landed=kernel_landed)
    enabled.interceptor.activate()
    decide("resumed")


def _banked_a_kernel(runtime) -> bool:
    """While paused: bank the waiting keys' savings (Note [When to compile]), which may
    start a compile; has a kernel landed since the pause began?"""
    runtime.table.bank_while_paused()
    return runtime.awaited_kernel_landed()


def end_segment() -> None:
    """Note [Natural boundaries] (dispatch/control.py): end this thread's segment here."""
    enabled = top()
    if enabled is not None and enabled.phase is not Phase.PAUSED:   # (nothing open then)
        enabled.runtime.flush()


def pause_point_reached() -> bool:
    """Is this thread between two ops with its runtime wanting to pause (or no longer
    wanting to)? The check of the one-shot pause hook in dispatch/control.py."""
    enabled = top()
    if enabled is None:
        return True
    wanted = enabled.runtime.pause_requested or interceptors.switch_ready(enabled.interceptor)
    return not wanted or enabled.interceptor.between_ops()


def pauses_between_ops() -> bool:
    """Can this thread's runtime pause at its next op (no control point needed)?"""
    enabled = top()
    return enabled is not None and enabled.interceptor.pauses_between_ops


def is_paused() -> bool:
    """Is this thread's runtime pausing (not intercepting, for a while or for good)?"""
    enabled = top()
    return enabled is not None and enabled.phase in (Phase.PAUSED, Phase.STOOD_ASIDE)


def _switch_backend() -> None:
    """Note [Switching backends] (dispatch/interceptor.py): at a control point of a thread
    with one enable(), not sitting out a first optimizer step, swap its Python mode for the
    C++ interceptor, in the same phase (intercepting, or paused)."""
    if len(_thread.stack) != 1:
        return
    enabled = _thread.stack[0]
    old = enabled.interceptor
    paused = enabled.phase is Phase.PAUSED
    if not (paused or (enabled.phase is Phase.INTERCEPTING and old.is_active())) or \
            not interceptors.switch_ready(old):
        return
    enabled.runtime.flush()
    old.close()
    enabled.interceptor = new = interceptors.create(enabled.runtime)
    _note_backend(new)
    if not paused:
        new.activate()
    decide("backend_switched", backend=new.backend)


# ---------------------------------------------------------------- fork

def after_fork_in_child() -> None:
    """Note [Fork] (runtime/engine.py): this thread's runtimes stand aside (their modes
    leave the stack where they can; elsewhere they pass ops straight through), and a later
    enable() here starts afresh, without the parent's pausing state."""
    for enabled in reversed(_thread.stack):
        if enabled.interceptor.is_active():
            enabled.interceptor.deactivate()
        enabled.move(Phase.STOOD_ASIDE)
        enabled.paused_until = math.inf
    _thread.memory = None
    _thread.sitting_out = None


upcalls.control_point, upcalls.end_segment = control_point, end_segment
upcalls.sit_out, upcalls.stop_sitting_out = sit_out, stop_sitting_out
upcalls.pauses_between_ops, upcalls.pause_point_reached = pauses_between_ops, pause_point_reached
