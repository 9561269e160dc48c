"""The waker: one daemon thread that wakes paused threads of the C++ backend whose key is out of
their dispatch set (Note [Waking a paused thread] in csrc/intercept.cpp).

A thread asks ``wake_later(callback, delay_s)`` for itself; when that time comes the waker arms
the extension's one-shot profile function on it, and ``callback`` runs on that thread at its
next Python call event. Until the thread cancels (``cancel``) or asks again, the waker re-arms
every ``delay_s``: a thread busy in one long op, or whose own profiler stood in the way, is
tried again. A thread that ended is forgotten.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from adaptive_eager.fork_safety import at_fork, reinit_in_child

ARMED, NO_SUCH_THREAD, PROFILED = 1, 0, -1      # csrc/intercept.cpp, wake_soon's answers


class Waker:
    def __init__(self, ext) -> None:
        self._ext = ext
        self._changed = threading.Condition()
        self._due: dict[int, tuple[float, float, Callable[[], None]]] = {}  # id -> when, every
        self._thread: threading.Thread | None = None

    def wake_later(self, callback: Callable[[], None], delay_s: float) -> None:
        """Run ``callback`` on this thread in ``delay_s`` seconds (at its next Python call
        event after that), and again every ``delay_s`` until it asks again or cancels."""
        with self._changed:
            self._due[threading.get_ident()] = (time.monotonic() + delay_s, delay_s, callback)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="adaptive_eager-waker",
                                                daemon=True)
                self._thread.start()
            self._changed.notify()

    def cancel(self) -> None:
        """No wake for this thread (an armed one is disarmed)."""
        with self._changed:
            self._due.pop(threading.get_ident(), None)
        self._ext.wake_cancel()

    def _run(self) -> None:
        while True:
            with self._changed:
                thread_id, when = self._next()
                wait_s = when - time.monotonic()
                if wait_s > 0:
                    self._changed.wait(wait_s)
                    continue
                _, every, callback = self._due[thread_id]
                self._due[thread_id] = (time.monotonic() + every, every, callback)
            try:
                answer = self._ext.wake_soon(thread_id, callback)
            except Exception:  # noqa: BLE001 - the waker must outlive any one thread's wake
                answer = PROFILED                   # (tried again in ``every``)
            if answer == NO_SUCH_THREAD:
                with self._changed:
                    self._due.pop(thread_id, None)

    def _next(self) -> tuple[int, float]:
        """The thread due first and when (waiting, under the lock, while none is)."""
        while not self._due:
            self._changed.wait()
        thread_id = min(self._due, key=lambda ident: self._due[ident][0])
        return thread_id, self._due[thread_id][0]

    def _forget_in_child(self) -> None:
        """Note [Fork] (runtime/engine.py): no waker thread runs in a forked child."""
        self._changed = threading.Condition()
        self._due.clear()
        self._thread = None


_waker: Waker | None = None
_lock = threading.Lock()
reinit_in_child(_lock)


def waker(ext) -> Waker:
    """The process's waker (the extension ``ext`` arms the wakes)."""
    global _waker
    with _lock:
        if _waker is None:
            _waker = Waker(ext)
            at_fork(after_in_child=_waker._forget_in_child)
        return _waker
