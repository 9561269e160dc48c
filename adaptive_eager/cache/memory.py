"""The in-memory level: loaded fused kernels, bounded by NEURON_ADAPTIVE_EAGER_CACHE_SIZE.

Least recently used kernels are evicted; the callback takes them out of the trie the hot path
walks, so their memory is released. An evicted segment that turns hot again is loaded from
the disk store (or compiled, if it has no artifact).
"""
from __future__ import annotations

from typing import Any, Callable

import cachetools


class KernelLRU(cachetools.LRUCache):
    def __init__(self, maxsize: int, on_evict: Callable[[Any, Any], None]) -> None:
        super().__init__(maxsize)
        self._on_evict = on_evict

    def popitem(self):
        key, value = super().popitem()
        self._on_evict(key, value)
        return key, value
