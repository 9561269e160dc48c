"""Which segments get compiled: counting keys, deciding hot, remembering decisions.

Every finished cold segment is ``observe``d. A key seen ``HOT_THRESHOLD`` times becomes hot and,
unless compilation is off or the segment has nothing to fuse, gets a kernel: loaded from the
disk store when an earlier process compiled it (such keys turn hot at first sight), compiled
otherwise. Kernels go into the trie the hot path walks and into the in-memory LRU. A failure
is a negative entry: that key runs per-op for good, with its reason kept, counted and stored.

``KeyTable`` is the face the runtime (runtime/engine.py) sees; each concept behind it has its
own module:

    entries.py          KeyEntry (one key, its state and timings), Structure
    keys.py             KeyBook: the keys known, forgetting, Notes [Keys seen once], [Megamorphic]
    fusible.py          why a hot segment gets no kernel at all (unfusible_reason)
    compiles.py         Compiles: when a compile starts, the compile worker's protocol
    generic_kernels.py  GenericKernels: one kernel for every shape (Note [Generic kernels])
    kernels.py          LoadedKernels: the trie and LRU of kernels in memory, loading them
    profit.py           ProfitTrial: kernels kept only if faster (Note [Side by side])
    records.py          Records: what the disk cache is told, and recalls
    gc_freeze.py        freezing the GC (Note [GC stalls])
"""
from __future__ import annotations

import threading

from adaptive_eager.cache.disk import DiskCache
from adaptive_eager.config import config
from adaptive_eager.dispatch import control
from adaptive_eager.runtime.compiles import Compiles
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime.entries import KeyEntry, KeyState
from adaptive_eager.runtime.fusible import unfusible_reason
from adaptive_eager.runtime.generic_kernels import GenericKernels
from adaptive_eager.runtime.kernels import LoadedKernels
from adaptive_eager.runtime.keys import KeyBook
from adaptive_eager.runtime.profit import ProfitTrial
from adaptive_eager.runtime.records import Records
from adaptive_eager.runtime.segment import Segment
from adaptive_eager.runtime.stats import counters
from adaptive_eager.runtime import native_plans
from adaptive_eager.runtime.trie import KernelTrie, Variant

TRIAL_IDLE_POINTS = 8      # control points (2-4 a training step) without a kernel's key: no
                           # longer on trial (KeyTable.kernels_on_trial)


class KeyTable:
    """The process-wide key table: one lock over the parts below, shared by every runtime."""

    def __init__(self, trie: KernelTrie, disk: DiskCache | None = None,
                 memory_size: int | None = None) -> None:
        self._lock = threading.RLock()
        self.disk = disk
        self.records = Records(disk)
        self.loaded = LoadedKernels(trie, disk, memory_size)
        self.trie, self.kernels = trie, self.loaded.lru   # the hot path's trie, its kernels' LRU
        self.compiles = Compiles(self._lock, disk, self.loaded, self.records,
                                 start=self._start_waiting)
        self.generic = GenericKernels(self.loaded, self.compiles)
        self.profit = ProfitTrial(self._lock, self.loaded, self.records,
                                  compiling=lambda: self.compiles.in_flight > 0)
        self.keys = KeyBook(self.records, release=self._release)

    def entries(self) -> list[KeyEntry]:
        with self._lock:
            return self.keys.entries()

    # ------------------------------------------------------------------ observing

    def observe(self, segment: Segment, seconds: float = 0.0,
                compute_seconds: float = 0.0, extern_seconds: float = 0.0) -> KeyEntry:
        """Count one per-op run of ``segment``: ``seconds`` of wall time, ``compute_seconds``
        of it inside the ops, ``extern_seconds`` of that inside extern ops (matmuls...). Gets
        the key a kernel when it turns hot (and has paid for its compile)."""
        counters.add("segments_recorded")
        with self._lock:
            entry = self.keys.sight(segment)
            self._count_runs(entry, 1, seconds, compute_seconds,
                             compute_seconds - extern_seconds)
            self.keys.shrink_seen_once(entry)
        self.records.maybe_flush()
        return entry

    def observe_runs(self, entry: KeyEntry, runs: int, seconds: float,
                     compute_seconds: float, fusible_seconds: float) -> bool:
        """``runs`` per-op runs of a known ``entry`` that C++ ran and counted (Note [Cold
        plans] in csrc/plans.cpp): ``seconds`` of wall time in all; the least time of one
        inside its ops, and outside extern ops. False: the key was forgotten meanwhile."""
        with self._lock:
            if not self.keys.sight_again(entry, runs):
                return False
            self._count_runs(entry, runs, seconds / runs, compute_seconds, fusible_seconds)
        self.records.maybe_flush()
        return True

    def _count_runs(self, entry: KeyEntry, runs: int, seconds: float,
                    compute_seconds: float, fusible_seconds: float) -> None:
        """``entry`` was just seen ``runs`` more times (``seconds`` of wall time each):
        the decisions that follow."""
        entry.compute_seconds = min(entry.compute_seconds, compute_seconds)
        entry.fusible_seconds = min(entry.fusible_seconds, fusible_seconds)
        entry.add_sample(entry.eager_samples, seconds)
        threshold = 1 if entry.artifact_path else config.HOT_THRESHOLD
        if entry.structure.kernel is not None and \
                entry.state in (KeyState.COLD, KeyState.MEGAMORPHIC):
            self.generic.serve(entry)
        elif entry.state is KeyState.COLD and entry.seen >= threshold:
            self._turn_hot(entry)
        elif entry.state is KeyState.WAITING:
            self.compiles.bank(entry, runs)
        if entry.seen >= 2 or entry.state not in (KeyState.COLD, KeyState.MEGAMORPHIC):
            self.records.note_seen(entry)        # a record is due

    def _turn_hot(self, entry: KeyEntry) -> None:
        counters.add("hot_keys")
        decide("hot", key=entry.digest, ops=len(entry.segment.ops), seen=entry.seen)
        reason = unfusible_reason(entry.segment, entry)
        if reason is not None:
            self._mark_unfusible(entry, reason)
        elif entry.digest.startswith(config.DISABLE_KEYS or ("\0",)):
            entry.state, entry.reason = KeyState.DISABLED, "NEURON_ADAPTIVE_EAGER_DISABLE_KEYS"
            counters.fallback("disabled_key")
            decide("disabled", key=entry.digest, by=entry.reason)
            return                         # a setting of this run, not a stored decision
        elif not config.COMPILE:
            entry.state, entry.reason = KeyState.HOT, "compile_disabled"
            counters.fallback("compile_disabled")
            decide("compile_disabled", key=entry.digest)
        elif not self.loaded.load(entry) and not self.compiles.wait(entry):
            self._start_compile(entry)
            return
        self.records.note(entry, state=entry.state.value, reason=entry.reason)

    def _mark_unfusible(self, entry: KeyEntry, reason: str) -> None:
        entry.state, entry.reason = KeyState.UNFUSIBLE, reason
        counters.fallback(reason)
        decide("unfusible", key=entry.digest, reason=reason)

    def _start_waiting(self, entry: KeyEntry) -> None:
        """A key that waited to bank its cost was judged when it turned hot, on its first runs,
        whose times include a program's warm-up (the first calls of its ops); the runs since
        may show it too cheap (or matmul-bound) after all."""
        reason = unfusible_reason(entry.segment, entry)
        if reason is not None:
            self._mark_unfusible(entry, reason)
            self.records.note(entry, state=entry.state.value, reason=entry.reason)
            return
        self._start_compile(entry)

    def _start_compile(self, entry: KeyEntry) -> None:
        if self.generic.compile_generically(entry):
            self.records.note(entry, state=entry.state.value, reason=entry.reason)
        else:
            self.compiles.compile(entry)

    def _release(self, entry: KeyEntry) -> None:
        """``entry`` is forgotten: out of the compile queue, and a shape served by a generic
        kernel out of the trie (it is served again after its next per-op run)."""
        self.compiles.discard(entry)       # waiting, but not seen for MAX_KEYS keys
        native_plans.unwatch(entry)
        variant = self.kernels.get(entry.digest) if entry.generic else None
        if variant is not None:
            self.loaded.drop(variant)

    # ------------------------------------------------------------------ kernels

    def touch(self, variant: Variant, seconds: float | None, runs: int = 1) -> None:
        """``runs`` fused runs of ``variant``, the last took ``seconds`` (ProfitTrial.fused_run)."""
        variant.entry.last_point = control.points_passed()   # (kernels_on_trial)
        self.profit.fused_run(variant, seconds, runs)

    def wants_eager_run(self, variant: Variant) -> bool:
        return self.profit.wants_eager_run(variant)

    def touch_eager(self, variant: Variant, seconds: float) -> None:
        """A per-op run of ``variant``'s segment on trial (ProfitTrial.eager_run)."""
        variant.entry.last_point = control.points_passed()
        self.profit.eager_run(variant, seconds)

    def mark_failed(self, entry: KeyEntry, reason: str) -> None:
        self.records.mark_failed(entry, reason)

    def demote(self, variant: Variant, reason: str) -> None:
        """Never replay ``variant`` again (its kernel raised, or verification failed); for a
        generic kernel, no new shape gets it either (those that have it are checked at their
        first run, as every new kernel is)."""
        with self._lock:
            self.loaded.drop(variant)
            self.records.mark_failed(variant.entry, reason[:500])
            if variant.entry.generic:
                structure = variant.entry.structure
                structure.generic_state, structure.kernel = "failed", None

    def release_kernels(self) -> None:
        """Unload every kernel; their keys turn hot again at first sight and load them."""
        with self._lock:
            self.loaded.release_all()

    # ------------------------------------------------------------------ compiles

    def poll_compiles(self, wait_s: float = 0.0) -> None:
        self.compiles.poll(wait_s)

    def bank_while_paused(self) -> None:
        self.compiles.bank_while_paused()

    def stop_idle_worker(self) -> None:
        self.compiles.stop_idle_worker()

    @property
    def compiles_in_flight(self) -> int:
        return self.compiles.in_flight

    @property
    def compiles_waiting(self) -> int:
        return self.compiles.waiting

    @property
    def compiles_due(self) -> int:
        return self.compiles.due

    @property
    def compiles_answered(self) -> int:
        return self.compiles.answered

    @property
    def kernels_on_trial(self) -> bool:
        """Does a loaded kernel still wait for its verdict (Note [Side by side]) while its key
        comes? Its runs alternate with per-op ones and its first pays one-time costs. One
        whose key has not come for TRIAL_IDLE_POINTS control points is on no trial: a pause
        that ended elsewhere in a step shifts where segments are cut, and the keys of a
        kernel compiled before may not come again. Counted, one such kernel held off the
        step judge for good (Gemma's training step intercepted at ~1.4x eager's time)."""
        if config.KEEP_UNPROFITABLE:                   # no trials
            return False
        recent = control.points_passed() - TRIAL_IDLE_POINTS
        with self._lock:
            return any(not variant.entry.judged and variant.entry.last_point >= recent
                       for variant in self.kernels.values())

    @property
    def worker(self):
        return self.compiles.worker

    # ------------------------------------------------------------------ lifetime

    def flush(self) -> None:
        native_plans.touch_pending(self)     # runs of the C++ hot path not counted yet
        self.records.flush()

    def disown(self) -> None:
        """Note [Fork] (runtime/engine.py): this table was copied into a forked child. Its
        worker and database connection are the parent's: the child's exit must not close
        them (nor write through the connection), so their exit hooks go."""
        if self.disk is not None:
            self.disk.disown()
        self.compiles.disown()

    def close(self) -> None:
        native_plans.touch_pending(self)
        with self._lock:
            self.compiles.close()
            if self.disk is not None:
                self.disk.close()
            self.keys.clear()
            self.loaded.clear()
