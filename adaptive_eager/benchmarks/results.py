"""From what the children measured to the rows of the report: medians, ratios to eager,
break-even points and the output check. Pure functions, no processes, no torch at import."""
from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from typing import Any

NEVER = "never"
# A steady step less than this much faster than eager's is within this machine's noise; its
# break-even would be a large number that means nothing, so it is NEVER.
NOISE_FRACTION = 0.02

# Row.status values; anything but OK and SKIPPED makes the command exit non-zero.
OK, MISMATCH, FAILED, SKIPPED = "ok", "mismatch", "failed", "skipped"


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the report: a mode's measurement, judged against eager's."""

    workload: str
    size: str
    mode: str
    status: str
    detail: str = ""                 # why, when the status is not ok
    median_ms: float | None = None   # steady-state step time
    ratio_to_eager: float | None = None   # median_ms / eager's (below 1: faster than eager)
    paired_ratio: float | None = None     # adaptive: its steps / plain eager's, interleaved
    first_iter_s: float | None = None
    total_s: float | None = None     # the first ``iters`` steps, from the first one's start
    compile_wait_s: float | None = None
    warmup_steps: int | None = None
    compiles: int | None = None
    compile_s: float | None = None
    peak_mib: float | None = None
    break_even: int | str | None = None   # iterations; NEVER; None for eager itself

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def median_ms(steps_s) -> float:
    return statistics.median(steps_s) * 1e3


def break_even(eager: dict, other: dict) -> int | str:
    """The iteration count from which ``other``'s cumulative time stays below eager's.

    Both are child measurements (``cold_step_s``, ``compile_wait_s``, ``warmup_steps``,
    ``warmup_s``, ``steady_step_s``). The measured cold steps are compared one by one, then
    the warm-up's steps as a whole; ``other`` pays its waits for background compiles as lost
    time (so this is an upper bound), then both go on at their steady medians. NEVER when
    ``other``'s steady step is not faster than eager's (by more than NOISE_FRACTION).
    """
    eager_step = statistics.median(eager["steady_step_s"])
    gain = eager_step - statistics.median(other["steady_step_s"])
    if gain <= NOISE_FRACTION * eager_step:
        return NEVER
    # behind[k - 1]: how much longer ``other`` took than eager over the first k steps.
    behind = list(itertools.accumulate(o - e for e, o in zip(eager["cold_step_s"],
                                                             other["cold_step_s"])))
    measured, warmup_steps = len(behind), other.get("warmup_steps", 0)
    after_cold = behind[-1] + other["compile_wait_s"]
    after_warmup = after_cold + other.get("warmup_s", 0.0) - eager.get("warmup_s", 0.0)
    if after_warmup >= 0:                  # still behind after the warm-up: steady steps
        return measured + warmup_steps + math.floor(after_warmup / gain) + 1
    if after_cold >= 0:                    # caught up during the warm-up (by its end)
        return measured + warmup_steps
    # Ahead by the end of the cold steps: since when, among the measured ones?
    first = measured + 1
    while first > 1 and behind[first - 2] < 0:
        first -= 1
    return first


def paired_ratio(measurement: dict) -> float | None:
    """The median of the mode's steps over plain eager's, timed in turn in one process (the
    child's step 5); None where it ran none."""
    eager, own = measurement.get("paired_eager_s"), measurement.get("paired_adaptive_s")
    if not eager or not own:
        return None
    return statistics.median(own) / statistics.median(eager)


def measured_row(measurement: dict, eager: dict, status: str = OK, detail: str = "") -> Row:
    """The row for one child's measurement (``eager``: the eager child's, the reference)."""
    median = median_ms(measurement["steady_step_s"])
    is_eager = measurement["mode"] == "eager"
    cold = measurement["cold_step_s"]
    return Row(workload=measurement["workload"], size=measurement["size"],
               mode=measurement["mode"], status=status, detail=detail, median_ms=median,
               ratio_to_eager=median / median_ms(eager["steady_step_s"]),
               paired_ratio=paired_ratio(measurement),
               first_iter_s=cold[0], total_s=sum(cold),
               compile_wait_s=measurement["compile_wait_s"],
               warmup_steps=measurement.get("warmup_steps"), compiles=measurement["compiles"],
               compile_s=measurement["compile_s"], peak_mib=measurement["peak_mib"],
               break_even=None if is_eager else break_even(eager, measurement))


def compare_outputs(actual: Any, expected: Any, rtol: float, atol: float) -> str | None:
    """None when ``actual`` equals eager's ``expected`` within tolerance, else why not
    (torch.testing's message, on one line)."""
    import torch
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        return "; ".join(lines)
    return None


def any_failure(rows: list[Row]) -> bool:
    """Should the command exit non-zero? (a mismatch or a child that failed)"""
    return any(row.status in (MISMATCH, FAILED) for row in rows)
