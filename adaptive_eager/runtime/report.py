"""The exit report (NEURON_ADAPTIVE_EAGER_REPORT): what the runtime did in this process.

Counters, the segments that saved the most time, fallbacks by reason, compile time. Printed
to stderr, or written as JSON to the path the setting names.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

TOP_SEGMENTS = 10


def build_report() -> dict:
    from adaptive_eager import api
    from adaptive_eager.runtime.engine import shared_table
    stats = api.stats()
    entries = shared_table().entries()
    top = sorted(entries, key=lambda e: e.saved_seconds, reverse=True)[:TOP_SEGMENTS]
    return {
        "counters": stats.as_dict(),
        "top_segments": [{
            "key": entry.digest, "state": entry.state.value, "ops": len(entry.segment.ops),
            "first_ops": entry.segment.describe()[:80], "fused_runs": entry.fused_runs,
            "eager_ms": entry.eager_ms, "fused_ms": entry.fused_ms,
            "saved_seconds": entry.saved_seconds} for entry in top],
        "fallbacks": dict(sorted(stats.fallbacks.items(), key=lambda item: -item[1])),
        "compiles": stats.compiles,
        "compile_seconds": stats.compile_seconds,
    }


def format_report(report: dict) -> str:
    counters = report["counters"]
    lines = [f"adaptive_eager report (backend {counters['backend'] or 'none'})",
             f"  ops seen {counters['ops_seen']}, fused runs {counters['fused_executions']} "
             f"({counters['fused_ops']} ops), per-op ops {counters['per_op_executions']}, "
             f"divergences {counters['divergences']}",
             f"  keys {counters['keys_seen']}, hot {counters['hot_keys']}, compiles "
             f"{report['compiles']} ({report['compile_seconds']:.1f} s), failures "
             f"{counters['compile_failures']}, disk loads {counters['cache_hits_disk']}",
             "  top segments by time saved:"]
    for row in report["top_segments"]:
        eager = "-" if row["eager_ms"] is None else f"{row['eager_ms']:.3f}"
        fused = "-" if row["fused_ms"] is None else f"{row['fused_ms']:.3f}"
        lines.append(f"    {row['key'][:10]} {row['state']:<9} {row['ops']:>3} ops  runs "
                     f"{row['fused_runs']:>6}  eager {eager} ms  fused {fused} ms  saved "
                     f"{row['saved_seconds']:.3f} s  {row['first_ops']}")
    lines.append("  fallbacks by reason: " + (", ".join(
        f"{reason}={count}" for reason, count in report["fallbacks"].items()) or "none"))
    return "\n".join(lines)


def write_report(target: str) -> None:
    """Write the report to ``target``: "stderr" or a .json path (atomically)."""
    report = build_report()
    if target == "stderr":
        print(format_report(report), file=sys.stderr)
        return
    directory = os.path.dirname(os.path.abspath(target))
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, delete=False, suffix=".tmp") as handle:
        json.dump(report, handle, indent=2, default=str)
    os.replace(handle.name, target)
