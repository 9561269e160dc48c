"""The buffer pool reuses memory only when nothing else can read it."""
import torch

from adaptive_eager.dispatch.signature import TensorMeta
from adaptive_eager.runtime.buffers import MIN_POOLED_BYTES, BufferPool, storage_bytes

LARGE = TensorMeta(torch.Size([MIN_POOLED_BYTES // 4]), (1,), torch.float32, torch.device("cpu"))


def _ptr(t):
    return t.untyped_storage().data_ptr()


def test_memory_is_reused_once_the_tensor_is_gone():
    pool = BufferPool(max_bytes=64 << 20)
    first = pool.empty(LARGE)
    address = _ptr(first)
    del first
    second = pool.empty(LARGE)
    assert _ptr(second) == address
    assert second.shape == LARGE.shape and second.stride() == LARGE.stride
    assert second.storage_offset() == 0 and second._version == 0


def test_memory_held_by_a_view_or_autograd_is_never_reused():
    pool = BufferPool(max_bytes=64 << 20)
    first = pool.empty(LARGE)
    view = first[10:20]
    address = _ptr(first)
    del first
    assert _ptr(pool.empty(LARGE)) != address          # the view still reads that memory
    del view
    w = torch.ones(LARGE.shape, requires_grad=True)
    kept = pool.empty(LARGE)
    saved_by_autograd = (w * kept).sum()               # mul saves `kept` for backward
    address = _ptr(kept)
    del kept
    assert _ptr(pool.empty(LARGE)) != address
    saved_by_autograd.backward()


def test_small_tensors_and_a_zero_budget_bypass_the_pool():
    small = TensorMeta(torch.Size([16]), (1,), torch.float32, torch.device("cpu"))
    pool = BufferPool(max_bytes=64 << 20)
    pool.empty(small)
    assert pool.held_bytes == 0
    off = BufferPool(max_bytes=0)
    off.empty(LARGE)
    assert off.held_bytes == 0


def test_held_memory_is_bounded():
    pool = BufferPool(max_bytes=3 * storage_bytes(LARGE))
    kept = [pool.empty(LARGE) for _ in range(6)]
    assert pool.held_bytes == 3 * storage_bytes(LARGE)
    pool.clear()
    assert pool.held_bytes == 0 and len(kept) == 6


def test_only_cpu_memory_is_pooled():
    """Other devices' allocators cache freed blocks themselves: pooled storages there would be
    memory eager gives back (the meta device stands in for a GPU)."""
    pool = BufferPool(max_bytes=64 << 20)
    on_device = LARGE._replace(device=torch.device("meta"))
    for _ in range(3):
        assert pool.empty(on_device).device.type == "meta"
    assert pool.held_bytes == 0
    pool.empty(LARGE)
    assert pool.held_bytes == storage_bytes(LARGE)
