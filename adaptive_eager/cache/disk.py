"""The runtime's side of the disk store: history of keys, artifacts, batched counters.

Nothing here may break the user's program: the first error that is not a damaged file (a
read-only directory, a full disk) switches persistence off for the process with one warning,
and the runtime goes on in memory.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import platform
import sqlite3
import sys
import threading
import time

from adaptive_eager.cache import trust
from adaptive_eager.cache.store import SegmentRecord, Store
from adaptive_eager.config import config

log = logging.getLogger("adaptive_eager")

FLUSH_INTERVAL_S = 5.0      # counters reach the disk at most this late (and at exit)
TRIM_EVERY_FLUSHES = 20     # how often the record count is checked against CACHE_MAX_ENTRIES
FORGOTTEN_BATCH = 64        # forgotten keys with unwritten changes that force a flush
_TIMINGS_AND_COUNTERS = {"seen", "fused_runs", "eager_ms", "fused_ms"}
# A verdict each process derives again from its own shape counts and never takes from disk:
# on its own it is no reason to write a row (a loop of ever-new shapes makes one per shape).
_REDERIVED_STATES = {"megamorphic"}


@functools.lru_cache(maxsize=4)
def build_fingerprint(compiler_name: str) -> str:
    """What generated code depends on besides the key: the compiler, machine, CPU features,
    Python and torch. An artifact built under another fingerprint is compiled again, never
    loaded."""
    import torch
    flags = ""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        pass
    parts = [compiler_name, torch.__version__, sys.version.split()[0], platform.machine(),
             flags, str(torch.version.cuda)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _guarded(default=None):
    """Run a store operation; on failure switch persistence off (once) and return default."""
    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            if self.store.disabled_reason is not None:
                return default
            try:
                return method(self, *args, **kwargs)
            except (sqlite3.Error, OSError) as err:
                self.store.disabled_reason = f"{type(err).__name__}: {err}"
                log.warning("kernel cache in %s is not usable (%s); going on without "
                            "persisting", self.store.directory, self.store.disabled_reason)
                return default
        return guarded
    return wrap


def _decided(fields: dict) -> bool:
    """Do ``fields`` carry a decision worth keeping (not only timings, counters or a
    re-derived verdict)?"""
    decisions = set(fields) - _TIMINGS_AND_COUNTERS
    if fields.get("state") in _REDERIVED_STATES:
        decisions -= {"state", "reason"}
    return bool(decisions)


class DiskCache:
    def __init__(self, directory: str) -> None:
        self.store = Store(directory)
        self._pending: dict[str, dict] = {}
        self._described: dict[str, tuple] = {}   # digest -> (describe, compiler name)
        self._bases: dict[str, dict] = {}         # digest -> rendered record fields
        self._forgotten: set[str] = set()       # descriptions to drop after the next flush
        self._flushes = 0
        self._last_flush = time.monotonic()
        # Two threads may run the runtime: one's note() must not land in the batch the
        # other's flush() is writing (lost counts), nor change it while it is read.
        self._lock = threading.RLock()
        self._distrust_told = False             # Note [Trusted cache]: one warning
        atexit.register(self.flush)

    def has_artifacts(self) -> bool:
        try:
            return any(name.endswith(".bin") for name in os.listdir(self.store.artifact_dir))
        except OSError:
            return False

    @_guarded()
    def lookup(self, digest: str) -> SegmentRecord | None:
        return self.store.get(digest)

    def loadable_artifact(self, record: SegmentRecord, compiler_name: str) -> str | None:
        """The record's artifact path, if it was built here-compatibly, is intact, and lies
        where nobody else could have written it (else the segment is compiled afresh)."""
        if record.fingerprint != build_fingerprint(compiler_name) or not record.artifact:
            return None
        path = self._read_artifact(record)
        return path if path is not None and self.trusted(path) else None

    def trusted(self, path: str) -> bool:
        """May compiled code at ``path`` be loaded? Note [Trusted cache]; warns once."""
        why = trust.why_untrusted(path, self.store.directory)
        if why is None:
            return True
        if not self._distrust_told:
            self._distrust_told = True
            log.warning("not loading compiled kernels from the cache in %s: %s. Segments are "
                        "compiled afresh; make the directory yours alone (chmod go-w), or set "
                        "NEURON_ADAPTIVE_EAGER_CACHE_SHARED=1 if it is shared on purpose",
                        self.store.directory, why)
        return False

    @_guarded()
    def _read_artifact(self, record: SegmentRecord) -> str | None:
        return self.store.read_artifact(record)

    def load_kernel(self, path: str, compiler):
        """A kernel from ``path``, or None if it does not load (or must not)."""
        if not self.trusted(path):
            return None
        try:
            return compiler.load(path)
        except Exception as err:  # a damaged or foreign artifact: compile instead
            log.warning("cache artifact %s did not load (%s: %s); compiling again", path,
                        type(err).__name__, err)
            return None

    @_guarded(default={})
    def save_kernel(self, digest: str, kernel, compiler) -> dict:
        """Persist a kernel; returns the record fields naming its artifact ({} if not saved,
        as where no process would load it)."""
        if trust.distrusted_dir(self.store.directory):
            return {}

        def write(path: str) -> bool:
            try:
                return compiler.save(kernel, path)
            except Exception as err:  # an unsaveable kernel is used, just not persisted
                log.info("kernel %s not persisted: %s: %s", digest, type(err).__name__, err)
                return False

        saved = self.store.save_artifact(digest, write)
        if saved is None:
            return {}
        name, size, checksum = saved
        return {"artifact": name, "artifact_bytes": size, "artifact_xxh": checksum}

    def register(self, digest: str, describe, compiler_name: str) -> None:
        """Know a key: ``describe()`` returns its (ops, parts), rendered only when its record
        is first written (most keys of dynamic code are seen once and never are)."""
        with self._lock:
            self._described[digest] = (describe, compiler_name)

    def knows(self, digest: str) -> bool:
        return digest in self._described

    def _base(self, digest: str) -> dict:
        """What every write of ``digest``'s record carries."""
        base = self._bases.get(digest)
        if base is None:
            describe, compiler_name = self._described[digest]
            ops, parts = describe()
            base = self._bases[digest] = {
                "digest": digest, "ops": ops, "parts": parts, "state": "cold",
                "torch_version": parts["context"]["torch_version"],
                "fingerprint": build_fingerprint(compiler_name)}
        return base

    def forget(self, digest: str) -> None:
        """The runtime no longer tracks ``digest``: drop what is kept of it once written."""
        with self._lock:
            pending = self._pending.get(digest)
            if pending is not None and self._worth_writing(digest, pending):
                self._forgotten.add(digest)
                if len(self._forgotten) >= FORGOTTEN_BATCH:    # bounded between flushes too
                    self.flush()
                return
            self._pending.pop(digest, None)
            self._drop(digest)

    def _drop(self, digest: str) -> None:
        self._described.pop(digest, None)
        self._bases.pop(digest, None)

    def note(self, digest: str, **fields) -> None:
        """Queue fields for a registered key's record; ``seen``/``fused_runs`` are deltas."""
        with self._lock:
            pending = self._pending.setdefault(digest, {"seen": 0, "fused_runs": 0})
            for counter in ("seen", "fused_runs"):
                pending[counter] += fields.pop(counter, 0)
            pending.update(fields)

    def _worth_writing(self, digest: str, fields: dict) -> bool:
        """A record is written once a key is seen twice or something was decided about it; a
        key seen once (ever-new shapes) costs no rendering and no row."""
        return bool(self._bases.get(digest)) or fields["seen"] >= 2 or fields["fused_runs"] \
            or _decided(fields)

    def maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        # The whole flush holds the lock, write included: two flushes writing at once could
        # land an older decision after a newer one. It runs every FLUSH_INTERVAL_S at most.
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        self._last_flush = time.monotonic()
        pending, self._pending = self._pending, {}
        updates = []
        for digest, fields in pending.items():
            if digest not in self._described:
                continue
            if self._worth_writing(digest, fields):
                updates.append({**self._base(digest), **fields})
            else:
                self._pending[digest] = fields       # until it is seen again, or forgotten
        for digest in self._forgotten:
            self._drop(digest)
        self._forgotten.clear()
        if updates:
            self._write(updates)
            self._flushes += 1
            if self._flushes % TRIM_EVERY_FLUSHES == 1:
                self._trim()

    @_guarded()
    def _trim(self) -> None:
        removed = self.store.trim(config.CACHE_MAX_ENTRIES)
        if removed:
            log.info("kernel cache: removed the %d least recently used records (more than "
                     "NEURON_ADAPTIVE_EAGER_CACHE_MAX_ENTRIES=%d)", removed,
                     config.CACHE_MAX_ENTRIES)

    @_guarded()
    def _write(self, updates: list[dict]) -> None:
        self.store.write(updates)

    def close(self) -> None:
        self.flush()
        atexit.unregister(self.flush)
        self.store.close()

    def disown(self) -> None:
        """A forked child's copy (Note [Fork] in runtime/engine.py): it must never write
        through, nor close, the parent's connection; not even at exit."""
        atexit.unregister(self.flush)
