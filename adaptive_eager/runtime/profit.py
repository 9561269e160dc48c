"""The profit trial: a new kernel is kept only if it beats plain eager, timed side by side.

Every fused run is counted and timed here (``fused_run``). Until its kernel is judged, a
key's deferred runs alternate between its kernel and per-op (Note [Side by side]), and after
PROFIT_SAMPLES of each the kernel is kept or dropped as unprofitable.
"""
from __future__ import annotations

import threading
from typing import Callable

from adaptive_eager.config import config
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime.entries import KeyState
from adaptive_eager.runtime.kernels import LoadedKernels
from adaptive_eager.runtime.records import Records
from adaptive_eager.runtime.stats import counters
from adaptive_eager.runtime.trie import Variant

PROFIT_SAMPLES = 3    # fused runs timed (after a first, warm-up run) before judging a kernel,
                      # each beside a plain eager run (Note [Side by side])
PROFIT_MARGIN = 0.10  # a kernel must beat per-op by this fraction to be kept


class ProfitTrial:
    def __init__(self, lock: threading.RLock, loaded: LoadedKernels, records: Records,
                 compiling: Callable[[], bool] = lambda: False) -> None:
        self._lock = lock                 # the key table's
        self._loaded = loaded
        self._records = records
        self._compiling = compiling       # Note [Trials without a compile beside]

    def fused_run(self, variant: Variant, seconds: float | None, runs: int = 1) -> None:
        """``runs`` fused runs of ``variant``, the last of which took ``seconds`` (None: not
        timed): count them, keep its kernel recently used."""
        with self._lock:                  # another thread's install may be evicting
            self._loaded.lru.get(variant.entry.digest)
            counters.add("cache_hits_memory", runs)
            entry = variant.entry
            entry.fused_runs += runs
            if seconds is not None and (entry.judged or not self._compiling()):
                entry.add_sample(entry.fused_samples, seconds)
            fused_ms = entry.fused_ms             # None where no run was timed (verify mode)
            self._records.note(entry, fused_runs=runs,
                               **({} if fused_ms is None else {"fused_ms": fused_ms}))
            self._judge_when_timed(variant)
        self._records.maybe_flush()

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
    #
    # Note [Like for like]: a fused run's time is its wall time from its first op deferred to
    # its kernel's end: deferring its ops, the kernel, and the program's own code between the
    # ops (Python's, in a model's forward). A per-op run beside it is timed as its ops' time
    # plus that same program time (the run's wait, less what deferring its ops cost:
    # scheduling.program_seconds), since an eager run spends it too. Timed as its ops' time
    # alone, a small Llama's decode segments (~0.2 ms of ops among ~0.3 ms of Python) each
    # looked ~2x slower fused and were all dropped.
    #
    # Note [Trials without a compile beside]: side by side is not enough while the worker
    # compiles another key. The worker takes a core from the program; a fused run (often
    # OpenMP over every core) and a per-op run suffer from it differently, and the kernel then
    # runs in steady state with no compile beside it. On a 2-layer transformer step a trial
    # timed that way claimed ~157 ms saved a step where ~11 ms was real, and the set of kept
    # kernels differed from run to run. So while a compile is in flight a kernel on trial runs
    # fused and untimed (no per-op runs, no samples); its trial goes on once the worker is idle.

    def wants_eager_run(self, variant: Variant) -> bool:
        """Should this deferred run of ``variant`` go per-op, timed beside its kernel's?"""
        entry = variant.entry
        if entry.judged or config.KEEP_UNPROFITABLE or variant.on_probation or \
                self._compiling():
            return False
        timed_fused = len(entry.fused_samples) - 1            # after the warm-up run
        return len(entry.control_samples) < PROFIT_SAMPLES and \
            len(entry.control_samples) <= timed_fused

    def eager_run(self, variant: Variant, seconds: float) -> None:
        """A per-op run of ``variant``'s segment on trial took ``seconds`` (its ops', and the
        program's between them: Note [Like for like])."""
        with self._lock:
            variant.entry.add_sample(variant.entry.control_samples, seconds)
            self._judge_when_timed(variant)

    def _judge_when_timed(self, variant: Variant) -> None:
        entry = variant.entry
        if not entry.judged and not config.KEEP_UNPROFITABLE and \
                len(entry.fused_samples) > PROFIT_SAMPLES and \
                len(entry.control_samples) >= PROFIT_SAMPLES:
            self.judge(variant)

    def judge(self, variant: Variant) -> None:
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
            self._loaded.drop(variant)
            entry.state = KeyState.UNPROFITABLE
            entry.reason = f"fused {entry.fused_ms:.3f} ms vs eager {eager_ms:.3f} ms"
        counters.fallback("unprofitable")
        decide("unprofitable", key=entry.digest, fused_ms=round(entry.fused_ms, 3),
               eager_ms=round(eager_ms, 3))
        self._records.note(entry, state=entry.state.value, reason=entry.reason, eager_ms=eager_ms)

