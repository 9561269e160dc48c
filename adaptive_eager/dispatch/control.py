"""Control points: places outside the dispatch mode where the runtime may pause or resume.

A TorchDispatchMode cannot take itself off the mode stack from inside ``__torch_dispatch__``
(PyTorch puts it back when the handler returns). So pausing (Note [Pausing] in
runtime/engine.py) happens here, in the user's thread, between ops: at an optimizer step, a
``backward()`` call, a DataLoader batch, ``ae.sync()``, and, only while a pause is pending, at
the next nn.Module call (a global forward pre-hook, removed once the pause took effect, since
hooks on every module call cost a few microseconds each), and, in a bare loop of tensor ops
that passes none of these, at the next Python call event (Note [Pausing a bare loop]).
The same optimizer hooks run each optimizer's first step plainly (Note [First optimizer step]).
"""
from __future__ import annotations

import functools
import sys
import threading
import weakref

from adaptive_eager.dispatch import upcalls
from adaptive_eager.fork_safety import reinit_in_child

_lock = threading.Lock()
reinit_in_child(_lock)   # Note [Fork] (runtime/engine.py)
_installed = False
_module_hook = None
_points_passed = 0       # permanent control points passed, any thread (a hint, not a count)


_pauses_begun = 0        # pauses begun, any thread (a hint: see pauses_begun)


def pause_begun() -> None:
    global _pauses_begun
    _pauses_begun += 1


def pauses_begun() -> int:
    """How many pauses began (the runtime's own; not ``ae.paused()`` blocks, short and the
    program's): a key seen before and after a change of this count was not watched in
    between, so the time between the two sightings says nothing of its rate."""
    return _pauses_begun


def points_passed() -> int:
    """How many permanent control points the program has passed: a runtime that saw this
    move knows its program comes back to one (and so can wait paused for a kernel)."""
    return _points_passed


def _control_point(*_args, **_kwargs) -> None:
    upcalls.control_point()


# Note [Natural boundaries]
# A control point is where a program's phases meet: the end of its forward (``backward()``),
# of its backward (the optimizer step), of a batch. A segment recorded across one mixes two
# phases whose ops change independently (a model's last layer and the loss, the last gradient
# and the first parameter update) and grows to MAX_SEGMENT_OPS chunks whose compiles took
# 17-38 s each on a transformer step. So every control point ends the segment being recorded
# (and runs deferred work, as any segment end does), and so does the end of a ``backward()``:
# without it the backward's segment ran on into the next step's forward where no optimizer
# step came between (gradient accumulation, evaluation), and its key changed with whatever
# the program did next.


def _end_segment() -> None:
    upcalls.end_segment()


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
        result = original(*args, **kwargs)
        _end_segment()                  # Note [Natural boundaries]: the end of a backward
        return result
    wrapper.__adaptive_eager_original__ = original
    setattr(owner, name, wrapper)


# Note [First optimizer step]
# An optimizer's first step() builds its state (AdamW: a step counter and two zeros_like
# buffers per parameter, and a host sync per parameter for its bias corrections), so its ops
# never come back in that form: recorded, they were ~40 of the 75 ops of a small MLP's first
# training step, cut into 10 segments whose keys are never seen again, and cost ~3 ms of cold
# recording (the step took 14.4 ms, 11.2 ms with it sitting out; eager 8.1 ms). So the first
# step of an optimizer whose state is still empty runs plainly; its later steps, which do
# come back, are first seen one step later. An optimizer without state (SGD without
# momentum) sits out once, not every step. The mode comes back when the step ends: at its
# post-hook, or, if step() raised, at the first control point outside it (control points
# inside it, the backward() of LBFGS's closure or an inner optimizer's step, keep it out).
_stepped: "weakref.WeakSet" = weakref.WeakSet()     # optimizers past their first step


def _optimizer_step_starts(optimizer, _args, _kwargs) -> None:
    permanent_point()
    if optimizer in _stepped:
        return
    try:
        _stepped.add(optimizer)
    except TypeError:              # no weak references to it (__slots__): never sits out
        return
    if not getattr(optimizer, "state", True):
        upcalls.sit_out(optimizer, step_frame=sys._getframe(1))   # the step's hook-calling wrapper


def is_running(frame) -> bool:
    """Is ``frame`` on this thread's call stack (its function not returned or raised yet)?"""
    current = sys._getframe(1)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


def _optimizer_step_ends(optimizer, _args, _kwargs) -> None:
    upcalls.stop_sitting_out(optimizer)


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
        optimizer.register_optimizer_step_pre_hook(_optimizer_step_starts)
        optimizer.register_optimizer_step_post_hook(_optimizer_step_ends)
        _around(torch.Tensor, "backward")
        _around(dataloader._BaseDataLoaderIter, "__next__")


def pause_requested() -> None:
    """A runtime of this thread wants to pause: also stop at the next nn.Module call, or
    the next Python call event outside the dispatch mode. (The C++ backend needs neither: it
    pauses at the next op, CppInterceptor.on_op.)"""
    if not upcalls.pauses_between_ops():
        point_soon()


def point_soon() -> None:
    """Pass a control point soon: at the next nn.Module call, or the next Python call event
    outside the dispatch mode (until no pause is pending)."""
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
    remaining = [PROFILE_EVENTS_BUDGET]

    def on_event(frame, event, arg) -> None:
        remaining[0] -= 1
        if upcalls.pause_point_reached() or remaining[0] <= 0:
            sys.setprofile(None)
            upcalls.control_point()

    sys.setprofile(on_event)


def pause_hooks_installed() -> bool:
    """Is the nn.Module hook of point_soon() on (no_pause_pending() removes it)?"""
    return _module_hook is not None


def no_pause_pending() -> None:
    global _module_hook
    with _lock:
        if _module_hook is not None:
            _module_hook.remove()
            _module_hook = None
