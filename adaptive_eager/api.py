"""The public API: enable / disable / enabled / sync / stats."""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import threading
import weakref
from typing import Iterator

from adaptive_eager.config import config
from adaptive_eager.dispatch import control, escapes
from adaptive_eager.dispatch import interceptor as interceptors
from adaptive_eager.fork_safety import at_fork
from adaptive_eager.runtime import clock, engine, native_plans, scalars
from adaptive_eager.runtime.allocator import keep_freed_memory
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime.gc_freeze import freeze_gc, unfreeze_gc
from adaptive_eager.runtime.stats import Stats, counters

_local = threading.local()


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _configure_logging() -> None:
    """Apply NEURON_ADAPTIVE_EAGER_LOG. Warnings reach stderr through logging's last-resort
    handler; for info/debug a handler is added, unless the program configured logging."""
    logger = logging.getLogger("adaptive_eager")
    level = config.LOG
    if level is None:
        return
    logger.setLevel(logging.CRITICAL + 1 if level == "off" else level.upper())
    if level in ("info", "debug") and not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[adaptive_eager] %(levelname)s %(message)s"))
        logger.addHandler(handler)


_report_registered = False


def _register_exit_report() -> None:
    """NEURON_ADAPTIVE_EAGER_REPORT: write the report when the process exits (once)."""
    global _report_registered
    if config.REPORT and not _report_registered:
        _report_registered = True
        atexit.register(_exit_report, config.REPORT)


def _exit_report(target: str) -> None:
    from adaptive_eager.runtime.report import write_report
    try:
        write_report(target)
    except Exception as err:  # a report must never turn a clean exit into a crash
        logging.getLogger("adaptive_eager").warning("exit report not written: %s", err)


def enable() -> None:
    """Run this thread's aten ops under the adaptive runtime until ``disable()``."""
    config.validate_all()
    if config.MALLOC_TUNING:
        keep_freed_memory()            # Note [Allocator thresholds]
    _configure_logging()
    _register_exit_report()
    freeze_gc("enable")
    control.install()
    runtime = engine.Runtime()
    interceptor = interceptors.create(runtime)
    _note_backend(interceptor)
    escapes.install()
    _stack().append((runtime, interceptor))
    if not _recall_pause(runtime):
        interceptor.activate()
    else:
        interceptor.deactivate(unseen=_local.pause_memory.unseen)


def disable() -> None:
    """Finish deferred work and stop intercepting (the innermost ``enable()`` of this thread)."""
    stack = _stack()
    if not stack:
        return
    runtime, interceptor = stack.pop()
    if not runtime.stood_aside:        # a forked child's pause is not for its own enables
        _remember_pause(runtime, interceptor)
    try:
        runtime.close()
    finally:
        interceptor.close()            # (a paused mode is off the stack already)
        _paused_until.pop(runtime, None)
        escapes.uninstall()
        if not engine.live_runtimes():
            unfreeze_gc()              # objects frozen since enable() become collectable
            engine.release_idle_resources()


def is_enabled() -> bool:
    return bool(_stack())


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """``with ae.enabled(): ...`` — the runtime for the block, on this thread."""
    enable()
    try:
        yield
    finally:
        disable()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """``with ae.paused(): ...`` — plain eager for the block, on this thread. Deferred work is
    finished first; kernels and what is known of keys stay (``disable()`` gives kernels
    back). For timing eager beside adaptive in one process, or a region known to be dynamic."""
    aside = _step_aside()
    if aside is None:
        yield                                  # not enabled, paused already, or not on top
        return
    try:
        yield
    finally:
        aside[1].activate()


def _step_aside() -> tuple | None:
    """Finish this thread's deferred work and stop intercepting: its (runtime, interceptor),
    or None when not enabled, paused, or another mode is on top."""
    stack = _stack()
    if not stack or not stack[-1][1].is_active():
        return None
    runtime, interceptor = stack[-1]
    runtime.flush()
    interceptor.deactivate()
    return runtime, interceptor


# runtime -> monotonic time its pause ends (see dispatch/control.py)
_paused_until: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class _PauseMemory:
    quiet_segments: int
    quiet_count: int
    backoff_s: float
    paused_until: float
    awaited_answers: int | None
    unseen: bool                   # its ops passed unseen (CppInterceptor.deactivate)


def _remember_pause(runtime, interceptor) -> None:
    """A thread's pausing state outlives its runtime, so ``with ae.enabled():`` around each
    step pauses (and stays paused) as one long enable would."""
    _local.pause_memory = _PauseMemory(runtime.quiet_segments, runtime.quiet_count,
                                       runtime.pause_backoff_s, _paused_until.get(runtime, 0.0),
                                       runtime.awaited_answers, interceptor.unseen)


def _recall_pause(runtime) -> bool:
    """Give a new runtime its thread's pausing state; True if it starts paused."""
    memory = getattr(_local, "pause_memory", None)
    if memory is None or not config.PAUSE:
        return False
    runtime.quiet_segments, runtime.quiet_count = memory.quiet_segments, memory.quiet_count
    runtime.pause_backoff_s = memory.backoff_s
    runtime.awaited_answers = memory.awaited_answers
    if memory.paused_until > clock.monotonic() and not runtime.awaited_kernel_landed():
        _paused_until[runtime] = memory.paused_until
        return True
    return False


_last_backend = ""     # the backend of the latest enable() or switch, any thread


def _note_backend(interceptor) -> None:
    global _last_backend
    _last_backend = interceptor.backend


def backend() -> str:
    """Which interception runs this thread's runtime ("cpp" or "python"); else the latest
    one any thread ran ("" if none)."""
    stack = _stack()
    return stack[-1][1].backend if stack else _last_backend


def pauses_between_ops() -> bool:
    """Can this thread's runtime pause at its next op (no control point needed)?"""
    stack = _stack()
    return bool(stack) and stack[-1][1].pauses_between_ops


def _switch_backend() -> None:
    """Note [Switching backends] (dispatch/interceptor.py): at a control point of a thread
    with one enable(), not sitting out a first optimizer step, swap its Python mode for the
    C++ interceptor, in the same state (intercepting, or paused)."""
    stack = _stack()
    if len(stack) != 1 or getattr(_local, "sitting_out", None) is not None:
        return
    runtime, old = stack[0]
    paused = runtime in _paused_until
    if not (paused or old.is_active()) or not interceptors.switch_ready(old):
        return
    runtime.flush()
    old.close()
    new = interceptors.create(runtime)
    stack[0] = (runtime, new)
    _note_backend(new)
    if not paused:
        new.activate()
    decide("backend_switched", backend=new.backend)


def sit_out(optimizer, step_frame) -> None:
    """Note [First optimizer step] (dispatch/control.py): run ``optimizer``'s first step
    plainly, on this thread; ``stop_sitting_out(optimizer)`` puts the mode back. ``step_frame``
    runs the step: while it is on the stack, control points leave the mode off."""
    if getattr(_local, "sitting_out", None) is not None:
        return                         # an outer optimizer's step sits out already
    aside = _step_aside()
    if aside is None:
        return                         # nothing to take off
    _local.sitting_out = (*aside, id(optimizer), step_frame)
    decide("first_step_plain", optimizer=type(optimizer).__name__)


def stop_sitting_out(optimizer=None) -> None:
    """End ``sit_out(optimizer)``; with None (a control point), only if its step is over
    (it raised, so no post-hook ended it)."""
    sitting_out = getattr(_local, "sitting_out", None)
    if sitting_out is None:
        return
    runtime, interceptor, optimizer_id, step_frame = sitting_out
    if optimizer is not None and optimizer_id != id(optimizer):
        return                         # an inner optimizer's step ended, not this one's
    if optimizer is None and control.is_running(step_frame):
        return                         # a control point inside the step
    _local.sitting_out = None
    stack = _stack()
    if stack and stack[-1][0] is runtime and runtime not in _paused_until:
        interceptor.activate()


def control_point() -> None:
    """Pause or resume this thread's runtime, if it asked to / its pause is over."""
    stop_sitting_out()                 # a first optimizer step that raised: back from here
    stack = _stack()
    if not stack:
        return
    end_segment()                      # Note [Natural boundaries] (dispatch/control.py)
    runtime, interceptor = stack[-1]
    if runtime.pause_requested and interceptor.between_ops():
        seconds = runtime.paused_for()
        interceptor.deactivate(unseen=runtime.control_points_pass())
        _paused_until[runtime] = clock.monotonic() + seconds
        decide("paused", seconds=seconds)
    elif runtime in _paused_until:
        landed = _banked_a_kernel(runtime)
        if landed or clock.monotonic() >= _paused_until[runtime]:
            del _paused_until[runtime]
            runtime.resumed(kernel_landed=landed)
            interceptor.activate()
            decide("resumed")
    if isinstance(interceptor, interceptors.PythonInterceptor) and interceptors.switch_ready(
            interceptor):
        _switch_backend()
        if stack[-1][1] is interceptor:            # not now (sitting out): at a later op
            interceptor.mode.switch_pending = True
    if not any(r.pause_requested for r in engine.live_runtimes()):
        control.no_pause_pending()


def _banked_a_kernel(runtime) -> bool:
    """While paused: bank the waiting keys' savings (Note [When to compile]), which may
    start a compile; has a kernel landed since the pause began? (A forked child's runtimes
    stand aside: they touch no table, Note [Fork].)"""
    if runtime.stood_aside:
        return False
    runtime.table.bank_while_paused()
    return runtime.awaited_kernel_landed()


def end_segment() -> None:
    """Note [Natural boundaries] (dispatch/control.py): end this thread's segment here."""
    stack = _stack()
    if stack:
        stack[-1][0].flush()


def pause_point_reached() -> bool:
    """Is this thread between two ops with its runtime wanting to pause (or no longer
    wanting to)? The check of the one-shot pause hook in dispatch/control.py."""
    stack = _stack()
    if not stack:
        return True
    runtime, interceptor = stack[-1]
    wanted = runtime.pause_requested or interceptors.switch_ready(interceptor)
    return not wanted or interceptor.between_ops()


def is_paused() -> bool:
    """Is this thread's runtime pausing (not intercepting) right now?"""
    stack = _stack()
    return bool(stack) and stack[-1][0] in _paused_until


def sync(wait_compiles: float = 0.0) -> None:
    """Finish all deferred work now, on every runtime in the process. With
    ``wait_compiles=seconds``, also wait (that long at most) for background compiles and swap
    their kernels in (benchmarks, tests)."""
    for runtime in engine.live_runtimes():
        runtime.flush()
    table = engine.existing_table()
    if table is not None:
        native_plans.touch_pending(table)      # runs C++ made that the table has not counted
    if wait_compiles:
        engine.shared_table().poll_compiles(wait_s=wait_compiles)
    control.permanent_point()       # after the wait: a pause for those kernels ends here


def stats() -> Stats:
    """A frozen snapshot of the runtime's counters, and the backend intercepting."""
    _publish_all_counts()
    table = engine.existing_table()
    gauges = {} if table is None else dict(compiles_in_flight=table.compiles_in_flight,
                                            compiles_waiting=table.compiles_waiting)
    return counters.snapshot(backend=backend(), **gauges)


def _publish_all_counts() -> None:
    """Runtimes count ops locally (no lock per op); gather them into the shared counters."""
    for runtime in engine.live_runtimes():
        runtime.publish_counts()
    native_plans.publish_counts()


def _after_fork_in_child() -> None:
    """Note [Fork] (runtime/engine.py): this thread's runtimes stand aside and stay paused
    (their modes leave the stack where they can; elsewhere they pass ops straight through),
    and a later enable() here starts afresh, without the parent's pausing state."""
    engine.after_fork_in_child()
    for runtime, interceptor in reversed(_stack()):
        if interceptor.is_active():
            interceptor.deactivate()
        _paused_until[runtime] = math.inf
    _local.pause_memory = None


at_fork(before=escapes.flush_deferred, after_in_child=_after_fork_in_child)


def reset() -> None:
    """Forget every key, kernel and counter (tests, benchmarks)."""
    sync()
    _publish_all_counts()
    _local.pause_memory = None
    global _last_backend
    _last_backend = ""
    engine.reset_shared_table()
    scalars.reset()
    counters.reset()
