"""Interceptors: what hands a thread's aten ops to its runtime, behind one small interface.

Two backends (NEURON_ADAPTIVE_EAGER_BACKEND):

- ``python``: the AdaptiveMode TorchDispatchMode (dispatch/mode.py). Activating pushes it on
  the thread's mode stack, deactivating pops it; neither can happen inside
  ``__torch_dispatch__``, so pauses wait for a control point (dispatch/control.py).
- ``cpp``: the boxed fallback of csrc/intercept.cpp (Note [The Fake key]). Creating one
  includes the key in the thread's dispatch set; deactivating only sets the thread's paused
  flag, which works anywhere, so the runtime pauses between two ops and a paused thread asks
  every RESUME_EVERY ops whether to come back: no control point is needed.

``auto`` (the default) uses cpp once the extension is built (dispatch/native.py), python until
then, and switches a running program at its next control point (Note [Switching backends]).
"""
from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Iterator

import torch

from adaptive_eager.config import config
from adaptive_eager.dispatch import native, upcalls, waking
from adaptive_eager.dispatch.mode import AdaptiveMode

RESUME_EVERY = 1024    # paused ops between two should_resume() calls (~1 us each)
WAKE_EVERY_S = 0.05    # between two wakes of a thread asleep in a pause (~10-50 us each)

_local = threading.local()   # .top: this thread's innermost CppInterceptor
_callbacks_set = False


class PythonInterceptor:
    backend = "python"
    pauses_between_ops = False     # a mode leaves the stack only at control points

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.mode = AdaptiveMode(runtime)
        if config.BACKEND != "python" and native.loaded() is None and native.failure() is None:
            _waiting.add(self)
            native.when_landed(_tell_waiting)

    def activate(self) -> None:
        self.mode.__enter__()

    unseen = False     # (CppInterceptor's sense; a paused mode is off the stack anyway)
    kernels = False    # (a paused mode runs none)
    asleep = False     # (it needs no waker)

    def deactivate(self, unseen: bool = False, kernels: bool = False) -> None:
        if self.is_active():                        # off the stack, its ops pass unseen
            self.mode.__exit__(None, None, None)

    def has_kernels(self) -> bool:
        """Would a pause keep kernels running (never: a paused mode runs none)?"""
        return False

    def is_active(self) -> bool:
        from torch.utils._python_dispatch import _get_current_dispatch_mode
        return _get_current_dispatch_mode() is self.mode

    def between_ops(self) -> bool:
        """Is this thread outside the interception (so it may pause or switch now)?"""
        return self.is_active()      # the mode is off the stack while its handler runs

    def close(self) -> None:
        if self.is_active():
            self.deactivate()


class CppInterceptor:
    backend = "cpp"
    pauses_between_ops = True      # CppInterceptor.on_op pauses before the next op

    def __init__(self, runtime, ext) -> None:
        _set_callbacks(ext)
        _hide_from_dynamo()
        runtime.unseen_copies = True       # Note [Shallow copies] (runtime/segment.py)
        runtime.native = ext               # Note [The C++ hot path] (csrc/hot_path.cpp)
        self.runtime = runtime
        self.ext = ext
        self.active = False
        self.unseen = False                # paused with the key out of the dispatch set
        self.kernels = False               # paused, running its kernels (deactivate)
        self.asleep = False                # paused, the key out, woken by the waker
        self.paused_ops = 0                # passed while paused with kernels, not yet taken
        self.in_op = False
        # What this thread had before (an outer enable()), restored by close().
        self._outer = getattr(_local, "top", None)
        self._was_included = ext.set_included(True)
        self._was_paused = ext.is_paused()
        ext.set_paused(True)
        self._was_hot = ext.set_hot_thread(True)
        ext.set_pool_limit(config.BUFFER_POOL_MB << 20)
        _local.top = self

    def activate(self) -> None:
        self._wake_no_more()
        self.active, self.unseen, self.kernels = True, False, False
        self.ext.set_included(True)
        self.ext.set_paused(False)

    def deactivate(self, unseen: bool = False, kernels: bool = False) -> None:
        """Pass this thread's ops straight through. ``kernels`` (the runtime's own pauses)
        still runs the kernels C++ knows, if any (Note [Kernels while paused] in
        csrc/hot_path.cpp); else ``unseen``, for a program that comes back to control points,
        takes the key out of the thread's dispatch set too: a paused op then costs nothing
        (the boxed pass-through cost ~1 us an op, 5% of a small training step). A runtime's
        own pause without kernels and without control points to end it (a bare loop) takes
        the key out as well, and the waker ends it (Note [Waking a paused thread] in
        csrc/intercept.cpp), unless the thread runs a profiler of its own. Else the ops still
        reach the extension's fallback, which asks now and then whether the pause is over
        (a sit-out, an optimizer's first step, ends at its post-hook)."""
        self._pause(unseen, runtime_pause=kernels, kernels=kernels and self.ext.has_kernels())

    def drop_kernels(self, unseen: bool) -> None:
        """The runtime's pause goes on without its kernels, as a pause without any (Note
        [Kernels that do not pay while paused] in runtime/paused_kernels.py)."""
        self._pause(unseen, runtime_pause=True, kernels=False)

    def has_kernels(self) -> bool:
        """Would a pause keep kernels running (Note [Kernels while paused])?"""
        return self.ext.has_kernels()

    def take_paused_ops(self) -> int:
        ops, self.paused_ops = self.paused_ops, 0
        return ops

    def _pause(self, unseen: bool, runtime_pause: bool, kernels: bool) -> None:
        asleep = runtime_pause and not kernels and not unseen and sys.getprofile() is None
        self.active, self.kernels, self.paused_ops = False, kernels, 0
        self.unseen = (unseen or asleep) and not kernels
        self.ext.set_paused(True, kernels)
        self.ext.set_included(not self.unseen)      # (ae.paused() may have taken it out)
        if asleep:
            waking.waker(self.ext).wake_later(_woken, WAKE_EVERY_S)
            self.asleep = True
        else:
            self._wake_no_more()

    def _wake_no_more(self) -> None:
        if self.asleep:
            self.asleep = False
            waking.waker(self.ext).cancel()

    def is_active(self) -> bool:
        return self.active

    def between_ops(self) -> bool:
        return self.active and not self.in_op

    def close(self) -> None:
        self._wake_no_more()
        self.active = False
        self.runtime.native = None
        self.ext.set_open(False)
        self.ext.set_hot_thread(self._was_hot)
        if self._outer is None:
            self.ext.pool_clear()              # as the runtime gives back its own pool
        _local.top = self._outer
        self.ext.set_paused(self._was_paused)
        self.ext.set_included(self._was_included)
        if self._outer is not None and self._outer.asleep:    # (one wake a thread: its own)
            waking.waker(self.ext).wake_later(_woken, WAKE_EVERY_S)

    def on_op(self, func, args: tuple, kwargs: dict):
        runtime = self.runtime
        if runtime.pause_requested:            # between two ops: the pause starts here
            upcalls.control_point()
            if not self.active:
                return func(*args, **kwargs)
        self.in_op = True
        try:
            return runtime.on_op(func, args, kwargs)
        finally:
            self.in_op = False
            self.ext.set_open(runtime.segment_open())


def _on_op(func, args: tuple, kwargs: dict):
    """The extension's callback for every op of an including, unpaused thread (the key is
    excluded while it runs)."""
    interceptor = getattr(_local, "top", None)
    if interceptor is None or torch.compiler._is_compiling_flag:
        # A thread that inherited the key without a runtime (autograd's device threads carry
        # dispatch TLS), or Dynamo/export tracing user code: run the op as it comes.
        return func(*args, **kwargs)
    return interceptor.on_op(func, args, kwargs)


def current_runtime():
    """The runtime the C++ interceptor of this thread serves (None: none)."""
    interceptor = getattr(_local, "top", None)
    return None if interceptor is None else interceptor.runtime


def _woken() -> None:
    """The waker's call on a thread asleep in a pause (Note [Waking a paused thread] in
    csrc/intercept.cpp), at a Python call event of its program: end the pause if it is over
    (the waker calls again meanwhile). Not inside the runtime's own code (a control point the
    program passes, enable()): there the next wake comes soon enough."""
    interceptor = getattr(_local, "top", None)
    if interceptor is None or not interceptor.asleep or _inside_the_runtime(sys._getframe(1)):
        return
    upcalls.control_point()


_RUNTIME_MODULES = ("adaptive_eager.api", "adaptive_eager.thread_state",
                    "adaptive_eager.dispatch.", "adaptive_eager.runtime.",
                    "adaptive_eager.cache.")


def _inside_the_runtime(frame) -> bool:
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(_RUNTIME_MODULES):
            return True
        frame = frame.f_back
    return False


def _should_resume() -> None:
    """Every RESUME_EVERY paused ops: end the pause if it is over (thread_state.control_point)."""
    interceptor = getattr(_local, "top", None)
    if interceptor is not None:
        if interceptor.kernels:            # (counted for the pause's kernel ledger)
            interceptor.paused_ops += RESUME_EVERY
        upcalls.control_point()


def _set_callbacks(ext) -> None:
    global _callbacks_set
    if not _callbacks_set:
        ext.set_callbacks(_on_op, _should_resume, RESUME_EVERY)
        _callbacks_set = True


@contextlib.contextmanager
def not_intercepted() -> Iterator[None]:
    """Ops the runtime runs itself outside ``on_op`` (flushes from a control point, sync)
    must not come back to it: exclude the key for the block (a dispatch mode is taken off the
    stack the same way, by engine.below_autograd)."""
    ext = native.loaded()
    if ext is None:
        yield
        return
    previous = ext.set_excluded(True)
    try:
        yield
    finally:
        ext.set_excluded(previous)


def create(runtime):
    """The interceptor for a new ``enable()``, per NEURON_ADAPTIVE_EAGER_BACKEND."""
    if config.BACKEND != "python":
        ext = native.prepare()
        if ext is not None:
            return CppInterceptor(runtime, ext)
    return PythonInterceptor(runtime)


# Note [Switching backends]
# A program that started before the extension was built runs on the Python mode; when the
# background build lands, each waiting mode is told (a flag it reads per op, since only the
# program's own thread may arm that thread's control points) and asks for a control point
# (control.point_soon: the next nn.Module call or Python call event outside the mode), where
# thread_state.control_point swaps the interceptor between two segments: the runtime is flushed, the
# mode leaves the stack, and a CppInterceptor takes over in the same state (active or paused).
_waiting: "weakref.WeakSet[PythonInterceptor]" = weakref.WeakSet()


def _tell_waiting() -> None:
    for interceptor in list(_waiting):
        interceptor.mode.switch_pending = True


def switch_ready(interceptor) -> bool:
    """Note [Switching backends]: should this Python interceptor become a cpp one now?"""
    return isinstance(interceptor, PythonInterceptor) and native.landed() and \
        config.BACKEND != "python" and native.finish() is not None


# Note [Dynamo and the key]
# Dynamo guards every compiled graph on each input's dispatch key set *with the thread's TLS
# include/exclude sets applied*, so a function compiled with the key included recompiled when
# called without it (or the reverse), and the ops of compiled code (externs such as mm) came
# to the runtime. torch.compile's wrapper runs each context's ``enter_exit_hooks`` before it
# captures the TLS sets for the guard check and the call: a hook there that excludes the key
# makes it invisible to guards (included and excluded cancel out, as if never included) and
# lets compiled code run untouched. Three things make that hold:
# - Every context gets the hook, those made before the extension was loaded too:
#   ``enter_exit_hooks`` becomes a class property that adds it to the instance's list. (A scan
#   of gc.get_objects() missed them: enable() has gc.freeze()d them by then, and frozen
#   objects are not listed.)
# - The wrapper calls the compiled code inside a _ForceDispatchKeyGuard of the sets it saved
#   after the hooks ran, and runs the hooks' cleanups inside it too, so a cleanup restoring
#   the key was undone when the guard ended: the key stayed excluded on the thread, and the
#   runtime saw no op again (every later test of the process on this backend saw
#   ops_seen=0). So the cleanup leaves the restore to the wrapper's next
#   ``_maybe_set_eval_frame``, which comes after the guard (and after a context manager's
#   cleanups).
# - Compiled code reads its inputs' memory directly: the thread's deferred work is done
#   first.
_dynamo_hidden = False


def _exclude_while_compiled():
    interceptor = getattr(_local, "top", None)
    if interceptor is not None and interceptor.active:
        interceptor.runtime.flush()
    ext = native.loaded()
    previous = ext.set_excluded(True)

    def cleanup():
        ext.set_excluded(previous)
        _local.restore_excluded = previous       # again, once Dynamo's guard has ended

    return cleanup


def _restore_after(set_eval_frame):
    def set_then_restore(callback):
        result = set_eval_frame(callback)
        previous = getattr(_local, "restore_excluded", None)
        if previous is not None:
            _local.restore_excluded = None
            native.loaded().set_excluded(previous)
        return result
    return set_then_restore


def _hooks_with_ours(context) -> list:
    hooks = context.__dict__.setdefault("enter_exit_hooks", [])
    if _exclude_while_compiled not in hooks and not isinstance(context, _plain_contexts):
        hooks.append(_exclude_while_compiled)
    return hooks


_plain_contexts: tuple = ()      # eval_frame.DisableContext: its code runs eagerly, seen


def _set_hooks(context, hooks: list) -> None:
    context.__dict__["enter_exit_hooks"] = hooks


def _hide_from_dynamo() -> None:
    global _dynamo_hidden
    if _dynamo_hidden:
        return
    _dynamo_hidden = True
    import sys
    if "torch._dynamo.eval_frame" in sys.modules:
        _patch_dynamo(sys.modules["torch._dynamo.eval_frame"])
    else:
        sys.meta_path.insert(0, _DynamoImportHook())


def _patch_dynamo(eval_frame) -> None:
    """Note [Dynamo and the key]."""
    global _plain_contexts
    _plain_contexts = (eval_frame.DisableContext,)
    eval_frame._TorchDynamoContext.enter_exit_hooks = property(_hooks_with_ours, _set_hooks)
    eval_frame._maybe_set_eval_frame = _restore_after(eval_frame._maybe_set_eval_frame)


class _DynamoImportHook:
    """Patches torch._dynamo.eval_frame right after it is first imported (torch.compile
    imports it lazily; importing it ourselves would cost ~2 s)."""

    def find_spec(self, fullname, path, target=None):
        import importlib.util
        import sys
        if fullname != "torch._dynamo.eval_frame":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _patch_dynamo(module)

        spec.loader.exec_module = exec_then_patch
        return spec
