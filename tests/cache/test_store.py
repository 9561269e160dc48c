"""The SQLite store: records, deltas from many writers, damage detection, maintenance."""
import os
import sqlite3
import time

import pytest

from adaptive_eager.cache import api
from adaptive_eager.cache.store import TABLE, CacheError, Store


def _update(digest, **fields):
    base = {"digest": digest, "ops": ["%0 = aten.add.Tensor(in0:f32[4], 1)"],
            "parts": {"context": {"torch_version": "t"}, "ops": ["aten.add.Tensor"]},
            "state": "cold", "torch_version": "t", "fingerprint": "f"}
    return {**base, **fields}


def _writer(path: str) -> bool:
    with open(path, "wb") as handle:
        handle.write(b"kernel bytes" * 100)
    return True


@pytest.fixture
def store(tmp_path):
    store = Store(str(tmp_path / "cache"))
    yield store
    store.close()


def test_counters_are_deltas_and_cold_never_undoes_a_decision(store):
    store.write([_update("aa11", seen=2)])
    store.write([_update("aa11", state="ready", seen=1, fused_runs=5, compile_seconds=1.5)])
    store.write([_update("aa11", seen=3)])              # another process, only saw it
    record = store.get("aa11")
    assert (record.seen, record.fused_runs, record.state) == (6, 5, "ready")
    assert record.compile_seconds == 1.5


def test_prefix_resolution(store):
    store.write([_update("abc123"), _update("abd456")])
    assert store.resolve("abc") == "abc123"
    with pytest.raises(CacheError, match="ambiguous"):
        store.resolve("ab")
    with pytest.raises(CacheError, match="no segment key starts with 'ff'"):
        store.resolve("ff")
    with pytest.raises(CacheError, match="not a key"):
        store.resolve("xyz")


def _foreign(path, statement: str) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(statement)


@pytest.mark.parametrize("damage", ["garbage", "truncate", "empty_header", "newer_format",
                                    "other_columns"])
def test_a_damaged_database_is_set_aside_and_rebuilt(tmp_path, damage):
    directory = tmp_path / "cache"
    store = Store(str(directory))
    store.write([_update("aa11", seen=1)])
    store.close()
    path = directory / "segments.sqlite"
    data = path.read_bytes()
    if damage == "garbage":
        path.write_bytes(b"this is not a database at all" * 200)
    elif damage == "truncate":
        path.write_bytes(data[:len(data) // 3])
    elif damage == "empty_header":
        path.write_bytes(b"\0" * len(data))
    elif damage == "newer_format":               # written by a later adaptive-eager
        _foreign(path, "PRAGMA user_version = 99")
    else:                                        # same table name, another layout
        _foreign(path, f"ALTER TABLE {TABLE} ADD COLUMN colour TEXT")
    fresh = Store(str(directory))
    assert fresh.records() == []
    assert fresh.set_aside and os.path.exists(fresh.set_aside[0])
    fresh.write([_update("bb22", seen=1)])
    assert fresh.get("bb22").seen == 1
    fresh.close()


def test_the_cli_api_reports_a_corrupt_database(tmp_path):
    directory = tmp_path / "cache"
    first = Store(str(directory))
    first.write([_update("aa11", seen=1)])
    first.close()
    (directory / "segments.sqlite").write_bytes(b"garbage" * 500)
    with pytest.raises(CacheError, match="corrupt: set aside as .*corrupt-"):
        api.open_store(str(directory))
    assert api.open_store(str(directory)).records() == []       # rebuilt, usable
    with pytest.raises(CacheError, match="no kernel cache at"):
        api.open_store(str(tmp_path / "missing"))


def test_artifacts_are_checked_against_size_and_checksum(store):
    name, size, checksum = store.save_artifact("aa11", _writer)
    store.write([_update("aa11", state="ready", artifact=name, artifact_bytes=size,
                         artifact_xxh=checksum)])
    record = store.get("aa11")
    path = store.artifact_file(name)
    assert name == f"aa11-{checksum}.bin" and store.read_artifact(record) == path
    with open(path, "r+b") as handle:                           # truncate it
        handle.truncate(size // 2)
    assert store.read_artifact(record) is None
    assert not os.path.exists(path)                             # removed


def test_a_declined_or_failed_write_leaves_nothing_behind(store):
    assert store.save_artifact("aa11", lambda path: False) is None

    def crashing(path):
        with open(path, "wb") as handle:
            handle.write(b"half")
        raise OSError("disk full")
    with pytest.raises(OSError):
        store.save_artifact("aa11", crashing)
    assert os.listdir(store.artifact_dir) == []


def test_verify_repairs_missing_artifacts_and_orphans(store):
    name, size, checksum = store.save_artifact("aa11", _writer)
    store.write([_update("aa11", state="ready", artifact=name, artifact_bytes=size,
                         artifact_xxh=checksum)])
    os.remove(store.artifact_file(name))
    with open(os.path.join(store.artifact_dir, "orphan.bin"), "wb") as handle:
        handle.write(b"x")
    report = store.verify()
    assert not report["ok"] and len(report["problems"]) == 2
    assert store.get("aa11").state == "cold" and store.get("aa11").artifact is None
    assert store.verify()["ok"]


def test_prune_by_age_and_size(store):
    now = time.time()
    for index, age in enumerate((10, 1000, 100000)):
        name, size, checksum = store.save_artifact(f"a{index}", _writer)
        store.write([_update(f"a{index}", artifact=name, artifact_bytes=size,
                             artifact_xxh=checksum)])
        conn = sqlite3.connect(store.db_path)
        conn.execute(f"UPDATE {TABLE} SET last_used = ? WHERE digest = ?", (now - age, f"a{index}"))
        conn.commit()
        conn.close()
    assert api.prune(store, older_than_s=50000) == 1
    assert {r.digest for r in store.records()} == {"a0", "a1"}
    assert api.prune(store, max_bytes=1500) == 1                # drops the older one
    assert [r.digest for r in store.records()] == ["a0"]
    assert os.listdir(store.artifact_dir) == [store.get("a0").artifact]
    assert api.clear(store) == 1 and store.records() == []


def test_durations_and_sizes_parse_or_explain():
    assert api.parse_duration("7d") == 7 * 86400 and api.parse_duration("90") == 90
    assert api.parse_size("500M") == 500 << 20 and api.parse_size("2GB") == 2 << 30
    with pytest.raises(CacheError, match="not a duration"):
        api.parse_duration("soon")
    with pytest.raises(CacheError, match="not a size"):
        api.parse_size("big")


KILLED_WRITER = """
import sys, threading
from adaptive_eager.cache.store import Store
directory, stop_at = sys.argv[1], sys.argv[2]
store = Store(directory)
COMMITTED = 20
def stop_here():
    print("ready", flush=True)               # the parent kills it now
    threading.Event().wait()
def write(path):
    with open(path, "wb") as handle:
        handle.write(b"k" * 100000)
        if stop_at == "artifact" and i == COMMITTED:
            handle.flush()
            stop_here()                      # half an artifact written
        handle.write(b"k" * 100000)
    return True
upsert = Store._upsert
def stopping_upsert(self, conn, update, now):
    upsert(self, conn, update, now)
    if stop_at == "transaction" and i == COMMITTED:
        stop_here()                          # a record written, not committed
Store._upsert = stopping_upsert
for i in range(1000000):
    if stop_at == "anywhere" and i == COMMITTED:
        print("ready", flush=True)           # and goes on writing until killed
    digest = f"{i:016x}"
    name, size, checksum = store.save_artifact(digest, write)
    store.write([{"digest": digest, "ops": ["op"], "parts": {"context": {}}, "state": "ready",
                  "torch_version": "t", "fingerprint": "f", "artifact": name,
                  "artifact_bytes": size, "artifact_xxh": checksum, "seen": 1}])
"""


@pytest.mark.parametrize("stop_at", ["artifact", "transaction", "anywhere"])
def test_kill_9_mid_write_loses_at_most_that_entry(tmp_path, stop_at):
    """The writer says when it is where it is to be killed (in the middle of an artifact,
    inside a transaction, or wherever it is once 20 entries are in): no sleep decides it."""
    import signal
    import subprocess
    import sys
    directory = tmp_path / "cache"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(directory), stop_at],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
    store = Store(str(directory))
    records = store.records()
    assert not store.set_aside                                 # the database is intact
    if stop_at == "anywhere":
        assert len(records) >= 20
    else:
        assert len(records) == 20                              # the 21st is lost, nothing else
    for record in records:                                     # every record's artifact too
        assert store.read_artifact(record) is not None, record.digest
    report = store.verify()
    assert all("no record" in problem for problem in report["problems"])   # at most orphans
    if stop_at == "transaction":
        assert len(report["problems"]) == 1                    # the 21st's artifact
    store.close()


def test_prune_of_50000_records_by_age_then_size(store):
    """Pruning the largest store CACHE_MAX_ENTRIES allows: once by age, once by size over
    what is left (the size pass must not compare every record with every doomed one)."""
    now, count = time.time(), 50_000
    store.records()                                          # creates the database
    conn = sqlite3.connect(store.db_path)
    rows = [(f"{i:016x}", "[]", '{"context": {}}', "ready", "t", "f", f"{i:016x}-x.bin", 10,
             "x", now, now - i) for i in range(count)]      # record i was used i seconds ago
    conn.executemany(f"INSERT INTO {TABLE} (digest, ops, parts, state, torch_version, "
                     "fingerprint, artifact, artifact_bytes, artifact_xxh, created, last_used) "
                     "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    conn.commit()
    conn.close()
    # The oldest 10,000 by age, then the oldest 30,000 of the rest by size: 10,000 x 10 B fit.
    assert api.prune(store, older_than_s=count - 10_000 - 0.5, max_bytes=100_000) == 40_000
    left = sorted(int(r.digest, 16) for r in store.records())
    assert left == list(range(10_000))
