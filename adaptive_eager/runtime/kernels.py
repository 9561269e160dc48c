"""The kernels in memory: in the trie the hot path walks, and in an LRU that bounds them.

A kernel comes in compiled (runtime/compiles.py), loaded from the disk store, or shipped by
the compile worker. ``CACHE_SIZE`` kernels stay loaded; the least recently used is evicted,
and its key turns cold, to load its artifact again when it turns hot. Loading the first kernel
of a process imports Inductor: ``prepare_loading`` does that on a thread ahead of time.
"""
from __future__ import annotations

import os
import shutil
import threading
import time

from adaptive_eager import faults
from adaptive_eager.cache.disk import DiskCache
from adaptive_eager.cache.memory import KernelLRU
from adaptive_eager.config import config
from adaptive_eager.runtime.compiler import current_compiler
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime.direct_call import fast_call
from adaptive_eager.runtime.entries import KeyEntry, KeyState
from adaptive_eager.runtime.gc_freeze import freeze_gc
from adaptive_eager.runtime import native_plans
from adaptive_eager.runtime.stats import counters
from adaptive_eager.runtime.trie import KernelTrie, Variant
from adaptive_eager.runtime.worker import is_transfer_file


class LoadedKernels:
    def __init__(self, trie: KernelTrie, disk: DiskCache | None,
                 memory_size: int | None = None) -> None:
        self.trie = trie
        self.disk = disk
        self.lru = KernelLRU(memory_size or config.CACHE_SIZE, self._evicted)

    def install(self, entry: KeyEntry, kernel) -> None:
        kernel = faults.damaged_kernel(fast_call(kernel))   # Note [Calling the generated code]
        freeze_gc("inductor")
        entry.state = KeyState.READY
        native_plans.unwatch(entry)               # Python's engine runs it now
        variant = self.trie.insert(entry.segment, kernel, entry)
        self.lru[entry.digest] = variant          # may evict the least recently used

    def _evicted(self, digest: str, variant: Variant) -> None:
        self.trie.remove(variant)
        entry = variant.entry
        decide("evicted", key=digest)
        if entry.state is KeyState.READY:
            entry.state = KeyState.COLD              # hot again at next sight: load or compile
            entry.artifact_path = entry.saved_artifact or entry.artifact_path

    def drop(self, variant: Variant) -> None:
        """Out of the trie the hot path walks and out of memory (the store keeps its record)."""
        self.trie.remove(variant)
        self.lru.pop(variant.entry.digest, None)

    def release_all(self) -> None:
        """Unload every kernel; their keys turn hot again at first sight and load them."""
        while self.lru:
            self.lru.popitem()    # KernelLRU.popitem takes it out of the trie too

    def clear(self) -> None:
        self.trie.clear()
        self.lru.clear()

    def load(self, entry: KeyEntry) -> bool:
        """Load and install the artifact an earlier process stored for ``entry``, if any."""
        if entry.artifact_path is None:
            return False
        started = time.perf_counter()
        _wait_for_preparation()
        kernel = self.disk.load_kernel(entry.artifact_path, current_compiler())
        entry.saved_artifact, entry.artifact_path = entry.artifact_path, None
        if kernel is None:
            return False
        counters.add("cache_hits_disk")
        seconds = time.perf_counter() - started
        counters.add("cache_load_seconds", seconds)
        self.install(entry, kernel)
        decide("loaded", key=entry.digest, ops=len(entry.segment.ops), seconds=seconds)
        return True

    def load_shipped(self, path: str):
        """The kernel the worker shipped at ``path`` (None if it does not load); a temporary
        directory it came through is removed once loaded."""
        _wait_for_preparation()
        kernel = self.disk.load_kernel(path, current_compiler())
        if is_transfer_file(path):
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        return kernel


_preparing: threading.Thread | None = None


def prepare_loading(compiler) -> None:
    """Once per process: let the compiler do the one-time work of loading kernels (Inductor
    imports) in the background, while the worker compiles the first one."""
    global _preparing
    prepare = getattr(compiler, "prepare_load", None)
    if prepare is None or _preparing is not None:
        return
    _preparing = threading.Thread(target=_after_a_while(prepare), daemon=True,
                                  name="adaptive-eager-prepare-load")
    _preparing.start()


PREPARE_DELAY_S = 1.0   # Inductor's imports hold the GIL ~2 s; not during the program's
                        # first second (its first steps), and a compile takes longer anyway


_needed_now = threading.Event()      # a load is waiting: stop delaying


def _after_a_while(prepare):
    def run() -> None:
        _needed_now.wait(PREPARE_DELAY_S)
        try:
            prepare()
        except Exception:  # the load will do it again, in the program's thread, and report
            pass
    return run


def _wait_for_preparation() -> None:
    """Our loads never import Inductor beside the preparing thread: two threads importing
    modules that import each other can fail with a deadlock error."""
    if _preparing is not None:
        _needed_now.set()
        _preparing.join()
