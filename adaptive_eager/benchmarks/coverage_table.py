"""``adaptive-eager bench --coverage``: each architecture of the coverage suite in a fresh
process (``coverage.main``; Note [One parity cache]), then the table: text on stdout,
optionally markdown (docs/coverage.md) and JSON. Formatting only; coverage.py measured
everything."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from adaptive_eager.benchmarks import report
from adaptive_eager.benchmarks.coverage import (CACHES, FAIL, FORCED, NEW_TOKENS, SETTLE_S,
                                                TIMED_REPS, TRAIN_STEPS, WARMUP_S, Check,
                                                Coverage)
from adaptive_eager.benchmarks.runner import PlanError, child_env

CHILD_TIMEOUT_S = 1800

# Note [One parity cache]
# The parity phase compiles every hot segment with Inductor, in the program's thread: about 40
# compiles of 2-3 s per architecture, which put a whole run near 75 minutes on 2 cores, and the
# table was stitched from partial runs. The architectures share their tiny dimensions (hidden
# 32, vocabulary 128) and many segments (Mistral's are Llama's), so the children's parity phases
# share one kernel cache directory: a segment compiled for one architecture is loaded from disk
# by the next (Llama's parity took 126 s, Mistral's after it 18 s). Parity still checks real
# Inductor kernels, loaded ones included. The timing phase starts from an empty cache of its own
# (coverage.check_architecture), as a user's first run does.


def choose(names) -> list:
    """The architectures named by model type (all when none); PlanError for unknown names."""
    from adaptive_eager.benchmarks.architectures import ARCHITECTURES, BY_TYPE
    unknown = [name for name in names or () if name not in BY_TYPE]
    if unknown:
        raise PlanError(f"unknown architecture {', '.join(map(repr, unknown))}; "
                        f"choose from {', '.join(BY_TYPE)}")
    return [BY_TYPE[name] for name in names] if names else list(ARCHITECTURES)


def _failed(arch, reason: str) -> Coverage:
    return Coverage(arch.name, arch.model_type, arch.kind,
                    (Check("train", FAIL, reason),), 0, 0, {}, {})


def run_child(arch, timing: bool = True, parity_cache: str | None = None) -> Coverage:
    """One architecture in a fresh process (its parity phase on the kernel cache directory
    ``parity_cache`` when given: Note [One parity cache]); a child that dies is a failure with
    its reason."""
    with tempfile.TemporaryDirectory(prefix=f"ae-coverage-{arch.model_type}-") as directory:
        out = os.path.join(directory, "result.json")
        command = [sys.executable, "-m", "adaptive_eager.benchmarks.coverage",
                   "--arch", arch.model_type, "--out", out] + ([] if timing else ["--no-timing"])
        env = child_env(directory)
        if parity_cache:
            env["NEURON_ADAPTIVE_EAGER_CACHE_DIR"] = parity_cache
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return _failed(arch, f"timed out after {CHILD_TIMEOUT_S} s")
        if done.returncode != 0 or not os.path.exists(out):
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            return _failed(arch, lines[-1] if lines else f"exit status {done.returncode}")
        with open(out) as file:
            return Coverage.from_dict(json.load(file))


def run(archs, timing: bool = True, stream=None, json_path: str | None = None) -> list[Coverage]:
    """Every architecture in turn, their parity phases on one kernel cache (Note [One parity
    cache]); with ``json_path``, the results so far are written after each (a long run that is
    stopped keeps what it measured)."""
    with tempfile.TemporaryDirectory(prefix="ae-coverage-parity-") as parity_cache:
        return _run(archs, timing, stream or sys.stderr, json_path, parity_cache)


def _run(archs, timing: bool, stream, json_path: str | None, parity_cache: str) -> list:
    results = []
    for index, arch in enumerate(archs, 1):
        print(f"[{index}/{len(archs)}] {arch.name} … ", end="", file=stream, flush=True)
        started = time.perf_counter()
        result = run_child(arch, timing, parity_cache)
        verdict = "pass" if result.passed else "FAIL: " + "; ".join(
            f"{c.name}: {c.reason}" for c in result.checks if c.status == FAIL)
        print(f"{time.perf_counter() - started:.0f} s, {verdict}", file=stream, flush=True)
        results.append(result)
        if json_path:
            write_json(results, json_path)
    return results


def write_json(results: list[Coverage], path: str, decode: dict | None = None) -> None:
    """The results as a list; with ``decode``, {"architectures": that list, "decode": it}."""
    data = [result.as_dict() for result in results]
    with open(path, "w") as file:
        json.dump(data if decode is None else {"architectures": data, "decode": decode}, file,
                  indent=1)


def run_decode() -> dict:
    """The decode benchmark (decode.py) in a fresh process: its JSON, or {"error": why}."""
    with tempfile.TemporaryDirectory(prefix="ae-coverage-decode-") as directory:
        out = os.path.join(directory, "decode.json")
        command = [sys.executable, "-m", "adaptive_eager.benchmarks.decode", "--out", out]
        try:
            done = subprocess.run(command, env=child_env(directory), capture_output=True,
                                  text=True, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
        if done.returncode != 0 or not os.path.exists(out):
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            return {"error": lines[-1] if lines else f"exit status {done.returncode}"}
        with open(out) as file:
            return json.load(file)


def decode_section(decode: dict) -> list[str]:
    """Markdown lines: tokens per second per cache and mode, and the ratios to eager."""
    from adaptive_eager.benchmarks.decode import PROMPT, REPS, SMALL_LLAMA
    fields = SMALL_LLAMA.fields
    lines = ["## Decode loops", "",
             f"Greedy `generate()` of {NEW_TOKENS} tokens after a {PROMPT}-token prompt on a "
             f"small Llama ({fields['num_hidden_layers']} layers, hidden "
             f"{fields['hidden_size']}, vocabulary {fields['vocab_size']}; "
             f"`adaptive_eager/benchmarks/decode.py`). The runtime with default settings and an "
             f"empty kernel cache, warmed up as above; torch.compile is transformers' own "
             f"compiled decode step (`CompileConfig(mode=\"default\")`, allowed on the CPU). "
             f"Eager, runtime and compiled calls alternate {REPS} times in one process; "
             f"medians. The last column names modes whose tokens differed from eager's.", ""]
    if "error" in decode:
        return lines + [f"Not measured: {decode['error']}", ""]
    lines += ["| cache | eager tok/s | runtime tok/s | runtime / eager | torch.compile tok/s "
              "| compile / eager | ops fused (runtime) | mismatches |",
              "|---|---|---|---|---|---|---|---|"]
    for cache, entry in decode.items():
        rates = entry["tokens_per_s"]
        eager, compiled = rates["eager"], rates.get("compile")
        compile_cells = f"{compiled:.0f} | {compiled / eager:.2f}x" if compiled else "- | -"
        lines.append(
            f"| {cache} | {eager:.0f} | {rates['runtime']:.0f} | {rates['runtime'] / eager:.2f}x"
            f" | {compile_cells} | {entry['fused_fraction']:.0%} | "
            f"{', '.join(entry['mismatches']) or 'none'} |")
    return lines + [""]


def load(paths, archs) -> tuple[list[Coverage], dict | None]:
    """Results saved by earlier runs (``--json``: a list, or a dict of it and the decode
    results; decode.py: a dict), in the order of ``archs``, the first file's result winning;
    architectures no file holds are left out."""
    found, decode = {}, None
    for path in paths:
        with open(path) as file:
            data = json.load(file)
        if isinstance(data, dict) and "architectures" in data:
            data, decode = data["architectures"], data.get("decode", decode)
        elif isinstance(data, dict):
            decode = data
            continue
        for entry in data:
            found.setdefault(entry["model_type"], Coverage.from_dict(entry))
    return [found[arch.model_type] for arch in archs if arch.model_type in found], decode


# ---------------------------------------------------------------------- cells

def _status(check: Check) -> str:
    return {"pass": "pass", "n/a": "n/a", "fail": "**FAIL**"}[check.status]


def _fallbacks(result: Coverage, top: int = 3) -> str:
    ranked = sorted(result.fallbacks.items(), key=lambda item: -item[1])[:top]
    return ", ".join(f"{reason} {count}" for reason, count in ranked) or "-"


def _ratio(result: Coverage, name: str) -> str:
    entry = result.timing.get(name)
    if not entry:
        return "-"
    cell = f"{entry['ratio']:.2f} ({entry['fused_fraction']:.0%})"
    if "settling_s" in entry:
        cell += f", settling {entry['settling_s'] / entry['eager_s']:.2f}"
    return cell


def _tokens_per_s(result: Coverage, cache: str) -> str:
    entry = result.timing.get(f"generate {cache}")
    if not entry:
        return "-"
    return f"{NEW_TOKENS / entry['eager_s']:.0f} / {NEW_TOKENS / entry['runtime_s']:.0f}"


def headline(results: list[Coverage]) -> str:
    passed = sum(result.passed for result in results)
    share = passed / len(results) if results else 0.0
    return (f"{passed} of {len(results)} architectures ({share:.0%}) train and generate as in "
            f"eager under the runtime.")


def rows(results: list[Coverage]) -> list[list[str]]:
    table = []
    for result in results:
        checks = {check.name: check for check in result.checks}
        cells = [result.name, result.kind]
        cells += [_status(checks[name]) if name in checks else "-"
                  for name in ("train", *(f"generate {cache}" for cache in CACHES))]
        cells += [f"{result.fused_fraction:.0%}", _fallbacks(result), _ratio(result, "train step")]
        for cache in CACHES:
            cells += [_ratio(result, f"generate {cache}"), _tokens_per_s(result, cache)]
        table.append(cells)
    return table


HEADERS = ["architecture", "kind", "train", "generate dynamic", "generate static",
           "fused ops (forced)", "top fallbacks (forced)", "train step ratio",
           "dynamic ratio", "dynamic tok/s eager / runtime", "static ratio",
           "static tok/s eager / runtime"]


def text_table(results: list[Coverage]) -> str:
    lines = [" | ".join(HEADERS)] + [" | ".join(cells) for cells in rows(results)]
    return "\n".join(lines + ["", headline(results)])


def _reasons(results: list[Coverage]) -> list[str]:
    lines = []
    for result in results:
        for check in result.checks:
            if check.reason and check.status != "pass" and result.kind != "encoder":
                lines.append(f"- {result.name}, {check.name}: {check.status}: {check.reason}")
    return lines


def _noise(results: list[Coverage]) -> str:
    """A sentence on how much the same eager call varied while the ratios were measured."""
    spreads = sorted(entry["eager_spread"] for result in results
                     for entry in result.timing.values() if "eager_spread" in entry)
    if not spreads:
        return ""
    return (f" The same eager call varied (max - min) by {spreads[len(spreads) // 2]:.0%} of its "
            f"median in the middle row, {spreads[-1]:.0%} at most: ratios closer to 1 than "
            f"that are within this machine's noise.")


def markdown(results: list[Coverage], command: str, decode: dict | None = None,
             note: str | None = None) -> str:
    info = report.machine()
    table = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    table += ["| " + " | ".join(cells) + " |" for cells in rows(results)]
    forced = ", ".join(f"{name}={value}" for name, value in FORCED.items())
    parts = [
        "# Real-model coverage", "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()}: each architecture "
        f"in a fresh process, compiled by TorchInductor (`TORCHINDUCTOR_VEC_ISA_OK=1`: the "
        f"ISA probe skipped); the parity phases share one kernel cache, so a segment that an "
        f"earlier architecture compiled is loaded, and each timing phase starts from an empty "
        f"one. Machine: {report.machine_line(info)}.", "",
        *([note, ""] if note else []),
        f"**{headline(results)}**", "",
        "Each architecture is a `transformers` model built from a tiny config (2 layers, "
        "hidden 32, vocabulary 128; random weights, nothing downloaded; see "
        "`adaptive_eager/benchmarks/architectures.py`). Plain eager PyTorch is the oracle.", "",
        f"- **Parity** (train, generate): every hot segment fused ({forced}). *train*: "
        f"{TRAIN_STEPS} AdamW steps from the same initialisation and seed; losses, last "
        f"gradients and parameters within rtol 1e-4, atol 1e-5 of eager. *generate*: greedy, "
        f"{NEW_TOKENS} new tokens, with the default dynamic cache and with "
        f"`cache_implementation=\"static\"`; the same tokens. Encoders do not generate (n/a).",
        "- **fused ops (forced)**: the share of the aten ops the runtime saw in the parity runs "
        "that ran inside a fused kernel; top fallbacks: why the rest ran per-op (counts).",
        f"- **Ratios** (runtime time / eager time, below 1 is faster): default settings and "
        f"an empty kernel cache, as in a user's first run (in brackets: the share of ops fused "
        f"in the timed and warm-up calls); after {WARMUP_S:.0f} s of runtime calls, "
        f"a wait for background compiles and {SETTLE_S:.0f} s more of runtime calls, "
        f"{TIMED_REPS} runtime calls alternate with {TIMED_REPS} eager calls (`ae.paused()`) "
        f"in one process; medians. *settling*: the mean runtime call of those {SETTLE_S:.0f} s "
        f"right after the compiles landed, over eager's median: what taking new kernels in "
        f"costs (the runtime watches the steps again, records the segments they now cut in "
        f"Python, and tries each kernel beside per-op runs). "
        f"A train step is forward, backward and AdamW; a generate call is {NEW_TOKENS} tokens."
        f"{_noise(results)}",
        "", *table, ""]
    reasons = _reasons(results)
    if reasons:
        parts += ["## Reasons", "", *reasons, ""]
    if decode is not None:
        parts += decode_section(decode)
    return "\n".join(parts)


def write(results: list[Coverage], command: str, markdown_path: str | None,
          json_path: str | None, decode: dict | None = None, note: str | None = None) -> None:
    print(text_table(results))
    if decode is not None:
        print(json.dumps(decode, indent=1))
    if markdown_path:
        with open(markdown_path, "w") as file:
            file.write(markdown(results, command, decode, note))
    if json_path:
        write_json(results, json_path, decode)
