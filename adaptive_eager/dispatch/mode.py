"""Interception: a TorchDispatchMode that hands every aten op to a runtime.

A dispatch mode sits below autograd, so it sees forward ops after decomposition, every backward
op and the optimizer's ``_foreach_*`` ops (a ``__torch_function__`` mode would miss backward).
The mode stack is thread-local, and the autograd engine carries it into its worker threads, so
the backward of a graph built under this mode reaches the same runtime.

# Note [Ops above autograd]
A mode sees nearly every op below autograd: the op's autograd kernel took autograd and
ADInplaceOrView out of the thread's dispatch state before passing it on. Not all: the detach
autograd itself calls when a node saves one of its outputs for backward (exp, tanh, softmax,
attention) reaches the mode with autograd active. Work the runtime does of its own when such an
op ends a segment (a kernel, a per-op replay, a check) was recorded by autograd: the stand-in
kernel's copy into an output the user holds gave that output a CopyBackwards node over a second
copy of the segment's ops, and the next backward ran them twice (a GPT-2 training step: 115
autograd nodes became 171, and segments diverged). So a deferred run ends below autograd
(Runtime._end_hot), as a flush from outside the mode does (engine.below_autograd); the C++
backend hands every op over below autograd anyway (Note [Below ADInplaceOrView], csrc).
"""
from __future__ import annotations

from torch.compiler import is_compiling
from torch.utils._python_dispatch import TorchDispatchMode


class AdaptiveMode(TorchDispatchMode):
    def __init__(self, runtime) -> None:
        super().__init__()
        self.runtime = runtime
        self.switch_pending = False    # Note [Switching backends] (dispatch/interceptor.py)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode would wrap __torch_dispatch__ in torch._dynamo.disable: ~5 us per
        # op, and a 2 s import of torch._dynamo on the first op. We guard Dynamo ourselves.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Dynamo/AOT tracing of user-compiled code: stay out. Dynamo inlines this method (see
        # _should_skip_dynamo), so nothing here may take a lock or touch our state: a counter
        # split every compiled function into two graphs.
        if is_compiling():
            return func(*args, **(kwargs or {}))
        if self.switch_pending:
            self.switch_pending = False
            from adaptive_eager.dispatch import control
            control.point_soon()
        return self.runtime.on_op(func, args, kwargs or {})


class PassThroughMode(TorchDispatchMode):
    """A dispatch mode that does nothing: the floor any Python interception costs (see
    bench/overhead.py), and the oracle for ops that PyTorch decomposes differently whenever a
    Python dispatch mode is active (tests/runtime/test_opinfo.py)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
