"""Reusing the memory of deferred outputs.

On CPU, writing into a freshly allocated large tensor costs page faults on every first touch
(~10 ms for 32 MB here, as much as the fused kernel itself). The pool keeps the storages of
large outputs it handed out and reuses one only when nothing else refers to it any more: its
storage use count is 1 (the pool's own reference). A user tensor, a view of it, or a tensor
saved by autograd all keep the count above 1, so live data is never overwritten.

Only CPU memory is pooled: a GPU's caching allocator already reuses freed blocks without page
faults, and storages the pool held would be memory eager gives back (up to BUFFER_POOL_MB, an
out-of-memory error that eager would not hit on a nearly full device).
"""
from __future__ import annotations

import torch

from adaptive_eager.dispatch.escapes import raw_untyped_storage
from adaptive_eager.dispatch.signature import TensorMeta

MIN_POOLED_BYTES = 1 << 20   # below this, allocation is cheap and pooling only costs
MAX_PER_SIZE = 4             # storages kept per (device, size): a few live steps' worth

_use_count = torch._C._storage_Use_Count
pooled_storages: set[int] = set()   # the StorageImpls every pool holds (runtime/segment.py)


def storage_bytes(meta: TensorMeta) -> int:
    if any(size == 0 for size in meta.shape):
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(meta.shape, meta.stride))
    return span * meta.dtype.itemsize


class BufferPool:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._slots: dict[tuple, list] = {}

    def empty(self, meta: TensorMeta) -> torch.Tensor:
        """An uninitialized tensor like ``meta``, on reused memory when some is free."""
        nbytes = storage_bytes(meta)
        if nbytes < MIN_POOLED_BYTES or self.max_bytes <= 0 or meta.device.type != "cpu":
            return meta.empty()
        slots = self._slots.get((meta.device, nbytes), ())
        for storage in slots:
            if _use_count(storage._cdata) == 1:
                tensor = torch.empty((0,), dtype=meta.dtype, device=meta.device)
                with torch._C._AutoDispatchBelowADInplaceOrView():   # a fresh tensor: version 0
                    return tensor.set_(storage, 0, meta.shape, meta.stride)
        tensor = meta.empty()
        if len(slots) < MAX_PER_SIZE and self.held_bytes + nbytes <= self.max_bytes:
            # (no slot list for sizes never kept: ever-new shapes must not grow the dict)
            storage = raw_untyped_storage(tensor)
            self._slots.setdefault((meta.device, nbytes), []).append(storage)
            pooled_storages.add(storage._cdata)
            self.held_bytes += nbytes
        return tensor

    def clear(self) -> None:
        for slots in self._slots.values():
            pooled_storages.difference_update(storage._cdata for storage in slots)
        self._slots.clear()
        self.held_bytes = 0
