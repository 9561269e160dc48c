"""Which segments get compiled: counting keys, deciding hot, remembering decisions.

Every finished cold segment is ``observe``d. A key seen ``HOT_THRESHOLD`` times becomes hot and,
unless compilation is off or the segment has nothing to fuse, gets a kernel: loaded from the
disk store when an earlier process compiled it (such keys turn hot at first sight), compiled
otherwise. Kernels go into the trie the hot path walks and into the in-memory LRU. A failure
is a negative entry: that key runs per-op for good, with its reason kept, counted and stored.
"""
from __future__ import annotations

import dataclasses
import enum
import threading
import time

from adaptive_eager.cache.digest import stable_digest
from adaptive_eager.cache.disk import DiskCache
from adaptive_eager.cache.memory import KernelLRU
from adaptive_eager.cache.store import SegmentRecord
from adaptive_eager.config import config
from adaptive_eager.runtime.compiler import compile_segment, current_compiler
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime.describe import key_parts, op_lines
from adaptive_eager.runtime.segment import Segment
from adaptive_eager.runtime.stats import counters
from adaptive_eager.runtime.trie import KernelTrie, Variant

MIN_COMPUTE_OPS = 2   # a single op gains nothing from fusion and pays the hot-path overhead


class KeyState(str, enum.Enum):
    COLD = "cold"              # seen fewer than HOT_THRESHOLD times (or its kernel was evicted)
    HOT = "hot"                # hot, but compilation is off (COMPILE=0)
    READY = "ready"            # has a kernel; the hot path replays it fused
    FAILED = "failed"          # compile, kernel or verification failed: per-op for good
    UNFUSIBLE = "unfusible"    # hot, but nothing worth fusing (e.g. a single op)
    DISABLED = "disabled"      # the user turned fusion off for this key (bisecting)


@dataclasses.dataclass(eq=False)
class KeyEntry:
    digest: str
    segment: Segment           # the first recording of this key
    state: KeyState = KeyState.COLD
    seen: int = 0
    fused_runs: int = 0
    compile_seconds: float = 0.0
    reason: str | None = None
    artifact_path: str | None = None   # an artifact to load when it turns hot (again)
    saved_artifact: str | None = None  # where this process saved its kernel
    eager_seconds: float = 0.0         # wall time of per-op runs (under the runtime)
    eager_runs: int = 0
    fused_seconds: float = 0.0         # wall time of fused runs, deferral included
    timed_fused_runs: int = 0

    @property
    def eager_ms(self) -> float | None:
        return self.eager_seconds / self.eager_runs * 1e3 if self.eager_runs else None

    @property
    def fused_ms(self) -> float | None:
        return self.fused_seconds / self.timed_fused_runs * 1e3 if self.timed_fused_runs \
            else None

    @property
    def saved_seconds(self) -> float:
        """Time fusion saved so far: (per-op time - fused time) x fused runs."""
        if self.eager_ms is None or self.fused_ms is None:
            return 0.0
        return (self.eager_ms - self.fused_ms) / 1e3 * self.fused_runs


def unfusible_reason(segment: Segment) -> str | None:
    if segment.compute_ops < MIN_COMPUTE_OPS:
        return "too_few_ops"
    if any(_overlaps_itself(segment.out_meta(ref)) for ref in segment.live_refs):
        return "overlapping_output"        # a kernel cannot write one memory cell twice
    return None


def _overlaps_itself(meta) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(meta.shape, meta.stride))


class KeyTable:
    def __init__(self, trie: KernelTrie, disk: DiskCache | None = None,
                 memory_size: int | None = None) -> None:
        self.trie = trie
        self.disk = disk
        self.kernels = KernelLRU(memory_size or config.CACHE_SIZE, self._evicted)
        self._entries: dict[tuple, KeyEntry] = {}
        self._lock = threading.RLock()

    def entries(self) -> list[KeyEntry]:
        with self._lock:
            return list(self._entries.values())

    # ------------------------------------------------------------------ observing

    def observe(self, segment: Segment, seconds: float = 0.0) -> KeyEntry:
        """Count one per-op run of ``segment`` (taking ``seconds``); get it a kernel when it
        turns hot."""
        counters.add("segments_recorded")
        with self._lock:
            entry = self._entries.get(segment.key)
            if entry is None:
                entry = self._entries[segment.key] = self._new_entry(segment)
            entry.seen += 1
            entry.eager_seconds += seconds
            entry.eager_runs += 1
            self._note(entry, seen=1, eager_ms=entry.eager_ms)
            threshold = 1 if entry.artifact_path else config.HOT_THRESHOLD
            if entry.state is KeyState.COLD and entry.seen >= threshold:
                self._turn_hot(entry)
        self.maybe_flush()
        return entry

    def _new_entry(self, segment: Segment) -> KeyEntry:
        counters.add("keys_seen")
        entry = KeyEntry(stable_digest(segment.key), segment)
        if self.disk is not None:
            self.disk.register(entry.digest, op_lines(segment), key_parts(segment),
                               current_compiler().name)
            record = self.disk.lookup(entry.digest)
            if record is not None:
                self._apply_history(entry, record)
        return entry

    def _apply_history(self, entry: KeyEntry, record: SegmentRecord) -> None:
        """What an earlier process learned about this key."""
        if record.state in (KeyState.FAILED.value, KeyState.DISABLED.value):
            entry.state, entry.reason = KeyState(record.state), record.reason
        elif record.state == KeyState.READY.value:
            entry.artifact_path = self.disk.loadable_artifact(record, current_compiler().name)

    def _turn_hot(self, entry: KeyEntry) -> None:
        counters.add("hot_keys")
        decide("hot", key=entry.digest, ops=len(entry.segment.ops), seen=entry.seen)
        reason = unfusible_reason(entry.segment)
        if reason is not None:
            entry.state, entry.reason = KeyState.UNFUSIBLE, reason
            counters.fallback(reason)
            decide("unfusible", key=entry.digest, reason=reason)
        elif entry.digest.startswith(config.DISABLE_KEYS or ("\0",)):
            entry.state, entry.reason = KeyState.DISABLED, "NEURON_ADAPTIVE_EAGER_DISABLE_KEYS"
            counters.fallback("disabled_key")
            decide("disabled", key=entry.digest, by=entry.reason)
            return                         # a setting of this run, not a stored decision
        elif not config.COMPILE:
            entry.state, entry.reason = KeyState.HOT, "compile_disabled"
            counters.fallback("compile_disabled")
            decide("compile_disabled", key=entry.digest)
        elif not self._load(entry):
            self._compile(entry)
            return
        self._note(entry, state=entry.state.value, reason=entry.reason)

    # ------------------------------------------------------------------ kernels

    def _load(self, entry: KeyEntry) -> bool:
        if entry.artifact_path is None:
            return False
        started = time.perf_counter()
        kernel = self.disk.load_kernel(entry.artifact_path, current_compiler())
        entry.saved_artifact, entry.artifact_path = entry.artifact_path, None
        if kernel is None:
            return False
        counters.add("cache_hits_disk")
        seconds = time.perf_counter() - started
        counters.add("cache_load_seconds", seconds)
        self._install(entry, kernel)
        decide("loaded", key=entry.digest, ops=len(entry.segment.ops), seconds=seconds)
        return True

    def _compile(self, entry: KeyEntry) -> None:
        compiler = current_compiler()
        try:
            kernel, seconds = compile_segment(entry.segment, compiler)
        except Exception as err:  # any compiler error: this key runs per-op for good
            counters.add("compile_failures")
            self.mark_failed(entry, f"compile_error: {type(err).__name__}: {err}"[:500])
            return
        entry.compile_seconds = seconds
        counters.add("compiles")
        counters.add("compile_seconds", seconds)
        self._install(entry, kernel)
        artifact = self.disk.save_kernel(entry.digest, kernel, compiler) if self.disk else {}
        if artifact:
            entry.saved_artifact = self.disk.store.artifact_file(artifact["artifact"])
        self._note(entry, state=entry.state.value, reason=None, compile_seconds=seconds,
                   **artifact)
        self.flush()                       # a decision other processes can use right away
        decide("compiled", key=entry.digest, ops=len(entry.segment.ops), seconds=seconds,
               compiler=compiler.name)

    def _install(self, entry: KeyEntry, kernel) -> None:
        entry.state = KeyState.READY
        variant = self.trie.insert(entry.segment, kernel, entry)
        self.kernels[entry.digest] = variant          # may evict the least recently used

    def _evicted(self, digest: str, variant: Variant) -> None:
        self.trie.remove(variant)
        entry = variant.entry
        decide("evicted", key=digest)
        if entry.state is KeyState.READY:
            entry.state = KeyState.COLD              # hot again at next sight: load or compile
            entry.artifact_path = entry.saved_artifact or entry.artifact_path

    def touch(self, variant: Variant, seconds: float) -> None:
        """A fused run of ``variant`` took ``seconds``: count it, keep its kernel recently
        used."""
        self.kernels.get(variant.entry.digest)
        counters.add("cache_hits_memory")
        entry = variant.entry
        entry.fused_runs += 1
        entry.fused_seconds += seconds
        entry.timed_fused_runs += 1
        self._note(entry, fused_runs=1, fused_ms=entry.fused_ms)
        self.maybe_flush()

    # ------------------------------------------------------------------ failures

    def mark_failed(self, entry: KeyEntry, reason: str) -> None:
        entry.state, entry.reason = KeyState.FAILED, reason
        counters.fallback("compile_failed" if reason.startswith("compile_error") else
                          reason.split(":")[0])
        self._note(entry, state=entry.state.value, reason=reason)
        decide("failed", key=entry.digest, ops=entry.segment.describe()[:100], reason=reason)

    def demote(self, variant: Variant, reason: str) -> None:
        """Never replay ``variant`` again (its kernel raised, or verification failed)."""
        with self._lock:
            self.trie.remove(variant)
            self.kernels.pop(variant.entry.digest, None)
            self.mark_failed(variant.entry, reason[:500])

    # ------------------------------------------------------------------ persistence

    def _note(self, entry: KeyEntry, **fields) -> None:
        if self.disk is not None:
            self.disk.note(entry.digest, **fields)

    def maybe_flush(self) -> None:
        if self.disk is not None:
            self.disk.maybe_flush()

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        with self._lock:
            if self.disk is not None:
                self.disk.close()
            self._entries.clear()
            self.trie.clear()
            self.kernels.clear()
