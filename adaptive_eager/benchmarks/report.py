"""Show the rows: a text table, JSON, a markdown page (BENCHMARKS.md) and a bar chart.
Formatting only; every number was computed in results.py."""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import textwrap
from typing import Callable

from adaptive_eager.benchmarks.child import MOST_WARMUP_STEPS, WARMUP_S, WARMUP_STEPS
from adaptive_eager.benchmarks.results import (FAILED, MISMATCH, NEVER, NOISE_FRACTION, OK,
                                               SKIPPED, Row, any_failure)


class PlotUnavailable(RuntimeError):
    """matplotlib is missing; the message says how to install it."""


# ---------------------------------------------------------------------- the machine

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What the numbers depend on: CPU, cores, torch threads, torch and Python versions."""
    import torch
    info = {"cpu": _cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "os": f"{platform.system()} {platform.release()}",
            "vec_isa_probe_skipped": os.environ.get("TORCHINDUCTOR_VEC_ISA_OK", "1") == "1"}
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
    return info


def machine_line(info: dict) -> str:
    gpu = f", {info['cuda_device']}" if "cuda_device" in info else ""
    return (f"{info['cpu']}, {info['cores']} cores, {info['torch_threads']} torch threads"
            f"{gpu}; torch {info['torch']}, Python {info['python']}, {info['os']}")


# ---------------------------------------------------------------------- cells

def _number(value: float | None, unit_digits: int = 3) -> str:
    """About ``unit_digits`` significant digits, without exponent notation."""
    if value is None or value != value:
        return "-"
    if value == 0:
        return "0"
    decimals = max(0, unit_digits - 1 - int(f"{abs(value):e}".split("e")[1]))
    return f"{value:.{decimals}f}"


def ratio_text(ratio: float | None) -> str:
    """Two decimals, or two significant digits below 0.1 (0.0017, not 0.00)."""
    if ratio is None:
        return "-"
    return f"{ratio:.2f}" if ratio >= 0.1 else _number(ratio, 2)


def _break_even(row: Row) -> str:
    if row.break_even is None:
        return "-"
    return NEVER if row.break_even == NEVER else str(row.break_even)


def _check(row: Row) -> str:
    if row.status == OK:
        return "reference" if row.mode == "eager" else "ok"
    return {MISMATCH: "MISMATCH", FAILED: "FAILED", SKIPPED: "skipped"}[row.status]


def _compiles(row: Row) -> str:
    return "-" if row.compiles is None else str(row.compiles)


# (header, cell, right-aligned)
COLUMNS: tuple[tuple[str, Callable[[Row], str], bool], ...] = (
    ("workload", lambda r: r.workload, False),
    ("size", lambda r: r.size, False),
    ("mode", lambda r: r.mode, False),
    ("step ms", lambda r: _number(r.median_ms), True),
    ("x eager", lambda r: ratio_text(r.ratio_to_eager), True),
    ("x eager paired", lambda r: ratio_text(r.paired_ratio), True),
    ("1st iter s", lambda r: _number(r.first_iter_s), True),
    ("N iters s", lambda r: _number(r.total_s), True),
    ("compiles", _compiles, True),
    ("compile s", lambda r: _number(r.compile_s, 2), True),
    ("peak MiB", lambda r: _number(r.peak_mib, 3), True),
    ("break-even", _break_even, True),
    ("check", _check, False),
)


def cells(row: Row) -> list[str]:
    return [cell(row) for _, cell, _ in COLUMNS]


# ---------------------------------------------------------------------- text and markdown

def problems(rows: list[Row]) -> list[str]:
    """One line per row that is not ok, saying why (mismatches first: they are the loudest)."""
    order = {MISMATCH: 0, FAILED: 1, SKIPPED: 2}
    bad = sorted((r for r in rows if r.status != OK), key=lambda r: order[r.status])
    return [f"{_check(r)}: {r.workload} {r.size} {r.mode}: {r.detail}" for r in bad]


def aligned(table: list[list[str]], right: list[bool]) -> list[str]:
    """The table's lines, each column as wide as its widest cell, two spaces apart; ``right``
    says which columns are right-aligned (numbers, so their units line up)."""
    widths = [max(len(line[i]) for line in table) for i in range(len(right))]
    return ["  ".join(text.rjust(width) if right_aligned else text.ljust(width)
                      for text, width, right_aligned in zip(line, widths, right)).rstrip()
            for line in table]


def text_table(rows: list[Row], info: dict, iters: int) -> str:
    table = [[header for header, _, _ in COLUMNS]] + [cells(row) for row in rows]
    lines = [f"{machine_line(info)}; N = {iters}"]
    lines += aligned(table, [right for _, _, right in COLUMNS])
    lines += problems(rows)
    mismatches = sum(r.status == MISMATCH for r in rows)
    if mismatches:
        lines.append(f"{mismatches} output mismatch(es) against eager: "
                     "do not trust the timings of those rows")
    return "\n".join(lines)


def markdown_table(rows: list[Row]) -> str:
    header = [name for name, _, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if right else "---" for _, _, right in COLUMNS) + "|"]
    lines += ["| " + " | ".join(cells(row)) + " |" for row in rows]
    return "\n".join(lines)


_EXPLANATION = """\
What the columns mean (each workload × size × mode ran in its own fresh process with empty
Inductor and kernel caches; every mode ran the same seeded inputs):

- **step ms** — median of N steady-state steps, after the first N steps and a warm-up of
  about {warmup_s:g} s of eager steps ({fewest}-{most} steps; the same count in every mode),
  with waits for background compiles before and half-way through it (adaptive only).
- **x eager** — step ms / eager's step ms: below 1.00 is faster than eager.
- **eager+malloc** rows — plain eager with the glibc malloc thresholds `MALLOC_TUNING=1` sets
  (off by default in both eager and adaptive). The runtime's kernels write buffers it pools,
  so on large tensors part of its gain is memory reuse: this row is what eager gets from the
  allocator alone, and adaptive's step ms over this row's is what fusion adds.
- **x eager paired** — adaptive only: after its steady steps, two rounds of four blocks,
  plain eager (`ae.paused()`), the runtime's, the runtime's, plain eager, of N/2 steps or of
  at least 0.05 s where N/2 steps take less, each step timed alone (a block's first step left
  out); the median of the runtime's over eager's. One process and one stretch of time: the
  machine's drift between the children (this one slows under sustained load) does not enter
  it, nor the allocator's different state in another process.
- **1st iter s**, **N iters s** — the first step, and the first N steps together, timed from
  the first step's start (cold: they include torch.compile's compile, and the adaptive
  runtime's recording while its background worker compiles).
- **compiles**, **compile s** — kernels compiled and seconds spent (adaptive: `ae.stats()`,
  in the background worker; compile: Dynamo graphs and Dynamo's compile wall time).
- **peak MiB** — peak resident memory of the benchmark process (the adaptive runtime's
  compile worker is a separate process, not included).
- **break-even** — the iteration count from which the mode's cumulative time stays below
  eager's: the measured first N steps, then the wait for compiles counted as lost time (an
  upper bound), then steady-state steps; `never` when its steady step is not faster than
  eager's by more than {noise:.0%} (closer than that is noise on this machine).
- **check** — the last step's output against eager's with `torch.testing.assert_close`
  (rtol/atol 1e-4 for the pointwise chain, 1e-3 where matmuls, reductions or an optimizer
  reorder float sums). A `MISMATCH` row's timings are not to be trusted, and the command
  exits non-zero.

Steps are timed as a program runs them: an adaptive step does not end with `ae.sync()`
(~5 us, which no program pays every step), so deferred work it leaves lands in the next
step's time; each block of steps ends with one `ae.sync()`, counted in its last step.
{isa}"""

_REPRODUCE = """\
To reproduce: `pip install ".[hf]"` (for the `hf_gpt2` workloads), then run the command
above; on a busy machine the medians move, so compare runs on one machine only. Workloads and
sizes: `adaptive-eager bench --list`. Steady state only, in one process, with pytest-benchmark:
`pytest bench/ --benchmark-only` (README, "Benchmarks")."""


def _isa_note(info: dict) -> str:
    if info.get("vec_isa_probe_skipped"):
        return ("Inductor's gcc ISA probes (~10 s per fresh process) were skipped in every mode "
                "(`TORCHINDUCTOR_VEC_ISA_OK=1`).")
    return "Inductor's gcc ISA probes ran in every fresh process (`TORCHINDUCTOR_VEC_ISA_OK=0`)."


def workloads_table(rows: list[Row]) -> str:
    """What each workload and size in ``rows`` is."""
    from adaptive_eager.benchmarks.workloads import WORKLOADS
    sizes = list(dict.fromkeys(r.size for r in rows))
    lines = ["| workload | what | " + " | ".join(sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for name in dict.fromkeys(r.workload for r in rows):
        workload = WORKLOADS[name]
        lines.append(f"| {name} | {workload.description} | "
                     + " | ".join(workload.shapes[size] for size in sizes) + " |")
    return "\n".join(lines)


def markdown(rows: list[Row], info: dict, command: str, iters: int) -> str:
    """The whole BENCHMARKS.md page."""
    today = datetime.date.today().isoformat()
    sections = ["# Benchmarks: eager vs adaptive vs torch.compile",
                f"Generated on {today} by `{command}`; do not edit by hand, run it again.",
                f"Machine: {machine_line(info)}. N = {iters}.",
                markdown_table(rows),
                "\n".join(f"- {line}" for line in problems(rows)),
                _EXPLANATION.format(warmup_s=WARMUP_S, fewest=WARMUP_STEPS, most=MOST_WARMUP_STEPS,
                                    noise=NOISE_FRACTION, isa=_isa_note(info)),
                "Workloads:\n\n" + workloads_table(rows),
                _REPRODUCE]
    return "\n\n".join(section for section in sections if section) + "\n"


# ---------------------------------------------------------------------- JSON and the plot

def json_payload(rows: list[Row], info: dict, command: str, iters: int) -> dict:
    return {"command": command, "machine": info, "iters": iters,
            "failed": any_failure(rows),
            "results": [row.as_dict() for row in rows]}


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as file:
        json.dump(payload, file, indent=2)
        file.write("\n")


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'adaptive-eager[plot]'")


def plot(rows: list[Row], info: dict, path: str) -> None:
    """Bars of step time / eager per workload × size, one bar per non-eager mode."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")                 # files only, no display needed
    from matplotlib import pyplot
    cases = list(dict.fromkeys((r.workload, r.size) for r in rows))
    modes = list(dict.fromkeys(r.mode for r in rows if r.mode != "eager"))
    ratio = {(r.workload, r.size, r.mode): r.ratio_to_eager for r in rows
             if r.status == OK and r.ratio_to_eager}
    figure, axes = pyplot.subplots(figsize=(min(18.0, max(6.0, 0.5 * len(cases) + 2)), 5.0))
    width = 0.8 / max(1, len(modes))
    for index, mode in enumerate(modes):
        heights = [ratio.get((w, s, mode), 0.0) for w, s in cases]
        axes.bar([c + index * width for c in range(len(cases))], heights, width, label=mode)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_yscale("log")
    axes.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))],
                    [f"{w} {s}" for w, s in cases], fontsize=7, rotation=60, ha="right")
    axes.set_ylabel("step time / eager (lower is faster)")
    axes.set_title(textwrap.fill(machine_line(info), 100), fontsize=7)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
