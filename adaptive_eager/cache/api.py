"""The Python API behind ``adaptive-eager cache``: every function returns plain records or
dicts; the CLI only formats them. Nothing here imports torch."""
from __future__ import annotations

import os
import shutil
import time

from adaptive_eager.cache.inductor_dir import inductor_dir, is_ours
from adaptive_eager.cache.store import CacheError, SegmentRecord, Store

SORT_KEYS = {
    "last-used": lambda r: -r.last_used,
    "seen": lambda r: -r.seen,
    "fused": lambda r: -r.fused_runs,
    "compile": lambda r: -r.compile_seconds,
    "ops": lambda r: -len(r.ops),
    "speedup": lambda r: -(speedup(r) or 0.0),
}
STATES = ("cold", "hot", "waiting", "compiling", "ready", "failed", "unprofitable",
          "megamorphic", "disabled", "unfusible")

_EXPLANATIONS = {
    "ready": "is fused: compiled in {compile_seconds:.2f} s, it ran fused {fused_runs} times "
             "({n_ops} ops per run)",
    "cold": "is not fused yet: seen {seen} times, fewer than the hot threshold, or its kernel "
            "was evicted or damaged and will be rebuilt when it turns hot",
    "hot": "would be fused but compilation is off (NEURON_ADAPTIVE_EAGER_COMPILE=0)",
    "waiting": "is hot; its compile starts once its per-op runs would have saved "
               "NEURON_ADAPTIVE_EAGER_COMPILE_COST_MS fused, and it runs per-op until then",
    "compiling": "is being compiled; it runs per-op until the kernel is ready",
    "failed": "is not fused: {reason}; it runs per-op for good (`adaptive-eager cache clear` "
              "forgets this)",
    "unfusible": "is not fused: {reason_text}",
    "unprofitable": "is not fused: its kernel was slower than eager ({reason})",
    "megamorphic": "is not fused: its structure appeared with too many shapes ({reason})",
    "disabled": "is not fused: fusion is disabled for this key ({reason})",
}
_REASON_TEXT = {
    "too_few_ops": "it has fewer than two compute ops, so fusion has nothing to save",
    "overlapping_output": "an output overlaps itself in memory, which a kernel cannot write",
    "too_cheap": "its ops compute for less than NEURON_ADAPTIVE_EAGER_MIN_SEGMENT_US plus "
                 "NEURON_ADAPTIVE_EAGER_MIN_US_PER_OP per op, too little for fusion to repay "
                 "its overhead",
    "extern_bound": "most of its time is in matmuls or convolutions, which a kernel calls "
                    "as they are: fusing the ops around them would save less than the fused "
                    "path costs",
    "compiler_unsupported": "it holds an op whose compiled kernel fails when run (with "
                            "torch 2.13's Inductor: a CPU LSTM's mkldnn_rnn_layer under "
                            "autograd), so compiling it would only cost time",
}


def open_store(directory: str | None = None) -> Store:
    """The store of ``directory`` (default: NEURON_ADAPTIVE_EAGER_CACHE_DIR), which must exist."""
    if directory is None:
        from adaptive_eager.config import config
        directory = config.CACHE_DIR
    if not os.path.isdir(directory):
        raise CacheError(f"no kernel cache at {directory} (nothing has run with it yet)")
    store = Store(directory)
    store.records()                      # opens, checks (and rebuilds) the database now
    if store.set_aside:
        raise CacheError(f"the cache database in {directory} was corrupt: set aside as "
                         f"{', '.join(store.set_aside)} and rebuilt empty")
    return store


def speedup(record: SegmentRecord) -> float | None:
    if record.eager_ms and record.fused_ms:
        return record.eager_ms / record.fused_ms
    return None


def list_segments(store: Store, sort: str = "last-used", state: str | None = None,
                  limit: int | None = None) -> list[SegmentRecord]:
    if sort not in SORT_KEYS:
        raise CacheError(f"cannot sort by {sort!r}: choose one of {', '.join(SORT_KEYS)}")
    if state is not None and state not in STATES:
        raise CacheError(f"unknown state {state!r}: choose one of {', '.join(STATES)}")
    records = [r for r in store.records() if state is None or r.state == state]
    records.sort(key=SORT_KEYS[sort])
    return records[:limit] if limit else records


def show(store: Store, prefix: str) -> dict:
    record = store.get(store.resolve(prefix))
    info = record.as_dict()
    path = store.artifact_file(record.artifact) if record.artifact else None
    info["artifact_path"] = path
    info["artifact_present"] = bool(path and os.path.exists(path))
    info["speedup"] = speedup(record)
    info["explanation"] = explain(store, record.digest)
    return info


def explain(store: Store, prefix: str) -> str:
    """One sentence: why this segment is or is not fused."""
    record = store.get(store.resolve(prefix))
    template = _EXPLANATIONS.get(record.state, "is in state {state}")
    reason = record.reason or "no reason recorded"
    text = template.format(compile_seconds=record.compile_seconds, fused_runs=record.fused_runs,
                           n_ops=len(record.ops), seen=record.seen, reason=reason,
                           reason_text=_REASON_TEXT.get(reason, reason), state=record.state)
    return f"Segment {record.digest} ({len(record.ops)} ops) {text}."


def explain_difference(store: Store, first: str, second: str) -> list[str]:
    """Which named parts of two keys differ, one line each (empty: same signature)."""
    a = store.get(store.resolve(first))
    b = store.get(store.resolve(second))
    lines = []
    for name in sorted(set(a.parts["context"]) | set(b.parts["context"])):
        left, right = a.parts["context"].get(name), b.parts["context"].get(name)
        if left != right:
            lines.append(f"context.{name}: {left} vs {right}")
    for part in ("ops", "arguments", "inputs", "live_outputs"):
        lines += _list_difference(part, a.parts.get(part, []), b.parts.get(part, []))
    return lines


def _list_difference(part: str, left: list, right: list, most: int = 5) -> list[str]:
    lines = []
    if len(left) != len(right):
        lines.append(f"{part}: {len(left)} vs {len(right)} entries")
    for index, (x, y) in enumerate(zip(left, right)):
        if x != y and len(lines) < most:
            lines.append(f"{part}[{index}]: {x} vs {y}")
    return lines


def cache_stats(store: Store) -> dict:
    records = store.records()
    by_state: dict[str, int] = {}
    for record in records:
        by_state[record.state] = by_state.get(record.state, 0) + 1
    runs = sum(r.fused_runs for r in records)
    recorded = sum(r.seen for r in records)
    return {
        "directory": store.directory,
        "entries": len(records),
        "by_state": by_state,
        "disk_bytes": store.disk_bytes(),
        "artifacts": sum(1 for r in records if r.artifact),
        "artifact_bytes": sum(r.artifact_bytes or 0 for r in records),
        "fused_runs": runs,
        "per_op_segment_runs": recorded,
        "fused_fraction": runs / (runs + recorded) if runs + recorded else 0.0,
        "compile_seconds": sum(r.compile_seconds for r in records),
    }


def disable(store: Store, prefix: str) -> str:
    """Never fuse this key again (until ``enable``); its kernel stays cached. For bisecting."""
    digest = store.resolve(prefix)
    store.set_state(digest, "disabled", "disabled with `adaptive-eager cache disable`")
    return digest


def enable(store: Store, prefix: str) -> str:
    """Undo ``disable``: the key is fused again once it turns hot (in processes started now)."""
    digest = store.resolve(prefix)
    record = store.get(digest)
    if record.state == "disabled":
        store.set_state(digest, "ready" if record.artifact else "cold", None)
    return digest


def clear(store: Store) -> int:
    """Remove every record and artifact, and the Inductor cache our compiles kept beside them
    (it only makes loading those artifacts fast, and grows with every compile); returns how
    many records went. Nothing we did not write: an Inductor directory without our marker
    stays (Note [Our Inductor cache]). A program compiling into this directory meanwhile may
    see that compile fail (a counted fallback), never an error of its own."""
    removed = store.delete([r.digest for r in store.records()])
    ours = inductor_dir(store.directory)
    if is_ours(ours):
        shutil.rmtree(ours, ignore_errors=True)
    return removed


def prune(store: Store, older_than_s: float | None = None, max_bytes: int | None = None) -> int:
    """Remove records unused for ``older_than_s``, then the least recently used until the
    artifacts fit in ``max_bytes``; returns how many records went."""
    if older_than_s is None and max_bytes is None:
        raise CacheError("prune needs --older-than and/or --max-size")
    records = sorted(store.records(), key=lambda r: r.last_used)
    doomed: list[str] = []
    if older_than_s is not None:
        cutoff = time.time() - older_than_s
        doomed = [r.digest for r in records if r.last_used < cutoff]
    if max_bytes is not None:
        # A set: a list here made pruning 50,000 records quadratic (minutes).
        gone = set(doomed)
        kept = [r for r in records if r.digest not in gone]
        size = sum(r.artifact_bytes or 0 for r in kept)
        for record in kept:
            if size <= max_bytes:
                break
            doomed.append(record.digest)
            size -= record.artifact_bytes or 0
    return store.delete(doomed)


def verify(store: Store) -> dict:
    return store.verify()


def parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        if text[-1].lower() in units:
            return float(text[:-1]) * units[text[-1].lower()]
        return float(text)
    except (ValueError, IndexError):
        raise CacheError(f"{text!r} is not a duration: use e.g. 90s, 30m, 12h, 7d") from None


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    try:
        suffix = text.rstrip("bB")[-1].lower()
        if suffix in units:
            return int(float(text.rstrip("bB")[:-1]) * units[suffix])
        return int(text)
    except (ValueError, IndexError):
        raise CacheError(f"{text!r} is not a size: use e.g. 500M, 2G, 100K") from None
