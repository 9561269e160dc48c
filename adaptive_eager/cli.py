"""``adaptive-eager`` / ``python -m adaptive_eager``: run a script under the runtime, inspect
the kernel cache. The cache commands only format what adaptive_eager.cache.api returns."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import runpy
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaptive-eager",
                                     description="Adaptive eager execution for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a Python script under the runtime")
    run.add_argument("--no-compile", action="store_true",
                     help="record and key segments but compile nothing (debugging)")
    run.add_argument("script", help="path of the script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    commands.add_parser("config", help="list every setting with its value and help")
    _add_cache_parser(commands)
    _add_bench_parser(commands)
    return parser


def _add_bench_parser(commands) -> None:
    from adaptive_eager.benchmarks.command import add_arguments
    add_arguments(commands.add_parser(
        "bench", help="eager vs adaptive vs torch.compile, each run in fresh processes",
        description="Time workloads in eager, eager+malloc, adaptive and torch.compile modes, "
                    "each in a fresh process with empty caches, and check every output against "
                    "eager."))


def _add_cache_parser(commands) -> None:
    from adaptive_eager.cache.api import SORT_KEYS, STATES
    cache = commands.add_parser("cache", help="inspect and maintain the kernel cache")
    actions = cache.add_subparsers(dest="action", required=True)

    def action(name, help_text):
        sub = actions.add_parser(name, help=help_text)
        sub.add_argument("--json", action="store_true", help="print JSON")
        sub.add_argument("--dir", help="cache directory (default: NEURON_ADAPTIVE_EAGER_CACHE_DIR)")
        return sub

    ls = action("ls", "a row per segment")
    ls.add_argument("--sort", default="last-used", choices=list(SORT_KEYS))
    ls.add_argument("--state", choices=STATES, help="only segments in this state")
    ls.add_argument("--limit", type=int, help="at most this many rows")
    action("show", "everything known about one segment").add_argument("key")
    explain = action("explain", "why a segment is (not) fused; with two keys, how they differ")
    explain.add_argument("key")
    explain.add_argument("other", nargs="?")
    action("stats", "entries by state, disk size, fused fraction")
    action("clear", "remove every record and artifact").add_argument(
        "--yes", action="store_true", help="do not ask for confirmation")
    prune = action("prune", "remove old or excess entries")
    prune.add_argument("--older-than", help="e.g. 7d, 12h, 30m")
    prune.add_argument("--max-size", help="keep artifacts under this size, e.g. 500M")
    action("verify", "check the database and every artifact")
    action("disable", "never fuse this key (bisecting); the cache is kept").add_argument("key")
    action("enable", "fuse this key again").add_argument("key")


def _run_script(options: argparse.Namespace) -> int:
    if options.no_compile:
        os.environ["NEURON_ADAPTIVE_EAGER_COMPILE"] = "0"
    if not os.path.isfile(options.script):
        print(f"adaptive-eager: no such script: {options.script}", file=sys.stderr)
        return 2
    from adaptive_eager import api
    sys.argv = [options.script, *options.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(options.script)))
    api.enable()
    try:
        runpy.run_path(options.script, run_name="__main__")
    finally:
        api.disable()
    return 0


def _show_config() -> int:
    from adaptive_eager.config import config
    for row in config.describe():
        print(f"{row['env']}={row['value']!r}\n    {row['help']}")
    return 0


# ---------------------------------------------------------------------- cache commands

def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M")


def _ops_summary(ops: tuple, width: int = 40) -> str:
    names = [line.split(" = ", 1)[-1].split("(")[0].replace("aten.", "") for line in ops]
    text = " ".join(names)
    return text if len(text) <= width else text[:width - 1] + "…"


def _print_ls(records) -> None:
    from adaptive_eager.cache.api import speedup
    print(f"{'key':<12}{'state':<11}{'ops':>4}  {'first ops':<41}{'seen':>6}{'fused':>7}"
          f"{'compile s':>10}{'speedup':>8}")
    for r in records:
        ratio = speedup(r)
        print(f"{r.digest[:10]:<12}{r.state:<11}{len(r.ops):>4}  {_ops_summary(r.ops):<41}"
              f"{r.seen:>6}{r.fused_runs:>7}{r.compile_seconds:>10.2f}"
              f"{(f'{ratio:.2f}x' if ratio else '-'):>8}")
    print(f"{len(records)} segment(s)")


def _print_show(info: dict) -> None:
    for name in ("digest", "state", "reason", "seen", "fused_runs", "compile_seconds",
                 "eager_ms", "fused_ms", "speedup", "torch_version", "fingerprint"):
        print(f"{name:<16}{info[name]}")
    print(f"{'created':<16}{_when(info['created'])}")
    print(f"{'last used':<16}{_when(info['last_used'])}")
    artifact = info["artifact_path"] or "-"
    if info["artifact_path"]:
        missing = "" if info["artifact_present"] else ", MISSING"
        artifact += f" ({info['artifact_bytes']} bytes{missing})"
    print(f"{'artifact':<16}{artifact}")
    print(f"{'live outputs':<16}{', '.join(info['parts']['live_outputs']) or '-'}")
    print("ops:")
    for line in info["ops"]:
        print(f"  {line}")
    print(info["explanation"])


def _cache_command(options: argparse.Namespace) -> int:
    from adaptive_eager.cache import api
    store = api.open_store(options.dir)
    try:
        return _CACHE_ACTIONS[options.action](api, store, options)
    finally:
        store.close()


def _emit(options, payload, printer) -> int:
    if options.json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        printer(payload)
    return 0


def _cache_ls(api, store, options) -> int:
    records = api.list_segments(store, options.sort, options.state, options.limit)
    if options.json:
        return _emit(options, [r.as_dict() for r in records], print)
    _print_ls(records)
    return 0


def _cache_show(api, store, options) -> int:
    return _emit(options, api.show(store, options.key), _print_show)


def _cache_explain(api, store, options) -> int:
    if options.other is None:
        sentence = api.explain(store, options.key)
        return _emit(options, {"explanation": sentence}, lambda p: print(p["explanation"]))
    lines = api.explain_difference(store, options.key, options.other)
    return _emit(options, {"differences": lines},
                 lambda p: print("\n".join(p["differences"]) or "same signature"))


def _cache_stats(api, store, options) -> int:
    def printer(stats):
        print(f"directory        {stats['directory']}")
        print(f"entries          {stats['entries']}  " + "  ".join(
            f"{state}={count}" for state, count in sorted(stats["by_state"].items())))
        print(f"disk             {stats['disk_bytes'] / 2**20:.1f} MiB "
              f"({stats['artifacts']} artifacts, {stats['artifact_bytes'] / 2**20:.1f} MiB)")
        print(f"fused fraction   {stats['fused_fraction']:.1%} of segment runs "
              f"({stats['fused_runs']} fused, {stats['per_op_segment_runs']} per-op)")
        print(f"compile time     {stats['compile_seconds']:.1f} s")
    return _emit(options, api.cache_stats(store), printer)


def _cache_clear(api, store, options) -> int:
    if not options.yes:
        if not sys.stdin.isatty():
            print("adaptive-eager: clear removes every cached kernel; pass --yes to confirm",
                  file=sys.stderr)
            return 2
        if input(f"Remove every entry of {store.directory}? [y/N] ").strip().lower() != "y":
            return 1
    removed = api.clear(store)
    return _emit(options, {"removed": removed}, lambda p: print(f"removed {p['removed']} entries"))


def _cache_prune(api, store, options) -> int:
    older = api.parse_duration(options.older_than) if options.older_than else None
    size = api.parse_size(options.max_size) if options.max_size else None
    removed = api.prune(store, older, size)
    return _emit(options, {"removed": removed}, lambda p: print(f"removed {p['removed']} entries"))


def _cache_verify(api, store, options) -> int:
    report = api.verify(store)
    def printer(r):
        for problem in r["problems"]:
            print(problem)
        print(f"{r['records']} records checked: "
              f"{'ok' if r['ok'] else 'problems found and repaired'}")
    _emit(options, report, printer)
    return 0 if report["ok"] else 1


def _cache_disable(api, store, options) -> int:
    digest = api.disable(store, options.key)
    return _emit(options, {"disabled": digest},
                 lambda p: print(f"{p['disabled']}: fusion disabled (new processes run it per-op)"))


def _cache_enable(api, store, options) -> int:
    digest = api.enable(store, options.key)
    return _emit(options, {"enabled": digest},
                 lambda p: print(f"{p['enabled']}: fusion enabled again"))


_CACHE_ACTIONS = {"disable": _cache_disable, "enable": _cache_enable, "ls": _cache_ls,
                  "show": _cache_show, "explain": _cache_explain, "stats": _cache_stats,
                  "clear": _cache_clear, "prune": _cache_prune, "verify": _cache_verify}


def main(argv: list[str] | None = None) -> int:
    from adaptive_eager.cache.store import CacheError
    from adaptive_eager.config import ConfigError
    options = _parser().parse_args(argv)
    try:
        if options.command == "run":
            return _run_script(options)
        if options.command == "cache":
            return _cache_command(options)
        if options.command == "bench":
            from adaptive_eager.benchmarks import command
            return command.run(options)
        return _show_config()
    except (ConfigError, CacheError) as err:
        print(f"adaptive-eager: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
