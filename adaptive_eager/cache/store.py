"""The on-disk store: one SQLite table of segment records, compiled artifacts beside it.

Layout of ``NEURON_ADAPTIVE_EAGER_CACHE_DIR``::

    segments.sqlite            records, table ``segments_v{FORMAT_VERSION}`` (WAL mode); the
                               format is also its ``user_version``
    artifacts/v{N}/<digest>.bin   Inductor artifacts (CompiledArtifact.save, binary format)
    inductor/                  Inductor's cache for our compiles and loads only, so loads
                               are fast (Note [Our Inductor cache] in cache/inductor_dir.py)

Safe for several processes at once: WAL journaling, a busy timeout, counters written as
deltas, artifacts written to a temporary file and renamed into place. A database that is not
a database, fails SQLite's quick check, or has another format, is set aside (renamed
``*.corrupt-<time>``) and rebuilt; an artifact whose checksum does not match is removed. Each
is reported once; the program never sees an exception from here: a store that cannot be
written is switched off.

This module does not import torch: the CLI reads the store without it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sqlite3
import threading
import time
from typing import Callable, Iterator

import xxhash

from adaptive_eager import faults
from adaptive_eager.cache import trust

log = logging.getLogger("adaptive_eager")

FORMAT_VERSION = 1
TABLE = f"segments_v{FORMAT_VERSION}"
DB_NAME = "segments.sqlite"
BUSY_TIMEOUT_S = 30.0
STALE_TEMPORARY_S = 3600.0   # a temporary artifact this old belongs to no live writer

_COLUMNS = (
    ("digest", "TEXT PRIMARY KEY"),
    ("ops", "TEXT NOT NULL"),            # JSON list of "aten.op(shapes)" strings
    ("parts", "TEXT NOT NULL"),          # JSON object: the named parts of the key
    ("state", "TEXT NOT NULL"),
    ("seen", "INTEGER NOT NULL DEFAULT 0"),
    ("fused_runs", "INTEGER NOT NULL DEFAULT 0"),
    ("compile_seconds", "REAL NOT NULL DEFAULT 0"),
    ("eager_ms", "REAL"),
    ("fused_ms", "REAL"),
    ("reason", "TEXT"),
    ("torch_version", "TEXT NOT NULL"),
    ("fingerprint", "TEXT NOT NULL"),    # machine + software that generated code depends on
    ("artifact", "TEXT"),                # file name under artifacts/v{N}/
    ("artifact_bytes", "INTEGER"),
    ("artifact_xxh", "TEXT"),
    ("created", "REAL NOT NULL"),
    ("last_used", "REAL NOT NULL"),
)
_NAMES = tuple(name for name, _ in _COLUMNS)


class CacheError(Exception):
    """A cache request that cannot be served; the message says why (the CLI prints it)."""


@dataclasses.dataclass(frozen=True)
class SegmentRecord:
    digest: str
    ops: tuple
    parts: dict
    state: str
    seen: int
    fused_runs: int
    compile_seconds: float
    eager_ms: float | None
    fused_ms: float | None
    reason: str | None
    torch_version: str
    fingerprint: str
    artifact: str | None
    artifact_bytes: int | None
    artifact_xxh: str | None
    created: float
    last_used: float

    @classmethod
    def from_row(cls, row: tuple) -> "SegmentRecord":
        values = dict(zip(_NAMES, row))
        values["ops"] = tuple(json.loads(values["ops"]))
        values["parts"] = json.loads(values["parts"])
        return cls(**values)

    def as_dict(self) -> dict:
        result = dataclasses.asdict(self)
        result["ops"] = list(self.ops)
        return result


def file_digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class Store:
    """The records and artifacts of one cache directory."""

    def __init__(self, directory: str) -> None:
        self.directory = os.path.abspath(os.path.expanduser(directory))
        self.db_path = os.path.join(self.directory, DB_NAME)
        self._artifact_subdir = f"artifacts/v{FORMAT_VERSION}"
        self.artifact_dir = os.path.join(self.directory, *self._artifact_subdir.split("/"))
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.RLock()
        self.disabled_reason: str | None = None
        self.set_aside: list[str] = []          # corrupt files moved away, for reports

    # ------------------------------------------------------------------ connection

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None and not os.path.exists(self.db_path):
            # The directory was removed under us (`rm -rf`, `cache clear` by hand): SQLite
            # would go on writing into the unlinked file and lose it all. Start a new one.
            log.warning("cache database %s disappeared; recreating it", self.db_path)
            self._conn.close()
            self._conn = None
        if self._conn is None:
            self._make_dirs()
            try:
                self._conn = self._open_checked()
            except sqlite3.DatabaseError as err:
                self._set_aside_database(str(err))
                self._conn = self._open_checked()
        return self._conn

    def _make_dirs(self) -> None:
        """The directory and its artifact directory, private (Note [Trusted cache])."""
        trust.make_dirs(self.directory, self._artifact_subdir)

    def _open_checked(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.db_path, timeout=BUSY_TIMEOUT_S, check_same_thread=False,
                               isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            status = conn.execute("PRAGMA quick_check").fetchone()[0]
            if status != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {status}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, FORMAT_VERSION):
                raise sqlite3.DatabaseError(f"written in format {version}; this is format "
                                            f"{FORMAT_VERSION}")
            columns = ", ".join(f"{name} {kind}" for name, kind in _COLUMNS)
            conn.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} ({columns})")
            found = tuple(row[1] for row in conn.execute(f"PRAGMA table_info({TABLE})"))
            if found != _NAMES:
                raise sqlite3.DatabaseError(f"table {TABLE} has other columns: {found}")
            if version == 0:
                conn.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
            return conn
        except BaseException:
            conn.close()
            raise

    def _set_aside_database(self, why: str) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for suffix in ("", "-wal", "-shm"):
            path = self.db_path + suffix
            if os.path.exists(path):
                target = f"{path}.corrupt-{stamp}"
                os.replace(path, target)
                self.set_aside.append(target)
        log.warning("cache database %s was unreadable (%s); set aside and rebuilt",
                    self.db_path, why)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            conn = self._connect()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _query(self, sql: str, params: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._connect().execute(sql, params).fetchall()

    # ------------------------------------------------------------------ records

    def get(self, digest: str) -> SegmentRecord | None:
        if self._conn is None and not os.path.exists(self.db_path):
            return None        # an empty cache: no need to create (and check) the database
        rows = self._query(f"SELECT {', '.join(_NAMES)} FROM {TABLE} WHERE digest = ?",
                           (digest,))
        return SegmentRecord.from_row(rows[0]) if rows else None

    def records(self) -> list[SegmentRecord]:
        rows = self._query(f"SELECT {', '.join(_NAMES)} FROM {TABLE}")
        return [SegmentRecord.from_row(row) for row in rows]

    def write(self, updates: list[dict]) -> None:
        """Insert or update records; ``seen``/``fused_runs`` in an update are deltas, added to
        what other processes wrote meanwhile."""
        if not updates:
            return
        now = time.time()
        faults.check_disk_write(self.directory)
        with self._transaction() as conn:
            for update in updates:
                self._upsert(conn, update, now)

    def _upsert(self, conn: sqlite3.Connection, update: dict, now: float) -> None:
        row = {"seen": 0, "fused_runs": 0, "created": now, "last_used": now, **update}
        row["ops"] = json.dumps(list(row["ops"]))
        row["parts"] = json.dumps(row["parts"], default=str)
        names = [name for name in _NAMES if name in row]
        assignments = ["seen = seen + excluded.seen",
                       "fused_runs = fused_runs + excluded.fused_runs",
                       "last_used = excluded.last_used"]
        # A process that merely saw a key ("cold") must not undo another's decision.
        assignments.append(f"state = CASE WHEN excluded.state = 'cold' THEN {TABLE}.state "
                           "ELSE excluded.state END")
        assignments += [f"{name} = excluded.{name}" for name in names
                        if name not in ("digest", "seen", "fused_runs", "created", "last_used",
                                        "ops", "parts", "state")]
        conn.execute(
            f"INSERT INTO {TABLE} ({', '.join(names)}) VALUES ({', '.join('?' for _ in names)}) "
            f"ON CONFLICT(digest) DO UPDATE SET {', '.join(assignments)}",
            tuple(row[name] for name in names))

    def resolve(self, prefix: str) -> str:
        """The one digest starting with ``prefix``; CacheError when none or several do."""
        if not prefix or not all(c in "0123456789abcdef" for c in prefix.lower()):
            raise CacheError(f"{prefix!r} is not a key: keys are hexadecimal digests")
        rows = self._query(f"SELECT digest FROM {TABLE} WHERE digest LIKE ? LIMIT 6",
                           (prefix.lower() + "%",))
        if not rows:
            raise CacheError(f"no segment key starts with {prefix!r} in {self.directory}")
        if len(rows) > 1:
            shown = ", ".join(row[0] for row in rows[:5])
            raise CacheError(f"{prefix!r} is ambiguous: it starts {shown}"
                             f"{', ...' if len(rows) > 5 else ''}")
        return rows[0][0]

    def set_state(self, digest: str, state: str, reason: str | None) -> None:
        """Set a record's state outright (the CLI's disable/enable), whatever it was."""
        with self._transaction() as conn:
            conn.execute(f"UPDATE {TABLE} SET state = ?, reason = ? WHERE digest = ?",
                         (state, reason, digest))

    def delete(self, digests: list[str]) -> int:
        with self._transaction() as conn:
            for digest in digests:
                conn.execute(f"DELETE FROM {TABLE} WHERE digest = ?", (digest,))
        self.remove_artifacts(*digests)
        return len(digests)

    def trim(self, max_records: int) -> int:
        """Remove the least recently used records beyond ``max_records`` (and their
        artifacts); returns how many."""
        count = self._query(f"SELECT COUNT(*) FROM {TABLE}")[0][0]
        if count <= max_records:
            return 0
        rows = self._query(f"SELECT digest FROM {TABLE} ORDER BY last_used LIMIT ?",
                           (count - max_records,))
        return self.delete([row[0] for row in rows])

    # ------------------------------------------------------------------ artifacts

    def artifact_file(self, name: str) -> str:
        return os.path.join(self.artifact_dir, name)

    def save_artifact(self, digest: str, write: Callable[[str], bool]) -> tuple | None:
        """Have ``write(path)`` produce the artifact, then move it into place atomically.

        The file is named by digest *and* content checksum, so two processes saving the same
        segment at once never leave a record pointing at the other's bytes. Returns
        (file name, size, checksum), or None when ``write`` declined."""
        faults.check_disk_write(self.directory)
        self._make_dirs()                                # also after a `rm -rf` mid-run
        temporary = self.artifact_file(f"{digest}.tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            if not write(temporary):
                return None
            with open(temporary, "rb") as handle:
                data = handle.read()
            os.chmod(temporary, trust.ARTIFACT_MODE)     # not the umask's: Note [Trusted cache]
            checksum = file_digest(data)
            name = f"{digest}-{checksum}.bin"
            os.replace(temporary, self.artifact_file(name))
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
        return name, len(data), checksum

    def read_artifact(self, record: SegmentRecord) -> str | None:
        """Path of the record's artifact if it is intact; a damaged one is removed."""
        if not record.artifact:
            return None
        path = self.artifact_file(record.artifact)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError:
            return None
        if len(data) != record.artifact_bytes or file_digest(data) != record.artifact_xxh:
            log.warning("cache artifact %s is damaged (size or checksum); removed, the "
                        "segment will be compiled again", path)
            self.remove_artifacts(record.digest)
            return None
        return path

    def forget_artifact(self, digest: str) -> None:
        """Drop a record's artifact: the segment goes back to cold and compiles again."""
        with self._transaction() as conn:
            conn.execute(f"UPDATE {TABLE} SET artifact = NULL, artifact_bytes = NULL, "
                         f"artifact_xxh = NULL, state = 'cold' WHERE digest = ?", (digest,))
        self.remove_artifacts(digest)

    def remove_artifacts(self, *digests: str) -> None:
        """Remove every saved artifact of these digests (not files still being written)."""
        wanted = set(digests)
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.artifact_dir):
                if name.endswith(".bin") and name.split("-", 1)[0] in wanted:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(self.artifact_file(name))

    # ------------------------------------------------------------------ maintenance

    def _older_than(self, name: str, seconds: float) -> bool:
        try:
            return time.time() - os.path.getmtime(self.artifact_file(name)) > seconds
        except OSError:
            return False

    def disk_bytes(self) -> int:
        total = 0
        for root, _, files in os.walk(self.directory):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(root, name))
        return total

    def verify(self) -> dict:
        """Check the database and every artifact; returns what was found (and set aside)."""
        problems = []
        records = self.records()             # opening checks (and rebuilds) the database
        problems += [f"database set aside: {path}" for path in self.set_aside]
        for record in records:
            if record.artifact and self.read_artifact(record) is None:
                problems.append(f"{record.digest}: artifact missing or damaged (removed)")
                self.forget_artifact(record.digest)
        known = {record.artifact for record in records if record.artifact}
        for name in sorted(os.listdir(self.artifact_dir)):
            if ".tmp-" in name:                # being written now, or left by a killed writer
                if self._older_than(name, STALE_TEMPORARY_S):
                    problems.append(f"{name}: stale temporary file (removed)")
                    with contextlib.suppress(OSError):
                        os.remove(self.artifact_file(name))
                continue
            if name not in known:
                problems.append(f"{name}: artifact with no record (removed)")
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(self.artifact_dir, name))
        return {"records": len(records), "problems": problems, "ok": not problems}
