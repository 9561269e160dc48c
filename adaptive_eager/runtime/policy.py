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
from collections import OrderedDict
import functools
import gc
import itertools
import math
import os
import shutil
import statistics
import threading
import time
from typing import Any

import cachetools

from adaptive_eager import faults
from adaptive_eager.cache.digest import stable_digest
from adaptive_eager.cache.disk import DiskCache
from adaptive_eager.cache.memory import KernelLRU
from adaptive_eager.cache.store import SegmentRecord
from adaptive_eager.config import config
from adaptive_eager.dispatch.signature import KEY_CONTEXT_FIELDS, without_shapes
from adaptive_eager.runtime.compiler import compile_segment, current_compiler
from adaptive_eager.runtime.worker import CompileRequest, CompileWorker, is_transfer_file
from adaptive_eager.runtime.decisions import decide, logged as decision_logged
from adaptive_eager.runtime.describe import key_parts, op_lines
from adaptive_eager.runtime.generic import fits, generalize
from adaptive_eager.runtime.generic import from_wire as from_generic_wire
from adaptive_eager.dispatch import control
from adaptive_eager.runtime import clock, scheduling
from adaptive_eager.runtime.scheduling import CompileQueue
from adaptive_eager.runtime.segment import Segment, to_wire
from adaptive_eager.runtime.stats import counters
from adaptive_eager.runtime.trie import KernelTrie, Variant

MIN_COMPUTE_OPS = 2   # a single op gains nothing from fusion and pays the hot-path overhead
PROFIT_SAMPLES = 3    # fused runs timed (after a first, warm-up run) before judging a kernel,
                      # each beside a plain eager run (Note [Side by side])
PROFIT_MARGIN = 0.10  # a kernel must beat per-op by this fraction to be kept
TIMING_SAMPLES = 8    # recent wall times kept per key and mode
CHURN_VARIANTS = 3    # new keys of a structure with this many shapes: see KeyEntry.churning
GENERIC_VARIANTS = 3  # shapes of one structure a generic kernel is derived from
# Note [Keys seen once]: a key is kept whole (its recorded ops, ~100-180 GC-tracked objects)
# while it is among the last SEEN_ONCE_KEPT keys seen just once; older ones shrink to a
# sighting (see KeyTable._shrink_seen_once).
SEEN_ONCE_KEPT = 64
NOT_LOADED = "compile_error: the worker's artifact did not load"


class KeyState(str, enum.Enum):
    COLD = "cold"              # seen fewer than HOT_THRESHOLD times (or its kernel was evicted)
    HOT = "hot"                # hot, but compilation is off (COMPILE=0)
    WAITING = "waiting"        # hot; its compile waits to break even (Note [When to compile],
                               # runtime/scheduling.py); runs per-op meanwhile
    COMPILING = "compiling"    # in the background worker; runs per-op meanwhile
    READY = "ready"            # has a kernel; the hot path replays it fused
    FAILED = "failed"          # compile, kernel or verification failed: per-op for good
    UNFUSIBLE = "unfusible"    # hot, but nothing worth fusing (e.g. a single op)
    DISABLED = "disabled"      # the user turned fusion off for this key (bisecting)
    UNPROFITABLE = "unprofitable"  # its kernel ran no faster than per-op: per-op for good
    MEGAMORPHIC = "megamorphic"    # its structure came in too many shapes to compile each


@dataclasses.dataclass(eq=False)
class KeyEntry:
    segment: Segment           # the first recording of this key
    state: KeyState = KeyState.COLD
    seen: int = 0
    fused_runs: int = 0
    compile_seconds: float = 0.0
    reason: str | None = None
    artifact_path: str | None = None   # an artifact to load when it turns hot (again)
    saved_artifact: str | None = None  # where this process saved its kernel
    compute_seconds: float = float("inf")  # least time inside the ops of one per-op run
                                           # (the first runs pay one-time costs)
    fusible_seconds: float = float("inf")  # of one run's, outside extern ops (matmuls...):
                                           # what fusion can save (Note [Predicted saving])
    banked_s: float = 0.0              # savings its per-op runs would have had fused, while
                                       # it waits for its compile (Note [When to compile])
    eager_samples: list = dataclasses.field(default_factory=list)   # per-op run wall times
    fused_samples: list = dataclasses.field(default_factory=list)   # fused run wall times
    control_samples: list = dataclasses.field(default_factory=list)  # plain eager runs beside
                                                                     # them (Note [Side by side])
    judged: bool = False               # profitability decided
    retimed: bool = False              # lost its first profit trial; timed once more
    structure: Any = None              # its Structure
    generic: bool = False              # runs its structure's generic kernel
    generic_refused: bool = False      # that kernel does not fit its shape
    recalled: bool = False             # its stored record looked up (KeyTable._recall)
    first_seen: float = dataclasses.field(default_factory=lambda: clock.monotonic())
    last_seen: float = 0.0             # clock.monotonic() at its latest sighting
    first_point: int = dataclasses.field(default_factory=lambda: control.points_passed())
    last_point: int = 0                # control.points_passed() then: did it recur across
                                       # steps (Note [When to compile])?
    credited_at: float = 0.0           # its banked savings run up to here
    seen_noted: int = 0                # of ``seen``, how many the disk cache was told of

    @functools.cached_property
    def digest(self) -> str:
        """Its stable name (~0.1 ms to compute): only once a record, decision or lookup needs
        it. Most keys of ever-new shapes are seen once and never do."""
        return stable_digest(self.segment.key)

    @property
    def named(self) -> bool:
        """Was its digest computed (so the disk cache may hold something of it)?"""
        return "digest" in vars(self)          # where functools.cached_property keeps it

    @property
    def eager_ms(self) -> float | None:
        """Median time of a per-op run: of plain eager runs timed beside its kernel's (Note
        [Side by side]) once there are some, else of per-op runs under the runtime (which
        also pay for interception), recent runs."""
        samples = self.control_samples or self.eager_samples
        return statistics.median(samples) * 1e3 if samples else None

    @property
    def fused_ms(self) -> float | None:
        """Median wall time of a fused run (deferral and kernel), recent runs after the
        first (which pays one-time costs)."""
        timed = self.fused_samples[1:] or self.fused_samples
        return statistics.median(timed) * 1e3 if timed else None

    @property
    def promising(self) -> bool:
        """Is fusion paying, or could it soon? (Nothing promising for long: the runtime
        pauses, Note [Pausing].) A key waiting for its compile is, once it came back after
        turning hot and until it is due: only its runs per-op bank the savings that start the
        compile (Note [When to compile]). (Keys made of per-step scalars turn hot within one
        step, two parameters of one shape, and never come back.) A key due or compiling is
        not: until its kernel lands, watching it gains nothing. Nor is one whose runs save
        less than watching them costs: it banks while the runtime pauses."""
        if self.state is KeyState.READY:
            return True
        if self.state is KeyState.WAITING:        # and it came back since it turned hot:
            return self.seen > config.HOT_THRESHOLD and not scheduling.is_due(self) \
                and scheduling.worth_watching(self)
        # A key seen once is no evidence (dynamic shapes make new keys all the time).
        return self.state is KeyState.COLD and self.seen >= 2 \
            and self.segment.compute_ops >= MIN_COMPUTE_OPS and not self.too_cheap

    @property
    def too_cheap(self) -> bool:
        """Do its ops compute for less than MIN_SEGMENT_US + MIN_US_PER_OP per op (the least
        run so far)? Per-op timings include the call through the dispatch mode, and the hot
        path costs ~40 us per op (bench/overhead.py): a 7-op block of ever-new small shapes
        measured ~170 us here, above MIN_SEGMENT_US, yet no kernel of it could beat eager."""
        limit_us = config.MIN_SEGMENT_US + config.MIN_US_PER_OP * len(self.segment.ops)
        return self.compute_seconds * 1e6 < limit_us

    @property
    def hopeless(self) -> bool:
        """Was it judged never to be fused (in this process)?"""
        return self.state in (KeyState.UNFUSIBLE, KeyState.FAILED, KeyState.UNPROFITABLE,
                              KeyState.MEGAMORPHIC)

    @property
    def churning(self) -> bool:
        """A new key of a structure already seen in several shapes: shapes keep changing."""
        return self.seen == 1 and self.structure is not None \
            and self.structure.variants >= CHURN_VARIANTS

    def add_sample(self, samples: list, seconds: float) -> None:
        samples.append(seconds)
        if len(samples) > TIMING_SAMPLES:
            del samples[1:2]               # keep the first (warm-up) and the latest

    def _run_saving_s(self) -> float | None:
        """(per-op time - fused time) of one run, in seconds; None until both are timed.
        Each median is taken once: this runs at every fused run (Runtime._watch_kernel)."""
        eager_ms, fused_ms = self.eager_ms, self.fused_ms
        if eager_ms is None or fused_ms is None:
            return None
        return (eager_ms - fused_ms) / 1e3

    @property
    def saving_s(self) -> float | None:
        """Seconds one fused run saves against plain eager (negative: it costs), once the
        kernel is judged side by side; None before."""
        return self._run_saving_s() if self.judged else None

    @property
    def saved_seconds(self) -> float:
        """Time fusion saved so far: (per-op time - fused time) x fused runs."""
        return (self._run_saving_s() or 0.0) * self.fused_runs


@dataclasses.dataclass(eq=False)
class Structure:
    """What is known of one op structure across its shapes (Note [Megamorphic], Note
    [Generic kernels])."""
    variants: int = 0                  # keys (shapes) seen
    recent: list = dataclasses.field(default_factory=list)  # last GENERIC_VARIANTS segments
    generic: Any = None                # runtime.generic.GenericSegment, once compiled
    kernel: Any = None                 # its kernel: serves every shape it ``fits``
    generic_state: str = "none"        # none / compiling / ready / failed
    digest: str = ""                   # names its generic kernel in decisions
    waiting: list = dataclasses.field(default_factory=list)  # hot keys for the kernel
    key: tuple = ()                    # its key in KeyTable._structures

    def remember(self, segment: Segment) -> None:
        self.variants += 1
        self.recent = (self.recent + [segment])[-GENERIC_VARIANTS:]


def _grad_enabled(segment: Segment, op) -> bool:
    """Was ``segment`` recorded with autograd on (its key context says)?"""
    return segment.context[KEY_CONTEXT_FIELDS.index("grad_enabled")]


# Ops whose Inductor kernels compile but fail when run (torch 2.13): a segment holding one
# would cost a compile (10 s here) only to run per-op for good (kernel_error). Each maps to
# the calls that fail, given (segment, op).
def _accumulates_one_index_on_cpu(segment: Segment, op) -> bool:
    """An ``index_put(..., accumulate=True)`` on the CPU whose index tensors hold one element
    (the gradient of ``t[..., [i], :]``)."""
    accumulate = op.args[3] if len(op.args) > 3 else dict(op.kwargs).get("accumulate")
    meta = op.out_metas[0] if op.out_metas else None
    indices = [index for index in op.args[1] if index is not None] if len(op.args) > 1 else []
    return getattr(accumulate, "value", False) is True and meta is not None \
        and meta.device.type == "cpu" and bool(indices) \
        and all(math.prod(getattr(index, "shape", (0,))) == 1 for index in indices)


_KERNELS_FAIL = {
    # LSTM on CPU with autograd on (train or eval mode): "expected Tensor() for op:
    # aten.mkldnn_rnn_layer" at run time. Under no_grad it compiles and runs.
    "aten::mkldnn_rnn_layer": _grad_enabled,
    # Note [Accumulating index_put on the CPU]: an Inductor bug (torch 2.13, C++ backend).
    # Falcon's backward (the gradient of its fused-QKV split, ``qkv[..., [-2], :]``) holds
    # index_put(zeros, [None, None, i], values, accumulate=True) with one-element ``i`` and
    # ``values`` read through a transposed layout. Inductor's kernel then runs a 2-D tiled
    # loop whose atomic add stores at ``48*x1 + 96*x1_inner`` where ``48*(x1 + x1_inner)``
    # is due (96: the stride of the values' size-1 dim): wrong sums, and writes past the
    # output, which corrupted the heap (Falcon crashed with SIGSEGV or SIGABRT before
    # probation could judge the kernel). The stand-in compiler runs the same segments as
    # eager; in a small segment probation catches the wrong sums (kernel_mismatch 8.2).
    # Without the runtime (tests/runtime/test_policy.py runs it, in a child process):
    #     def f(x, y, i):
    #         v = (x * y).transpose(1, 2)                          # (2, 12, 1, 8)
    #         return aten.index_put(v.new_zeros(2, 12, 6, 8), [None, None, i], v, True)
    #     x, y = torch.randn(2, 1, 8, 12).transpose(2, 3), torch.randn(1, 1, 12, 8)
    #     torch.compile(f)(x, y, torch.tensor([-1]))    # max abs error 8.2 against f(...)
    # Two-element index tensors, values read in their own layout, or accumulate=False compile
    # right; whether a segment's loop is tiled is Inductor's choice, so every CPU segment with
    # a one-element accumulating index_put stays per-op.
    "aten::index_put": _accumulates_one_index_on_cpu,
}


def _kernel_would_fail(segment: Segment) -> bool:
    for op in segment.ops:
        fails = _KERNELS_FAIL.get(op.func.name())
        if fails is not None and fails(segment, op):
            return True
    return False


def unfusible_reason(segment: Segment, entry: KeyEntry) -> str | None:
    if segment.compute_ops < MIN_COMPUTE_OPS:
        return "too_few_ops"
    if _kernel_would_fail(segment):
        return "compiler_unsupported"
    if entry.too_cheap:
        return "too_cheap"                 # see MIN_SEGMENT_US and MIN_US_PER_OP (config)
    if scheduling.extern_bound(entry):
        return "extern_bound"              # matmuls take its time (Note [Predicted saving])
    if any(_overlaps_itself(segment.out_meta(ref)) for ref in segment.live_refs):
        return "overlapping_output"        # a kernel cannot write one memory cell twice
    return None


_frozen_at: set[str] = set()     # the moments this process froze the GC at (Note [GC stalls])
_user_froze = False              # the program had frozen objects itself: never unfreeze them


def freeze_gc(moment: str) -> None:
    """Note [GC stalls]: a full collection walks every tracked object: ~165k after importing
    torch (~90 ms here), ~377k once Inductor is imported (~200 ms stalls; docs/design.md,
    "Process-wide concerns"). The
    recording path allocates far more objects per op than eager does, so it triggers full
    collections eager would not; freezing what exists at ``moment`` ("enable": torch's own
    objects; "inductor": after the first kernel arrives) takes them out of collections. Each
    moment freezes once: objects frozen are still freed when unreferenced, only cycles among
    them wait for ``unfreeze_gc`` (disable())."""
    global _user_froze
    if moment in _frozen_at:
        return
    if not _frozen_at and gc.get_freeze_count():
        _user_froze = True
    _frozen_at.add(moment)
    gc.freeze()


def unfreeze_gc() -> None:
    global _user_froze
    if _frozen_at:
        _frozen_at.clear()
        if not _user_froze:          # theirs and ours cannot be told apart: keep both frozen
            gc.unfreeze()
        _user_froze = False


_preparing: threading.Thread | None = None


def _prepare_loading(compiler) -> None:
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


def structure_of(segment: Segment) -> tuple:
    """The key without shapes and strides (see Note [Megamorphic])."""
    return (segment.context, tuple((op.func, without_shapes(op.args), without_shapes(op.kwargs))
                                   for op in segment.ops), segment.live_refs)


def _bounded_put(table: OrderedDict, key, value) -> None:
    """``table[key] = value``, dropping the oldest past MAX_KEYS."""
    table[key] = value
    if len(table) > config.MAX_KEYS:
        table.popitem(last=False)


def _make_megamorphic(entry: KeyEntry) -> None:
    entry.state = KeyState.MEGAMORPHIC
    entry.reason = f"more than {config.MAX_SHAPE_VARIANTS} shape variants"


def _overlaps_itself(meta) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(meta.shape, meta.stride))


class KeyTable:
    def __init__(self, trie: KernelTrie, disk: DiskCache | None = None,
                 memory_size: int | None = None) -> None:
        self.trie = trie
        self.disk = disk
        self.kernels = KernelLRU(memory_size or config.CACHE_SIZE, self._evicted)
        self._entries: OrderedDict[tuple, KeyEntry] = OrderedDict()   # least recently seen 1st
        # structure -> shape variants seen; an LRU so ever-new structures stay bounded
        self._structures = cachetools.LRUCache(maxsize=config.MAX_KEYS)
        # Note [Keys seen once]: keys of _entries seen once, oldest first; and what is left of
        # older ones, by hash(key)
        self._seen_once: OrderedDict[tuple, None] = OrderedDict()
        # (first_seen, megamorphic): a plain tuple of atoms, which the GC stops tracking (a
        # NamedTuple it would track for good)
        self._sightings: OrderedDict[int, tuple[float, bool]] = OrderedDict()
        # hash(structure key) -> shapes it was seen in, for structures dropped with their one
        # key: the count goes on when another shape comes (Note [Megamorphic])
        self._structure_counts: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.RLock()
        self.worker: CompileWorker | None = None
        # request id -> KeyEntry, or (Structure, example segment) for a generic kernel
        self._compiling: dict[int, Any] = {}
        self._queue = CompileQueue()     # hot keys waiting to compile (Note [When to compile])
        self.compiles_answered = 0        # worker results handled (kernels or failures)
        self._next_request = 0
        # A warm start (artifacts on disk): keys load at first sight, so each new key looks up
        # its record at once. Else at its second sight (see _recall).
        self._warm = disk is not None and disk.has_artifacts()

    def entries(self) -> list[KeyEntry]:
        with self._lock:
            return list(self._entries.values())

    # ------------------------------------------------------------------ observing

    def observe(self, segment: Segment, seconds: float = 0.0,
                compute_seconds: float = 0.0, extern_seconds: float = 0.0) -> KeyEntry:
        """Count one per-op run of ``segment``: ``seconds`` of wall time, ``compute_seconds``
        of it inside the ops, ``extern_seconds`` of that inside extern ops (matmuls...). Gets
        the key a kernel when it turns hot (and has paid for its compile)."""
        counters.add("segments_recorded")
        with self._lock:
            entry = self._entries.get(segment.key)
            if entry is None:
                entry = self._entries[segment.key] = self._new_entry(segment)
                self._forget_least_recent()
            else:
                self._entries.move_to_end(segment.key)
            entry.seen += 1
            entry.last_seen, entry.last_point = clock.monotonic(), control.points_passed()
            if entry.seen == 2:
                self._seen_once.pop(segment.key, None)
            if not entry.recalled and (entry.seen >= 2 or config.HOT_THRESHOLD <= 1):
                self._recall(entry)
            entry.compute_seconds = min(entry.compute_seconds, compute_seconds)
            entry.fusible_seconds = min(entry.fusible_seconds, compute_seconds - extern_seconds)
            entry.add_sample(entry.eager_samples, seconds)
            threshold = 1 if entry.artifact_path else config.HOT_THRESHOLD
            if entry.structure.kernel is not None and \
                    entry.state in (KeyState.COLD, KeyState.MEGAMORPHIC):
                self._serve_generically(entry)
            elif entry.state is KeyState.COLD and entry.seen >= threshold:
                self._turn_hot(entry)
            elif entry.state is KeyState.WAITING:
                self._queue.bank(entry)
                self.start_due_compiles()
            if entry.seen >= 2 or entry.state not in (KeyState.COLD, KeyState.MEGAMORPHIC):
                self._note_seen(entry)               # a record is due
            if entry.seen == 1 and len(self._seen_once) > SEEN_ONCE_KEPT:
                self._shrink_seen_once()
        self.maybe_flush()
        return entry

    def _forget_least_recent(self) -> None:
        """Keep at most MAX_KEYS entries: forget the least recently seen that hold no kernel
        of their own and are not compiling (what was decided about them stays on disk), never
        the newest. A shape served by a generic kernel is forgotten with its place in the
        trie; it is served again after its next per-op run."""
        excess = len(self._entries) - config.MAX_KEYS
        if excess <= 0:
            return
        older = itertools.islice(self._entries.items(), len(self._entries) - 1)
        forgettable = list(itertools.islice(
            (key for key, entry in older
             if entry.generic or entry.state not in (KeyState.READY, KeyState.COMPILING)),
            excess))
        for key in forgettable:
            entry = self._entries.pop(key)
            self._queue.discard(entry)       # waiting, but not seen for MAX_KEYS keys
            variant = self.kernels.get(entry.digest) if entry.generic else None
            if variant is not None:
                self._drop_kernel(variant)
            if self.disk is not None and entry.named:    # else the disk never heard of it
                self.disk.forget(entry.digest)
        counters.add("keys_forgotten", len(forgettable))

    def _new_entry(self, segment: Segment) -> KeyEntry:
        sighting = self._sightings.pop(hash(segment.key), None) if self._sightings else None
        if sighting is not None:
            return self._entry_seen_before(segment, sighting)
        counters.add("keys_seen")
        entry = KeyEntry(segment)
        if self._warm:
            self._recall(entry)
        self._count_shape_variant(entry)
        self._seen_once[segment.key] = None
        return entry

    # Note [Keys seen once]
    # Most keys of a long dynamic program are seen once: a new shape each step, or float
    # scalars that change every step (AdamW's bias corrections make a new key for the tail of
    # every foreach step). Keeping each whole up to MAX_KEYS kept ~1M GC-tracked objects after
    # 4,000 AdamW steps, and full collections of them stalled the program for 0.2-0.5 s, longer
    # as it ran. A second sight records the segment again, so nothing of the first recording is
    # needed then but when it was first seen (and whether it was a megamorphic shape, so that
    # its structure's count and its state do not change): past SEEN_ONCE_KEPT keys seen once,
    # the oldest shrinks to that, under hash(key). Two keys with the same hash (2^-64 a pair)
    # cost at most a compile: the second is taken for the first one seen again, turns hot a
    # sight early, and is compiled from its own recording.

    def _shrink_seen_once(self) -> None:
        key, _ = self._seen_once.popitem(last=False)
        entry = self._entries.get(key)
        if entry is None or entry.seen != 1 or entry.generic or entry.artifact_path \
                or entry.state not in (KeyState.COLD, KeyState.MEGAMORPHIC):
            return                         # forgotten already, or more than a key seen once
        del self._entries[key]
        _bounded_put(self._sightings, hash(key),
                     (entry.first_seen, entry.state is KeyState.MEGAMORPHIC))
        structure = entry.structure
        if structure.variants == 1 and structure.generic_state == "none":
            # it came in no other shape (yet): keep only its count, not its recording
            self._structures.pop(structure.key, None)
            _bounded_put(self._structure_counts, hash(structure.key), structure.variants)
        if self.disk is not None and entry.named:
            self.disk.forget(entry.digest)

    def _entry_seen_before(self, segment: Segment, sighting: tuple[float, bool]) -> KeyEntry:
        """The entry of a key shrunk to ``sighting``, seen again: it counts as seen once
        before; its structure counts it as the shape it already was."""
        first_seen, megamorphic = sighting
        entry = KeyEntry(segment, seen=1, first_seen=first_seen)
        if megamorphic:
            _make_megamorphic(entry)
        entry.structure = self._structure(structure_of(segment))
        if not entry.structure.variants:        # forgotten with its count: count it again
            entry.structure.remember(segment)
        return entry

    def _structure(self, key: tuple) -> Structure:
        """The Structure of ``key``; a dropped one comes back with its count."""
        structure = self._structures.get(key)
        if structure is None:
            counted = self._structure_counts.pop(hash(key), 0) if self._structure_counts else 0
            structure = self._structures[key] = Structure(variants=counted, key=key)
        return structure

    def _recall(self, entry: KeyEntry) -> None:
        """Apply what earlier processes stored about ``entry``. Not before it is needed
        (with an empty cache, at its second sight): a key seen once is never compiled, with
        ever-new shapes most keys are seen once, and the first lookup of a process opens the
        database, whose integrity check reads the whole file (~27 ms at 17 MB here)."""
        entry.recalled = True
        record = self.disk.lookup(entry.digest) if self.disk is not None else None
        if record is not None:
            self._apply_history(entry, record)

    def _count_shape_variant(self, entry: KeyEntry) -> None:
        """Note [Megamorphic]: keys that differ only in shapes and strides share a structure.
        Past MAX_SHAPE_VARIANTS of one structure, new ones are not compiled, which bounds the
        compiles of a loop over ever-new shapes."""
        structure = self._structure(structure_of(entry.segment))
        structure.remember(entry.segment)
        entry.structure = structure
        variants = structure.variants
        if variants > config.MAX_SHAPE_VARIANTS and entry.state is KeyState.COLD:
            _make_megamorphic(entry)
            counters.fallback("megamorphic")
            if decision_logged("megamorphic"):   # else no name: most are seen once (~0.1 ms)
                decide("megamorphic", key=entry.digest, variants=variants)

    def _apply_history(self, entry: KeyEntry, record: SegmentRecord) -> None:
        """What an earlier process learned about this key (one that has no kernel yet)."""
        if entry.state not in (KeyState.COLD, KeyState.MEGAMORPHIC):
            return
        if record.state in (KeyState.FAILED.value, KeyState.DISABLED.value,
                            KeyState.UNPROFITABLE.value):
            entry.state, entry.reason = KeyState(record.state), record.reason
        elif record.state == KeyState.READY.value:
            entry.artifact_path = self.disk.loadable_artifact(record, current_compiler().name)
            if entry.artifact_path:       # a load will come: get Inductor ready for it
                _prepare_loading(current_compiler())

    def _turn_hot(self, entry: KeyEntry) -> None:
        counters.add("hot_keys")
        decide("hot", key=entry.digest, ops=len(entry.segment.ops), seen=entry.seen)
        reason = unfusible_reason(entry.segment, entry)
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
        elif not self._load(entry) and not self._wait_to_compile(entry):
            self._start_compile(entry)
            return
        self._note(entry, state=entry.state.value, reason=entry.reason)

    def _start_compile(self, entry: KeyEntry) -> None:
        if self._compile_generically(entry):
            self._note(entry, state=entry.state.value, reason=entry.reason)
        else:
            self._compile(entry)

    # ------------------------------------------------------------------ when to compile

    def _wait_to_compile(self, entry: KeyEntry) -> bool:
        """Note [When to compile] (runtime/scheduling.py): a background compile waits until
        the key's per-op runs have banked COMPILE_COST_MS of predicted savings, and starts
        when no other compile is in flight; the key runs per-op meanwhile. Synchronous
        compiles (ASYNC=0: tests, debugging) never wait."""
        if not (config.ASYNC and self.disk is not None):
            return False
        entry.state = KeyState.WAITING
        for dropped in self._queue.add(entry):
            dropped.state = KeyState.COLD         # turns hot again if it comes back
        if not scheduling.is_due(entry):
            decide("compile_waits", key=entry.digest, banked_ms=round(entry.banked_s * 1e3, 3))
        self.start_due_compiles()
        return True

    @property
    def compiles_waiting(self) -> int:
        return len(self._queue)

    def bank_while_paused(self) -> None:
        """Note [When to compile]: at a control point of a paused program, credit each
        waiting key that recurs across steps with what its runs since its last credit would
        have saved (at the rate it was seen running), and start what is due."""
        if not self._queue:
            return
        with self._lock:
            self._queue.bank_elapsed(clock.monotonic())
        self.start_due_compiles()

    @property
    def compiles_due(self) -> int:
        """Waiting compiles that paid for themselves: they start as the worker frees up."""
        return self._queue.due_count()

    def start_due_compiles(self, everything: bool = False) -> None:
        """Start the due compile that banked the most, if none is in flight (every waiting
        one: ``everything``, for ``sync(wait_compiles=...)``). Cheap when none waits: called
        at every segment end."""
        if not self._queue or (self._compiling and not everything):
            return
        with self._lock:
            while everything or not self._compiling:
                entry = self._queue.pop_next(everything)
                if entry is None:
                    return
                if entry.state is KeyState.WAITING:
                    self._start_compile(entry)

    # ------------------------------------------------------------------ kernels

    def _load(self, entry: KeyEntry) -> bool:
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
        self._install(entry, kernel)
        decide("loaded", key=entry.digest, ops=len(entry.segment.ops), seconds=seconds)
        return True

    def _compile(self, entry: KeyEntry) -> None:
        compiler = current_compiler()
        if config.ASYNC and self.disk is not None:
            self._submit(entry, compiler)
            return
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

    # ------------------------------------------------------------------ background

    def _submit(self, entry: KeyEntry, compiler) -> None:
        """Hand ``entry`` to the compile worker; it runs per-op until the kernel arrives."""
        segment = entry.segment
        metas = segment.input_metas + tuple(segment.out_meta(ref) for ref in segment.live_refs)
        entry.state = KeyState.COMPILING
        self._send(entry, compiler, entry.digest, to_wire(segment), metas)
        decide("compiling", key=entry.digest, ops=len(segment.ops))

    def _send(self, target, compiler, digest: str, segment: tuple, metas: tuple,
              variants: tuple = ()) -> None:
        """A compile request for ``target`` (a KeyEntry, or a Structure's generic kernel)."""
        import torch
        if self.worker is None:
            self.worker = CompileWorker(self.disk.store.directory, config.COMPILE_TIMEOUT_S)
            _prepare_loading(compiler)
        self._next_request += 1
        request = CompileRequest(self._next_request, digest, segment, metas,
                                 (type(compiler).__module__, type(compiler).__qualname__),
                                 torch.get_num_threads(), variants)
        self._compiling[request.request_id] = target
        self.worker.submit(request)

    def poll_compiles(self, wait_s: float = 0.0) -> None:
        """Start the waiting compiles that are due (all of them when ``wait_s``: the caller
        wants kernels now) and swap in the kernels the worker finished (at a segment
        boundary: never mid-run)."""
        self.start_due_compiles(everything=wait_s > 0)
        self._collect_compiles(wait_s)

    def _collect_compiles(self, wait_s: float = 0.0) -> None:
        if self.worker is None or not self._compiling:
            return
        results = self.worker.wait(wait_s) if wait_s else self.worker.poll()
        for result in results:
            with self._lock:
                target = self._compiling.pop(result.request_id, None)
                if isinstance(target, tuple):             # (Structure, example)
                    self._finish_generic(target, result)
                elif target is not None:
                    self._finish_background(target, result)
                if target is not None:
                    self.compiles_answered += 1
        if results:
            self.start_due_compiles()

    @property
    def compiles_in_flight(self) -> int:
        return len(self._compiling)

    def release_kernels(self) -> None:
        """Unload every kernel; their keys turn hot again at first sight and load them."""
        with self._lock:
            while self.kernels:
                self.kernels.popitem()    # KernelLRU.popitem takes it out of the trie too

    def stop_idle_worker(self) -> None:
        self._collect_compiles()
        with self._lock:
            if self.worker is not None and not self._compiling:
                self.worker.close()
                self.worker = None

    def _finish_background(self, entry: KeyEntry, result) -> None:
        if not result.ok:
            counters.add("compile_failures")
            self.mark_failed(entry, result.error)
            return
        path, size, checksum = result.artifact
        persisted = not is_transfer_file(path)
        kernel = self._load_shipped(path)
        if kernel is None:
            counters.add("compile_failures")
            self.mark_failed(entry, NOT_LOADED)
            return
        entry.compile_seconds = result.seconds
        counters.add("compiles")
        counters.add("compile_seconds", result.seconds)
        self._install(entry, kernel)
        artifact = {}
        if persisted:
            entry.saved_artifact = path
            artifact = {"artifact": os.path.basename(path), "artifact_bytes": size,
                        "artifact_xxh": checksum}
        self._note(entry, state=entry.state.value, reason=None, compile_seconds=result.seconds,
                   **artifact)
        self.flush()
        decide("compiled", key=entry.digest, ops=len(entry.segment.ops),
               seconds=result.seconds, compiler="worker")

    def _load_shipped(self, path: str):
        """The kernel the worker shipped at ``path`` (None if it does not load); a temporary
        directory it came through is removed once loaded."""
        _wait_for_preparation()
        kernel = self.disk.load_kernel(path, current_compiler())
        if is_transfer_file(path):
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        return kernel

    # ------------------------------------------------------------------ generic kernels

    def _compile_generically(self, entry: KeyEntry) -> bool:
        """Note [Generic kernels]: a key turning hot whose structure keeps coming in other
        shapes (variable batch or sequence length) gets, with all its shapes, one kernel
        compiled for sizes that vary (runtime.generic), rather than one kernel per shape.
        True when it waits for that kernel, or got it; False: compile it on its own."""
        structure = entry.structure
        if structure.generic_state == "failed" or len(structure.recent) < GENERIC_VARIANTS:
            return False
        if structure.generic_state == "none":
            self._start_generic(structure)
        if structure.generic_state == "ready":
            return self._serve_generically(entry)
        if structure.generic_state == "failed":
            return False
        entry.state = KeyState.COMPILING
        structure.waiting.append(entry)
        decide("compiling", key=entry.digest, ops=len(entry.segment.ops), generic=True)
        return True

    def _start_generic(self, structure: Structure) -> None:
        variants = list(structure.recent)
        example = variants[0]
        structure.generic_state = "compiling"
        structure.digest = "generic-" + stable_digest(structure_of(example))
        compiler = current_compiler()
        if config.ASYNC and self.disk is not None:
            self._send((structure, example), compiler, structure.digest, to_wire(example), (),
                       tuple(to_wire(v) for v in variants))
            return
        started = time.perf_counter()
        try:
            faults.check_compile()
            kernel, generic = compiler.compile_generic(generalize(variants, symbolic=False))
        except Exception as err:  # NotGeneric, or the compiler's error: compile per shape
            self._generic_failed(structure, f"{type(err).__name__}: {err}"[:500])
            return
        self._generic_ready(structure, generic, kernel, time.perf_counter() - started)

    def _finish_generic(self, job: tuple, result) -> None:
        structure, example = job
        if not result.ok:
            self._generic_failed(structure, result.error)
            return
        kernel = self._load_shipped(result.artifact[0])      # always a transfer file
        if kernel is None:
            self._generic_failed(structure, NOT_LOADED)
            return
        self._generic_ready(structure, from_generic_wire(example, result.generic), kernel,
                            result.seconds)

    def _generic_ready(self, structure: Structure, generic, kernel, seconds: float) -> None:
        structure.generic, structure.kernel = generic, kernel
        structure.generic_state = "ready"
        counters.add("compiles")
        counters.add("generic_kernels")
        counters.add("compile_seconds", seconds)
        decide("compiled", key=structure.digest, ops=len(generic.example.ops),
               symbols=len(generic.symbols), seconds=seconds)
        waiting, structure.waiting = structure.waiting, []
        for entry in waiting:
            if entry.state is KeyState.COMPILING and not self._serve_generically(entry):
                self._compile(entry)

    def _generic_failed(self, structure: Structure, reason: str) -> None:
        structure.generic_state, structure.kernel = "failed", None
        counters.fallback("not_generic")
        if not reason.startswith(("compile_error: NotGeneric", "NotGeneric")):
            counters.add("compile_failures")
        decide("not_generic", key=structure.digest, reason=reason)
        waiting, structure.waiting = structure.waiting, []
        for entry in waiting:
            if entry.state is KeyState.COMPILING:
                self._compile(entry)

    def _serve_generically(self, entry: KeyEntry) -> bool:
        """Give ``entry`` its structure's generic kernel, if that serves its shape."""
        structure = entry.structure
        if entry.generic_refused or not fits(structure.generic, entry.segment):
            entry.generic_refused = True
            return False
        entry.reason, entry.generic = None, True
        self._install(entry, structure.kernel)
        counters.add("generic_instances")
        decide("generic_kernel", key=entry.digest, ops=len(entry.segment.ops))
        return True

    def _install(self, entry: KeyEntry, kernel) -> None:
        kernel = faults.damaged_kernel(kernel)
        freeze_gc("inductor")
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
        with self._lock:                  # another thread's install may be evicting
            self.kernels.get(variant.entry.digest)
            counters.add("cache_hits_memory")
            entry = variant.entry
            entry.fused_runs += 1
            entry.add_sample(entry.fused_samples, seconds)
            self._note(entry, fused_runs=1, fused_ms=entry.fused_ms)
            self._judge_when_timed(variant)
        self.maybe_flush()

    # Note [Side by side]: a kernel's runs are compared with plain eager runs of the same
    # segment at the same moment, not with the per-op runs seen before it was compiled: those
    # came seconds earlier, when the machine may have been more or less busy (a shared machine
    # here varies by 2x within a minute). A wide MLP's forward+backward kernel was kept in one
    # run that way (fused ~37 ms against ~46 ms of per-op time before the compile) and dropped
    # in another (46.7 against 46.3); side by side it was dropped in 10 runs of 11 (e.g.
    # fused 37.8-42.4 ms against eager 38.0-42.7 in four of them). While a kernel is on trial,
    # its runs alternate with runs of the deferred segment per-op (the ops' own time, as a
    # paused program would spend it), PROFIT_SAMPLES of each after the warm-up run. Per-op
    # runs give eager's results exactly, and the trial costs nothing against eager.

    def wants_eager_run(self, variant: Variant) -> bool:
        """Should this deferred run of ``variant`` go per-op, timed beside its kernel's?"""
        entry = variant.entry
        if entry.judged or config.KEEP_UNPROFITABLE or variant.on_probation:
            return False
        timed_fused = len(entry.fused_samples) - 1            # after the warm-up run
        return len(entry.control_samples) < PROFIT_SAMPLES and \
            len(entry.control_samples) <= timed_fused

    def touch_eager(self, variant: Variant, seconds: float) -> None:
        """A per-op run of ``variant``'s segment on trial took ``seconds`` inside its ops."""
        with self._lock:
            variant.entry.add_sample(variant.entry.control_samples, seconds)
            self._judge_when_timed(variant)

    def _judge_when_timed(self, variant: Variant) -> None:
        entry = variant.entry
        if not entry.judged and not config.KEEP_UNPROFITABLE and \
                len(entry.fused_samples) > PROFIT_SAMPLES and \
                len(entry.control_samples) >= PROFIT_SAMPLES:
            self._judge(variant)

    def _judge(self, variant: Variant) -> None:
        """Keep a kernel only if its runs beat plain eager's beside them by PROFIT_MARGIN.

        A kernel that loses is timed once more (PROFIT_SAMPLES new pairs of runs) before it
        is dropped: the verdict is for good, and other processes read it from the disk
        cache."""
        entry = variant.entry
        entry.judged = True
        eager_ms = entry.eager_ms
        if eager_ms is None or entry.fused_ms <= eager_ms * (1 - PROFIT_MARGIN):
            return
        if not entry.retimed:
            decide("profit_retimed", key=entry.digest, fused_ms=round(entry.fused_ms, 3),
                   eager_ms=round(eager_ms, 3))
            entry.retimed, entry.judged = True, False
            del entry.fused_samples[1:]                # keep the warm-up run's, time anew
            entry.control_samples.clear()
            return
        with self._lock:
            self._drop_kernel(variant)
            entry.state = KeyState.UNPROFITABLE
            entry.reason = f"fused {entry.fused_ms:.3f} ms vs eager {eager_ms:.3f} ms"
        counters.fallback("unprofitable")
        decide("unprofitable", key=entry.digest, fused_ms=round(entry.fused_ms, 3),
               eager_ms=round(eager_ms, 3))
        self._note(entry, state=entry.state.value, reason=entry.reason, eager_ms=eager_ms)

    # ------------------------------------------------------------------ failures

    def mark_failed(self, entry: KeyEntry, reason: str) -> None:
        entry.state, entry.reason = KeyState.FAILED, reason
        counters.fallback("compile_failed" if reason.startswith("compile_error") else
                          reason.split(":")[0])
        self._note(entry, state=entry.state.value, reason=reason)
        decide("failed", key=entry.digest, ops=entry.segment.describe()[:100], reason=reason)

    def demote(self, variant: Variant, reason: str) -> None:
        """Never replay ``variant`` again (its kernel raised, or verification failed); for a
        generic kernel, no new shape gets it either (those that have it are checked at their
        first run, as every new kernel is)."""
        with self._lock:
            self._drop_kernel(variant)
            self.mark_failed(variant.entry, reason[:500])
            if variant.entry.generic:
                structure = variant.entry.structure
                structure.generic_state, structure.kernel = "failed", None

    def _drop_kernel(self, variant: Variant) -> None:
        """Out of the trie the hot path walks and out of memory (the store keeps its record)."""
        self.trie.remove(variant)
        self.kernels.pop(variant.entry.digest, None)

    # ------------------------------------------------------------------ persistence

    def _note_seen(self, entry: KeyEntry) -> None:
        fields = {"seen": entry.seen - entry.seen_noted, "eager_ms": entry.eager_ms}
        if entry.state is KeyState.MEGAMORPHIC and not entry.seen_noted:
            # not noted when it turned megamorphic: a key seen once is worth no record
            fields.update(state=entry.state.value, reason=entry.reason)
        self._note(entry, **fields)
        entry.seen_noted = entry.seen

    def _note(self, entry: KeyEntry, **fields) -> None:
        if self.disk is not None:
            if not self.disk.knows(entry.digest):
                segment = entry.segment
                self.disk.register(entry.digest, lambda: (op_lines(segment), key_parts(segment)),
                                   current_compiler().name)
            self.disk.note(entry.digest, **fields)

    def maybe_flush(self) -> None:
        if self.disk is not None:
            self.disk.maybe_flush()

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def disown(self) -> None:
        """Note [Fork] (runtime/engine.py): this table was copied into a forked child. Its
        worker and database connection are the parent's: the child's exit must not close
        them (nor write through the connection), so their exit hooks go."""
        for held in (self.disk, self.worker):
            if held is not None:
                held.disown()

    def close(self) -> None:
        with self._lock:
            if self.worker is not None:
                self.worker.close()
            if self.disk is not None:
                self.disk.close()
            self._queue.clear()
            self._entries.clear()
            self._structures.clear()
            self._seen_once.clear()
            self._sightings.clear()
            self._structure_counts.clear()
            self.trie.clear()
            self.kernels.clear()
