"""The public API: enable / disable / enabled / sync / stats."""
from __future__ import annotations

import atexit
import contextlib
import logging
from typing import Iterator

from adaptive_eager import thread_state
from adaptive_eager.config import config
from adaptive_eager.dispatch import control, escapes
from adaptive_eager.fork_safety import at_fork
from adaptive_eager.runtime import engine, native_plans, scalars
from adaptive_eager.runtime.allocator import keep_freed_memory
from adaptive_eager.runtime.gc_freeze import freeze_gc, unfreeze_gc
from adaptive_eager.runtime.stats import Stats, counters


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
    escapes.install()
    thread_state.push(engine.Runtime())


def disable() -> None:
    """Finish deferred work and stop intercepting (the innermost ``enable()`` of this thread)."""
    enabled = thread_state.pop()
    if enabled is None:
        return
    try:
        enabled.runtime.close()
    finally:
        enabled.interceptor.close()    # (a paused mode is off the stack already)
        escapes.uninstall()
        if not engine.live_runtimes():
            unfreeze_gc()              # objects frozen since enable() become collectable
            engine.release_idle_resources()


def is_enabled() -> bool:
    return thread_state.top() is not None


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
    aside = thread_state.step_aside()
    if aside is None:
        yield                                  # not enabled, paused already, or not on top
        return
    try:
        yield
    finally:
        thread_state.step_back(aside)


def backend() -> str:
    """Which interception runs this thread's runtime ("cpp" or "python"); else the latest
    one any thread ran ("" if none)."""
    return thread_state.backend()


def is_paused() -> bool:
    """Is this thread's runtime pausing (not intercepting) right now?"""
    return thread_state.is_paused()


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
    gauges["steps_on_trial"] = sum(runtime.judge.probing for runtime in engine.live_runtimes())
    return counters.snapshot(backend=backend(), **gauges)


def _publish_all_counts() -> None:
    """Runtimes count ops locally (no lock per op); gather them into the shared counters."""
    for runtime in engine.live_runtimes():
        runtime.publish_counts()
    native_plans.publish_counts()


def _after_fork_in_child() -> None:
    """Note [Fork] (runtime/engine.py)."""
    engine.after_fork_in_child()
    thread_state.after_fork_in_child()


at_fork(before=escapes.flush_deferred, after_in_child=_after_fork_in_child)


def reset() -> None:
    """Forget every key, kernel and counter (tests, benchmarks)."""
    sync()
    _publish_all_counts()
    thread_state.forget_pauses()
    engine.reset_shared_table()
    scalars.reset()
    counters.reset()
