"""Reads that bypass the dispatcher, and the flush that must come before them.

Deferred outputs are real tensors whose memory is filled only when their segment ends. Reads
through aten ops end the segment by themselves; these methods read memory directly, so while the
runtime is on they are wrapped to run deferred work first. ``.item()`` needs nothing: it
dispatches ``_local_scalar_dense``, a boundary.
"""
from __future__ import annotations

import functools
import threading

import torch

# The runtime's own storage access must not go through the flushing wrapper below (it would
# try to flush from inside the runtime): it uses this, the method the wrapper wraps.
raw_untyped_storage = torch._C.TensorBase.untyped_storage

_ESCAPING_METHODS = ("numpy", "tolist", "data_ptr", "__array__", "__dlpack__", "untyped_storage",
                     "storage", "_typed_storage", "__reduce_ex__")
_originals: dict[str, object] = {}
_lock = threading.Lock()
_installs = 0


def _flush_deferred() -> None:
    from adaptive_eager.runtime.engine import live_runtimes
    for runtime in live_runtimes():
        if runtime.has_deferred():
            runtime.flush(end_segment=False)


def _flushing(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        _flush_deferred()
        return method(self, *args, **kwargs)
    wrapper.__adaptive_eager_original__ = method
    return wrapper


def install() -> None:
    """Wrap the escaping methods (counted: nested enables install once)."""
    global _installs
    with _lock:
        _installs += 1
        if _installs > 1:
            return
        for name in _ESCAPING_METHODS:
            original = getattr(torch.Tensor, name)
            _originals[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, _flushing(original))


def uninstall() -> None:
    global _installs
    with _lock:
        _installs -= 1
        if _installs > 0:
            return
        for name, original in _originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        _originals.clear()
