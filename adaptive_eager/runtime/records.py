"""What the key table tells the disk cache, and what it recalls from it (cache/disk.py).

Every decision about a key is noted in its record (state, reason, timings, times seen), so
another process, or this program's next run, starts from it: a failure is a negative entry
(that key runs per-op for good, with its reason kept, counted and stored), and a compiled
key's artifact loads at first sight. Without a disk cache (``disk`` None) nothing is noted.
"""
from __future__ import annotations

from adaptive_eager.cache.disk import DiskCache
from adaptive_eager.cache.store import SegmentRecord
from adaptive_eager.runtime.compiler import current_compiler
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime.describe import key_parts, op_lines
from adaptive_eager.runtime.entries import KeyEntry, KeyState
from adaptive_eager.runtime.kernels import prepare_loading
from adaptive_eager.runtime.stats import counters


class Records:
    def __init__(self, disk: DiskCache | None) -> None:
        self.disk = disk
        # A warm start (artifacts on disk): keys load at first sight, so each new key looks up
        # its record at once. Else at its second sight (see recall).
        self.warm = disk is not None and disk.has_artifacts()

    def recall(self, entry: KeyEntry) -> None:
        """Apply what earlier processes stored about ``entry``. Not before it is needed
        (with an empty cache, at its second sight): a key seen once is never compiled, with
        ever-new shapes most keys are seen once, and the first lookup of a process opens the
        database, whose integrity check reads the whole file (~27 ms at 17 MB here)."""
        entry.recalled = True
        record = self.disk.lookup(entry.digest) if self.disk is not None else None
        if record is not None:
            self._apply_history(entry, record)

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
                prepare_loading(current_compiler())

    def mark_failed(self, entry: KeyEntry, reason: str) -> None:
        entry.state, entry.reason = KeyState.FAILED, reason
        counters.fallback("compile_failed" if reason.startswith("compile_error") else
                          reason.split(":")[0])
        self.note(entry, state=entry.state.value, reason=reason)
        decide("failed", key=entry.digest, ops=entry.segment.describe()[:100], reason=reason)

    def note_seen(self, entry: KeyEntry) -> None:
        fields = {"seen": entry.seen - entry.seen_noted}
        if entry.control_samples or not (entry.fused_samples or entry.artifact_path):
            # Beside a fused time (``cache ls`` shows their ratio), only plain eager runs
            # timed beside the kernel's (Note [Side by side]): per-op runs under the runtime
            # also pay for interception, and ran while the worker compiled; overwriting the
            # stored time with theirs made a kernel 0.9x as fast as eager read 5x.
            fields["eager_ms"] = entry.eager_ms
        if entry.state is KeyState.MEGAMORPHIC and not entry.seen_noted:
            # not noted when it turned megamorphic: a key seen once is worth no record
            fields.update(state=entry.state.value, reason=entry.reason)
        self.note(entry, **fields)
        entry.seen_noted = entry.seen

    def note(self, entry: KeyEntry, **fields) -> None:
        if self.disk is not None:
            if not self.disk.knows(entry.digest):
                segment = entry.segment
                self.disk.register(entry.digest, lambda: (op_lines(segment), key_parts(segment)),
                                   current_compiler().name)
            self.disk.note(entry.digest, **fields)

    def forget(self, entry: KeyEntry) -> None:
        """The table no longer tracks ``entry`` (what was decided about it stays on disk)."""
        if self.disk is not None and entry.named:    # else the disk never heard of it
            self.disk.forget(entry.digest)

    def maybe_flush(self) -> None:
        if self.disk is not None:
            self.disk.maybe_flush()

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()
