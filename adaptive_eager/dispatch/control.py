"""Control points: places outside the dispatch mode where the runtime may pause or resume.

A TorchDispatchMode cannot take itself off the mode stack from inside ``__torch_dispatch__``
(PyTorch puts it back when the handler returns). So pausing (Note [Pausing] in
runtime/engine.py) happens here, in the user's thread, between ops: at an optimizer step, a
``backward()`` call, a DataLoader batch, ``ae.sync()``, and, only while a pause is pending, at
the next nn.Module call (a global forward pre-hook, removed once the pause took effect, since
hooks on every module call cost a few microseconds each), and, in a bare loop of tensor ops
that passes none of these, at the next Python call event (Note [Pausing a bare loop]).
"""
from __future__ import annotations

import functools
import sys
import threading

from adaptive_eager.fork_safety import reinit_in_child

_lock = threading.Lock()
reinit_in_child(_lock)   # Note [Fork] (runtime/engine.py)
_installed = False
_module_hook = None
_points_passed = 0       # permanent control points passed, any thread (a hint, not a count)


def points_passed() -> int:
    """How many permanent control points the program has passed: a runtime that saw this
    move knows its program comes back to one (and so can wait paused for a kernel)."""
    return _points_passed


def _control_point(*_args, **_kwargs) -> None:
    from adaptive_eager import api
    api.control_point()


def permanent_point(*_args, **_kwargs) -> None:
    """A control point the program passes every step or batch (and ``ae.sync()``)."""
    global _points_passed
    _points_passed += 1
    _control_point()


def _around(owner, name: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        permanent_point()
        return original(*args, **kwargs)
    wrapper.__adaptive_eager_original__ = original
    setattr(owner, name, wrapper)


def install() -> None:
    """Set up the permanent control points (once per process; they cost nothing measurable:
    one call per step or batch)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        import torch
        import torch.optim.optimizer as optimizer
        import torch.utils.data.dataloader as dataloader
        optimizer.register_optimizer_step_pre_hook(permanent_point)
        _around(torch.Tensor, "backward")
        _around(dataloader._BaseDataLoaderIter, "__next__")


def pause_requested() -> None:
    """A runtime of this thread wants to pause: also stop at the next nn.Module call, or
    the next Python call event outside the dispatch mode."""
    global _module_hook
    with _lock:
        if _module_hook is None:
            import torch
            _module_hook = torch.nn.modules.module.register_module_forward_pre_hook(
                _control_point)
    _pause_at_next_call()


PROFILE_EVENTS_BUDGET = 10_000   # events the one-shot hook waits before giving up


def _pause_at_next_call() -> None:
    """Note [Pausing a bare loop]: ``for _ in range(n): y = (x * 2).sin()`` passes no control
    point, but every torch call in it is a Python call event. A one-shot profile function
    (this thread only) waits for the first event where the mode is back on the stack, i.e.
    between two ops, pauses there, and removes itself: a handful of events at ~0.3 µs each.
    A profiler the program set (cProfile) comes first: then only the other points pause. The
    budget ends the wait if the mode never comes back on top (another mode pushed above)."""
    if sys.getprofile() is not None:
        return
    from adaptive_eager import api
    remaining = [PROFILE_EVENTS_BUDGET]

    def on_event(frame, event, arg) -> None:
        remaining[0] -= 1
        if api.pause_point_reached() or remaining[0] <= 0:
            sys.setprofile(None)
            api.control_point()

    sys.setprofile(on_event)


def no_pause_pending() -> None:
    global _module_hook
    with _lock:
        if _module_hook is not None:
            _module_hook.remove()
            _module_hook = None
