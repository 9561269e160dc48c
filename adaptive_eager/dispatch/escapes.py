"""Reads that bypass the dispatcher, and the flush that must come before them.

Deferred outputs are real tensors whose memory is filled only when their segment ends. Reads
through aten ops end the segment by themselves; these methods read memory directly, so while the
runtime is on they are wrapped to run deferred work first. ``.item()`` needs nothing: it
dispatches ``_local_scalar_dense``, a boundary.

# Note [.data assignment]
``t.data = other`` gives ``t`` other's memory, shape and strides without an op the mode sees
(``set_data`` runs below it). A segment must not span it: a deferred run would read t's new
memory (perhaps an unfilled buffer, as in ``ema.data = ema.data * 0.9 + p * 0.1``) for ops that
came before, and a recorded key would give one input two shapes. So while the runtime is on,
the setter ends this thread's segment first, like a boundary op, and runs deferred work of
other threads' runtimes. ``torch.utils.swap_tensors`` likewise.

# Note [Storage aliases]
``nn.Parameter(t)`` (``Tensor._make_subclass``) makes a new tensor on t's memory without an op
the mode sees. If t is a deferred output and the program keeps only the parameter
(``copy.deepcopy`` of a model: ``Parameter(p.data.clone())``; ``nn.Parameter(w * s)`` at
init), the segment sees t die, so its kernel wrote t's value elsewhere and the parameter kept
unfilled memory: garbage weights, NaN after one SGD step. So it first runs deferred work, as the
escaping methods do. (``t.as_subclass(cls)`` keeps t alive, and ``.data``, ``detach`` and
``nn.Buffer`` are ops the mode sees: views.)

# Note [Outside memory]
``torch.from_numpy(buffer)`` (and ``as_tensor``/``asarray`` of an array they do not copy,
``frombuffer``, ``from_dlpack``) makes a tensor whose memory another library writes without any
op: ``buffer[:] = next_batch`` between two steps. A deferred run that reads such a tensor would
compute with the later contents (its kernel runs at the next op). While the runtime is on,
these constructors remember the storage they return (weakly, by address), and every op that
reads it runs per-op, as a boundary (``outside_memory`` in stats): ``.clone()`` or ``.to()``
such an input to fuse what follows. Tensors made before ``enable()``, or through a name bound
before it (``from torch import from_numpy``), are not known (with ``NEURON_ADAPTIVE_EAGER=1``
the runtime is on before the program starts), nor numpy views of torch memory (``t.numpy()``,
which tensorboard histograms call on parameters: treating those as outside memory would stop
fusion for good).
"""
from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from adaptive_eager.dispatch import native, upcalls
from adaptive_eager.fork_safety import reinit_in_child

# The runtime's own storage access must not go through the flushing wrapper below (it would
# try to flush from inside the runtime): it uses this, the method the wrapper wraps.
raw_untyped_storage = torch._C.TensorBase.untyped_storage


# Note [Storages without Python objects]
# A storage's Python object, once made, lives as long as the storage (torch keeps the Python
# object of a StorageImpl alive while C++ holds it), and holds a reference to it. Autograd
# adds a second gradient into the first in place only where it holds the only reference to
# its storage (InputBuffer's can_accumulate_inplace), so a gradient whose storage the
# recording had looked at through untyped_storage() was added out of place, where eager and
# the C++ backend's own runs add it in place. Python's recording then saw add where C++ saw
# add_: a training step's cold plans missed at every such op, and its backward was cut
# differently from step to step (a small GPT-2's: 21 keys instead of 10, 17 misses in 12
# steps). So where the extension is loaded, the recording knows a storage by its address and
# a weak reference that C++ makes, without a Python object.
def storage_address(tensor: torch.Tensor) -> int:
    """``raw_untyped_storage(tensor)._cdata``, without making the storage's Python object."""
    ext = native.loaded()
    return ext.storage_address(tensor) if ext is not None else \
        raw_untyped_storage(tensor)._cdata


def storage_weak_ref(tensor: torch.Tensor) -> StorageWeakRef:
    """``StorageWeakRef(raw_untyped_storage(tensor))``, without making the storage's Python
    object."""
    ext = native.loaded()
    if ext is None:
        return StorageWeakRef(raw_untyped_storage(tensor))
    return StorageWeakRef.from_weakref(ext.storage_weak_ref(tensor))


_ESCAPING_METHODS = ("numpy", "tolist", "data_ptr", "__array__", "__dlpack__", "untyped_storage",
                     "storage", "_typed_storage", "__reduce_ex__")
# Note [Handoffs]: another thread does not run under this thread's runtime, so its ops on a
# deferred tensor would read unfilled memory. The usual ways of handing data to a thread
# flush the handing thread's deferred work first. (Sharing through a plain variable is not
# covered: README, "Threads".)
_HANDOFFS = ((queue.Queue, "put"), (threading.Thread, "start"),
             (concurrent.futures.ThreadPoolExecutor, "submit"))
_DATA = torch._C.TensorBase.__dict__["data"]   # the getset descriptor of Tensor.data
_SHARING_CONSTRUCTORS = ((torch, "from_numpy"), (torch, "as_tensor"), (torch, "asarray"),
                         (torch, "frombuffer"), (torch, "from_dlpack"))
# storage address -> that storage (Note [Outside memory]); an entry lives as long as the storage,
# so an address torch allocates again later is not mistaken for it
_outside_memory: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_any_outside_memory = False    # a plain flag: the check below runs for every new segment input
_outside_lock = threading.Lock()
_originals: dict[tuple, object] = {}
_lock = threading.Lock()
_installs = 0
reinit_in_child(_lock, _outside_lock)   # Note [Fork] (runtime/engine.py)


def flush_deferred() -> None:
    """Run every runtime's deferred work (not the segments being recorded)."""
    for runtime in upcalls.live_runtimes():
        if runtime.has_deferred():
            runtime.flush(end_segment=False)


def _flush_this_thread() -> None:
    me = threading.get_ident()
    for runtime in upcalls.live_runtimes():
        if runtime.owner_thread == me and runtime.has_deferred():
            runtime.flush(end_segment=False)


def _end_segments_before_data_swap() -> None:
    """Note [.data assignment]."""
    me = threading.get_ident()
    for runtime in upcalls.live_runtimes():
        if runtime.owner_thread == me:
            runtime.flush()                       # runs deferred work and ends the segment
        elif runtime.has_deferred():
            runtime.flush(end_segment=False)


def _set_data(self, new_data) -> None:
    if not torch.compiler.is_compiling():      # Dynamo tracing: no segment to end
        _end_segments_before_data_swap()
    _DATA.__set__(self, new_data)


# The getter stays the C one (a property calls it without a Python frame).
_data_property = property(_DATA.__get__, _set_data, doc=_DATA.__doc__)


def _storage_of(tensor: torch.Tensor):
    """Its storage, or None for tensors without one (sparse, meta, subclasses without data)."""
    if tensor.layout is not torch.strided or tensor.is_meta:
        return None
    try:
        return raw_untyped_storage(tensor)
    except RuntimeError:
        return None


def _remember_outside_memory(storage) -> None:
    global _any_outside_memory
    with _outside_lock:
        _outside_memory[storage.data_ptr()] = storage
        _any_outside_memory = True


def tell_outside_memory(ext) -> None:
    """The C++ extension just loaded: what it must know of Note [Outside memory] so far."""
    with _outside_lock:
        storages = list(_outside_memory.values())
    for storage in storages:
        ext.note_outside(torch.empty(0, dtype=torch.uint8).set_(storage))


def _remembering_outside_memory(constructor):
    @functools.wraps(constructor)
    def wrapper(*args, **kwargs):
        tensor = constructor(*args, **kwargs)
        if isinstance(tensor, torch.Tensor) and not torch.compiler.is_compiling():
            storage = _storage_of(tensor)
            # not resizable: not torch's own allocation, so shared (as_tensor may copy instead)
            if storage is not None and not storage.resizable():
                _remember_outside_memory(storage)
                ext = native.loaded()
                if ext is not None:            # Note [The C++ hot path]
                    ext.note_outside(tensor)
        return tensor
    wrapper.__adaptive_eager_original__ = constructor
    return wrapper


def shares_outside_memory(tensor: torch.Tensor) -> bool:
    """Does ``tensor`` read memory that a numpy array (or buffer) shares? Note [Outside memory].
    Free while no such tensor was made."""
    if not _any_outside_memory:
        return False
    storage = _storage_of(tensor)
    if storage is None:
        return False
    with _outside_lock:
        return _outside_memory.get(storage.data_ptr()) is storage


def _flushing(method, flush):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        flush()
        return method(self, *args, **kwargs)
    wrapper.__adaptive_eager_original__ = method
    return wrapper


def _unseen(method):
    """``method`` with the C++ interception off while it runs. torch turns dispatch modes
    off around the detach inside ``Tensor._make_subclass`` (nn.Parameter, nn.Buffer), whose
    result must be a tensor no Python object was made for yet; the C++ backend handed that
    detach to the runtime, which made one, and building any nn.Module raised "the raw Tensor
    object is already associated to a python object of type Tensor"."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        ext = native.loaded()
        if ext is None:
            return method(*args, **kwargs)
        previous = ext.set_excluded(True)
        try:
            return method(*args, **kwargs)
        finally:
            ext.set_excluded(previous)
    wrapper.__adaptive_eager_original__ = getattr(method, "__adaptive_eager_original__", method)
    return wrapper


def _flush_deferred_unless_compiling() -> None:
    if not torch.compiler.is_compiling():     # Dynamo tracing: nothing deferred to run
        flush_deferred()


def _wrapped_methods():
    yield from ((torch.Tensor, name, flush_deferred) for name in _ESCAPING_METHODS)
    yield from ((owner, name, _flush_this_thread) for owner, name in _HANDOFFS)
    # swaps two tensors' contents with no op (Note [.data assignment]), and refuses tensors
    # that a segment holds (weakrefs, use counts): ``model.to()`` raised with
    # torch.__future__.set_swap_module_params_on_conversion(True)
    yield torch.utils, "swap_tensors", _end_segments_before_data_swap


def install() -> None:
    """Wrap the escaping methods and handoffs (counted: nested enables install once)."""
    global _installs
    with _lock:
        _installs += 1
        if _installs > 1:
            return
        for owner, name, flush in _wrapped_methods():
            _originals[owner, name] = owner.__dict__.get(name)
            setattr(owner, name, _flushing(getattr(owner, name), flush))
        _originals[torch.Tensor, "_make_subclass"] = torch.Tensor.__dict__.get("_make_subclass")
        torch.Tensor._make_subclass = staticmethod(_unseen(_flushing(   # Note [Storage aliases]
            torch.Tensor._make_subclass, _flush_deferred_unless_compiling)))
        _originals[torch.Tensor, "as_subclass"] = torch.Tensor.__dict__.get("as_subclass")
        torch.Tensor.as_subclass = _unseen(_flushing(       # its alias, as _make_subclass's
            torch.Tensor.as_subclass, _flush_deferred_unless_compiling))
        _originals[torch.Tensor, "data"] = torch.Tensor.__dict__.get("data")
        torch.Tensor.data = _data_property
        for owner, name in _SHARING_CONSTRUCTORS:
            _originals[owner, name] = owner.__dict__.get(name)
            setattr(owner, name, _remembering_outside_memory(getattr(owner, name)))
        # CuPy, Numba and others read CUDA memory through this property, not a method
        interface = torch.Tensor.__dict__["__cuda_array_interface__"]
        _originals[torch.Tensor, "__cuda_array_interface__"] = interface
        torch.Tensor.__cuda_array_interface__ = property(
            _flushing(interface.fget, flush_deferred), doc=interface.__doc__)


def uninstall() -> None:
    global _installs
    with _lock:
        _installs -= 1
        if _installs > 0:
            return
        for (owner, name), original in _originals.items():
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _originals.clear()
