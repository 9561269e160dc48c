"""What the key table knows of one key (``KeyEntry``, in one of the ``KeyState``s) and of one op
structure across its shapes (``Structure``).

A ``KeyEntry`` is created at a key's first sighting (runtime/keys.py) and carries what the
policy reads: how often it was seen, its timings per-op and fused, what it banked towards its
compile (Note [When to compile], runtime/scheduling.py), and its verdict.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import statistics
from typing import Any

from adaptive_eager.cache.digest import stable_digest
from adaptive_eager.config import config
from adaptive_eager.dispatch import control
from adaptive_eager.dispatch.signature import without_shapes
from adaptive_eager.runtime import clock, native_plans, scheduling
from adaptive_eager.runtime.segment import Segment

MIN_COMPUTE_OPS = 2   # a single op gains nothing from fusion and pays the hot-path overhead
NATIVE_US_PER_OP = 2  # the per-op gate where the C++ hot path runs kernels
TIMING_SAMPLES = 8    # recent wall times kept per key and mode
CHURN_VARIANTS = 3    # new keys of a structure with this many shapes: see KeyEntry.churning
GENERIC_VARIANTS = 3  # shapes of one structure a generic kernel is derived from


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
                                           # what fusion can save (Note [Predicted
                                           # saving], runtime/scheduling.py)
    banked_s: float = 0.0              # savings its per-op runs would have had fused, while
                                       # it waits for its compile (Note [When to compile])
    eager_samples: list = dataclasses.field(default_factory=list)   # per-op run wall times
    fused_samples: list = dataclasses.field(default_factory=list)   # fused run wall times
    # plain eager runs timed beside them (Note [Side by side], runtime/profit.py)
    control_samples: list = dataclasses.field(default_factory=list)
    judged: bool = False               # profitability decided
    retimed: bool = False              # lost its first profit trial; timed once more
    structure: Any = None              # its Structure
    generic: bool = False              # runs its structure's generic kernel
    generic_refused: bool = False      # that kernel does not fit its shape
    recalled: bool = False             # its stored record looked up (Records.recall)
    first_seen: float = dataclasses.field(default_factory=lambda: clock.monotonic())
    last_seen: float = 0.0             # clock.monotonic() at its latest sighting
    first_point: int = dataclasses.field(default_factory=lambda: control.points_passed())
    last_point: int = 0                # control.points_passed() then, or at its kernel's
                                       # latest run: did it recur across steps (Note [When
                                       # to compile])? is its kernel's trial on?
    credited_at: float = 0.0           # its banked savings run up to here
    # Its runs seen after an earlier one with no pause begun in between, and the seconds
    # since that earlier one: its rate while watched (scheduling.runs_per_second), summed over
    # its watched stretches, however short; control.pauses_begun() at its latest sighting
    watched_runs: int = 0
    watched_s: float = 0.0
    stretch_pauses: int = -1
    came_back: bool = False            # seen again after a pause began: it recurs, as one
                                       # that crosses control points does (bare loops pass none)
    seen_noted: int = 0                # of ``seen``, how many the disk cache was told of
    cold_plan: int | None = None       # the C++ cold plan running it (Note [Cold plans])
    cold_refused: bool = False         # C++ cannot, or should not, run it cold
    forgotten: bool = False            # no longer among the key table's (KeyBook)
    renewed_at: int = 0                # ``seen`` when its recency was last renewed

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

    def promising(self, backend: str) -> bool:
        """Is fusion paying, or could it soon? (Nothing promising for long: the runtime
        pauses: Note [Pausing], runtime/pausing.py.) A key waiting for its compile is, once
        it came back after turning hot and until it is due: only its runs per-op bank the
        savings that start the compile (Note [When to compile]). (Keys made of per-step
        scalars turn hot within one step, two parameters of one shape, and never come back.)
        A key due or compiling is not: until its kernel lands, watching it gains nothing. Nor
        is one whose runs save less than watching them costs on ``backend`` (the interceptor's:
        "cpp" or "python"): it banks while the runtime pauses."""
        if self.state is KeyState.READY:
            return True
        if self.state is KeyState.WAITING:        # and it came back since it turned hot:
            return self.seen > config.HOT_THRESHOLD and not scheduling.is_due(self) \
                and scheduling.worth_watching(self, backend)
        # A key seen once is no evidence (dynamic shapes make new keys all the time).
        return self.state is KeyState.COLD and self.seen >= 2 \
            and self.segment.compute_ops >= MIN_COMPUTE_OPS and not self.too_cheap

    @property
    def too_cheap(self) -> bool:
        """Do its ops compute for less than MIN_SEGMENT_US + MIN_US_PER_OP per op (the least
        run so far)? Per-op timings include the call through the dispatch mode, and Python's
        hot path costs ~25-40 us per op (bench/overhead.py): a 7-op block of ever-new small
        shapes measured ~170 us here, above MIN_SEGMENT_US, yet no kernel of it could beat
        eager. The C++ hot path costs about a microsecond per op: there the per-op term is at
        most NATIVE_US_PER_OP."""
        per_op_us = config.MIN_US_PER_OP
        if native_plans.hot_path_available():     # Note [The C++ hot path]
            per_op_us = min(per_op_us, NATIVE_US_PER_OP)
        limit_us = config.MIN_SEGMENT_US + per_op_us * len(self.segment.ops)
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

    def sighted(self, runs: int) -> None:
        """``runs`` more runs seen now (KeyBook.sight, sight_again)."""
        now, pauses = clock.monotonic(), control.pauses_begun()
        if pauses == self.stretch_pauses and self.seen:   # watched since its last sighting
            self.watched_runs += runs
            self.watched_s += now - self.last_seen
        elif self.seen:
            self.came_back = True
        self.stretch_pauses = pauses
        self.seen += runs
        self.last_seen, self.last_point = now, control.points_passed()

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
    """What is known of one op structure across its shapes (Note [Megamorphic],
    runtime/keys.py; Note [Generic kernels], runtime/generic_kernels.py)."""
    variants: int = 0                  # keys (shapes) seen
    recent: list = dataclasses.field(default_factory=list)  # last GENERIC_VARIANTS segments
    generic: Any = None                # runtime.generic.GenericSegment, once compiled
    kernel: Any = None                 # its kernel: serves every shape it ``fits``
    generic_state: str = "none"        # none / compiling / ready / failed
    digest: str = ""                   # names its generic kernel in decisions
    waiting: list = dataclasses.field(default_factory=list)  # hot keys for the kernel
    key: tuple = ()                    # its key in KeyBook._structures

    def remember(self, segment: Segment) -> None:
        self.variants += 1
        self.recent = (self.recent + [segment])[-GENERIC_VARIANTS:]



def structure_of(segment: Segment) -> tuple:
    """The key without shapes and strides (Note [Megamorphic], runtime/keys.py)."""
    return (segment.context, tuple((op.func, without_shapes(op.args), without_shapes(op.kwargs))
                                   for op in segment.ops), segment.live_refs)
