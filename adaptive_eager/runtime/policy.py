"""Which segments get compiled: counting keys, deciding hot, remembering failures.

Every finished cold segment is ``observe``d. A key seen ``HOT_THRESHOLD`` times becomes hot and,
unless compilation is off or the segment has nothing to fuse, is compiled; a kernel goes into the
trie the hot path walks. A compile failure is a negative entry: that key runs per-op for good,
with its reason kept and counted.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import threading

from adaptive_eager.cache.digest import stable_digest
from adaptive_eager.config import config
from adaptive_eager.runtime.compiler import compile_segment, current_compiler
from adaptive_eager.runtime.segment import Segment
from adaptive_eager.runtime.stats import counters
from adaptive_eager.runtime.trie import KernelTrie, Variant

log = logging.getLogger("adaptive_eager")

MIN_COMPUTE_OPS = 2   # a single op gains nothing from fusion and pays the hot-path overhead


class KeyState(str, enum.Enum):
    COLD = "cold"              # seen fewer than HOT_THRESHOLD times
    HOT = "hot"                # hot, but compilation is off (COMPILE=0)
    READY = "ready"            # compiled; the hot path replays it fused
    FAILED = "failed"          # compile failed: per-op for good (negative entry)
    UNFUSIBLE = "unfusible"    # hot, but nothing worth fusing (e.g. a single op)


@dataclasses.dataclass(eq=False)
class KeyEntry:
    digest: str
    segment: Segment           # the first recording of this key
    state: KeyState = KeyState.COLD
    seen: int = 0
    fused_runs: int = 0
    compile_seconds: float = 0.0
    reason: str | None = None


def unfusible_reason(segment: Segment) -> str | None:
    if segment.compute_ops < MIN_COMPUTE_OPS:
        return "too_few_ops"
    if any(_overlaps_itself(segment.out_meta(ref)) for ref in segment.live_refs):
        return "overlapping_output"        # a kernel cannot write one memory cell twice
    return None


def _overlaps_itself(meta) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(meta.shape, meta.stride))


class KeyTable:
    def __init__(self, trie: KernelTrie) -> None:
        self.trie = trie
        self._entries: dict[tuple, KeyEntry] = {}
        self._lock = threading.RLock()

    def entries(self) -> list[KeyEntry]:
        with self._lock:
            return list(self._entries.values())

    def observe(self, segment: Segment) -> KeyEntry:
        """Count one recorded occurrence of ``segment``; compile it when it turns hot."""
        counters.add("segments_recorded")
        with self._lock:
            entry = self._entries.get(segment.key)
            if entry is None:
                entry = self._entries[segment.key] = KeyEntry(stable_digest(segment.key), segment)
                counters.add("keys_seen")
            entry.seen += 1
            if entry.state is KeyState.COLD and entry.seen >= config.HOT_THRESHOLD:
                self._turn_hot(entry)
        return entry

    def _turn_hot(self, entry: KeyEntry) -> None:
        counters.add("hot_keys")
        reason = unfusible_reason(entry.segment)
        if reason is not None:
            entry.state, entry.reason = KeyState.UNFUSIBLE, reason
            counters.fallback(reason)
        elif not config.COMPILE:
            entry.state, entry.reason = KeyState.HOT, "compile_disabled"
            counters.fallback("compile_disabled")
        else:
            self._compile(entry)

    def _compile(self, entry: KeyEntry) -> None:
        compiler = current_compiler()
        try:
            kernel, seconds = compile_segment(entry.segment, compiler)
        except Exception as err:  # any compiler error: this key runs per-op for good
            self.mark_failed(entry, f"compile_error: {type(err).__name__}: {err}"[:500])
            counters.add("compile_failures")
            return
        entry.state, entry.compile_seconds = KeyState.READY, seconds
        counters.add("compiles")
        counters.add("compile_seconds", seconds)
        self.trie.insert(entry.segment, kernel, entry)
        log.info("compiled %s (%d ops) in %.2fs with %s", entry.digest,
                 len(entry.segment.ops), seconds, compiler.name)

    def mark_failed(self, entry: KeyEntry, reason: str) -> None:
        entry.state, entry.reason = KeyState.FAILED, reason
        counters.fallback("compile_failed" if reason.startswith("compile_error") else
                          reason.split(":")[0])
        log.warning("segment %s (%s) will run per-op: %s", entry.digest,
                    entry.segment.describe()[:200], reason)

    def kernel_failed(self, variant: Variant, err: Exception) -> None:
        """A compiled kernel raised at run time: never replay it again."""
        with self._lock:
            self.trie.remove(variant)
            self.mark_failed(variant.entry, f"kernel_error: {type(err).__name__}: {err}"[:500])

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.trie.clear()
