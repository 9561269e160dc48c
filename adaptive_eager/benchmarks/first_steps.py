"""The first 20 training steps of an MLP, eager against adaptive, each in a fresh process with
empty caches: what a program pays before its kernels come (scenarios first_steps_small_mlp and
first_steps_wide_mlp of ``adaptive-eager bench --scenarios``, measured by scenario_child.py).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import textwrap

from adaptive_eager.benchmarks.runner import child_env

# Fresh processes vary far more than rounds inside one: 20 eager steps of the small MLP took
# 34-108 ms across 15 processes here (first touches of torch's code pages on a VM disk).
FRESH_PROCESS_ROUNDS = 15
# The small MLP's processes fall into a fast (~40-50 ms) and a slow (~60-90 ms) group in both
# modes, so a median of 15 pairs flips between them: three blocks of 15 pairs in one run gave
# 1.39, 1.03 and 1.04, while the 45 pairs together gave 1.09 (quartile ratios 1.13 and 1.13).
# --quick takes FRESH_PROCESS_ROUNDS.
SMALL_MODEL_FRESH_ROUNDS = 45

FIRST_STEPS = textwrap.dedent("""
    import json, sys, time, torch
    torch.manual_seed(0)
    width, batch = int(sys.argv[2]), int(sys.argv[3])
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                torch.nn.LayerNorm(2 * width), torch.nn.Linear(2 * width, width))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    data, target = torch.randn(batch, width), torch.randn(batch, width)
    if sys.argv[1] == "adaptive":
        import adaptive_eager as ae
        ae.enable()
    if sys.argv[1] == "eager, malloc tuned":
        from adaptive_eager.runtime.allocator import keep_freed_memory
        keep_freed_memory()
    started = time.perf_counter()
    for _ in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), target)
        loss.backward()
        opt.step()
    loss.item()
    print(json.dumps({"seconds": time.perf_counter() - started}))
""")


def _first_steps_process(mode: str, width: int, batch: int) -> float:
    """Seconds of one fresh process's first 20 steps, on empty caches of its own."""
    with tempfile.TemporaryDirectory(prefix="ae-fresh-") as cache:
        run = subprocess.run([sys.executable, "-c", FIRST_STEPS, mode, str(width), str(batch)],
                             env=child_env(cache), capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"the {mode} process failed:\n{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])["seconds"]


def _first_training_steps(width: int, batch: int, rounds: int) -> dict:
    """Medians of ``rounds`` pairs of fresh processes, each adaptive one with empty caches.
    Which of a pair runs first alternates: here the first process of a pair ran slower.
    A third process per round runs eager with the malloc thresholds that MALLOC_TUNING=1 has
    enable() set (Note [Allocator thresholds]): adaptive against it is the runtime's cost
    without that."""
    seconds = {"eager": [], "adaptive": [], "eager, malloc tuned": []}
    for round_ in range(rounds):
        for mode in sorted(seconds, reverse=round_ % 2 == 1):
            seconds[mode].append(_first_steps_process(mode, width, batch))
    eager, adaptive = seconds["eager"], seconds["adaptive"]
    return {"eager_s": statistics.median(eager), "adaptive_s": statistics.median(adaptive),
            "pairs": rounds, "quartile_ratios": _quartile_ratios(eager, adaptive),
            "eager_tuned_s": statistics.median(seconds["eager, malloc tuned"])}


def _quartile_ratios(eager: list, adaptive: list) -> tuple[float, float]:
    """Adaptive/eager at the first and third quartiles of each mode's process times: how far
    the row's median ratio would move if the processes had landed faster or slower."""
    # inclusive: the default (exclusive) method extrapolates past the data with few pairs
    eager_q = statistics.quantiles(eager, n=4, method="inclusive")
    adaptive_q = statistics.quantiles(adaptive, n=4, method="inclusive")
    return adaptive_q[0] / eager_q[0], adaptive_q[2] / eager_q[2]


def first_steps_small_mlp(quick: bool) -> dict:
    """~3 ms steps: interception costs most."""
    rounds = FRESH_PROCESS_ROUNDS if quick else SMALL_MODEL_FRESH_ROUNDS
    return _first_training_steps(256, 64, rounds)


def first_steps_wide_mlp(quick: bool) -> dict:
    """~50 ms steps: a compile competing for the cores would cost most."""
    return _first_training_steps(1024, 256, FRESH_PROCESS_ROUNDS)
