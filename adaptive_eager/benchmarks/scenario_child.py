"""Measure one scenario of ``adaptive-eager bench --scenarios`` in this (fresh) process.

    python -m adaptive_eager.benchmarks.scenario_child --scenario tiny_chain [--quick] \
        --out DIR

Writes ``DIR/result.json``: eager and adaptive seconds and what explains them (compiles,
fused runs, ops intercepted). Each scenario is the function of its name below (MEASUREMENTS);
the parent (scenarios.py) knows what it promises and checks it. Eager and adaptive run the
same work, side by side in this process (the first-steps scenarios: each in fresh processes).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import adaptive_eager as ae
from adaptive_eager.benchmarks.first_steps import first_steps_small_mlp, first_steps_wide_mlp
from adaptive_eager.benchmarks.workloads import layernorm_gelu_residual, pointwise_chain
from adaptive_eager.config import config

STEPS, QUICK_STEPS = 2000, 500
# Rounds of the cases whose runs take tens of milliseconds, each the same work in both modes,
# in alternating order: single runs here vary by +-10%, so medians of few would decide a ratio.
ROUNDS = 9
# The tiny rows pause during warm-up, so both modes time the same eager code and what is left
# is this machine's noise: medians of 9 rounds of the batch-1 MLP gave 0.92-1.15 over 15 runs
# (1.11 in one with 0 ops intercepted). Their rounds are short (~0.1 s), so they take more.
TINY_ROUNDS = 21
# Each round of the new-length row starts a fresh runtime that watches its first 4 steps (~3 ms
# of ~60): medians of 9 rounds gave ratios from 1.01 to 1.19 in four runs of one process here.
VARIABLE_LENGTH_ROUNDS = 25


def _steps(quick: bool) -> int:
    return QUICK_STEPS if quick else STEPS


def _timed(fn, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        fn()
    return time.perf_counter() - started


def _side_by_side(step, steps: int, warmup: int, rounds: int = ROUNDS) -> dict:
    """Eager and adaptive seconds for ``steps`` steps after ``warmup`` under the runtime
    (medians of alternating rounds), and how many ops the runtime intercepted in its timed
    rounds. Once paused, both modes run the same plain eager code (0 intercepted), yet rounds
    of the tiny chain took 74-122 ms here: 3 rounds gave ratios from 0.93 to 1.19."""
    ae.reset()
    seconds = {False: [], True: []}
    with ae.enabled():
        _timed(step, warmup)
        seen_before = ae.stats().ops_seen
        for round_ in range(rounds):
            for adaptive in (False, True) if round_ % 2 == 0 else (True, False):
                with contextlib.nullcontext() if adaptive else ae.paused():
                    seconds[adaptive].append(_timed(step, steps))
        intercepted = ae.stats().ops_seen - seen_before
    return {"eager_s": statistics.median(seconds[False]),
            "adaptive_s": statistics.median(seconds[True]), "intercepted": intercepted}


# ---------------------------------------------------------------------- tiny tensors

def tiny_chain(quick: bool) -> dict:
    return _side_by_side(pointwise_chain(4096), _steps(quick), warmup=400, rounds=TINY_ROUNDS)


def tiny_mlp(quick: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x = torch.randn(1, 64)

    def step():
        with torch.no_grad():
            return model(x).argmax().item()
    return _side_by_side(step, _steps(quick), warmup=400, rounds=TINY_ROUNDS)


# ---------------------------------------------------------------------- changing shapes

@contextlib.contextmanager
def _empty_cache():
    """A round starts from an empty kernel cache: decisions stored by an earlier one (a
    kernel judged unprofitable) would change what it measures."""
    with tempfile.TemporaryDirectory(prefix="ae-bench-") as cache, config.patch(CACHE_DIR=cache):
        ae.reset()
        try:
            yield
        finally:
            ae.reset()


def new_length_every_step(quick: bool, rounds: int = VARIABLE_LENGTH_ROUNDS) -> dict:
    """``compiles``: the most in one round, each a fresh runtime (the bound is per runtime)."""
    steps = _steps(quick) // 10
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64))
    lengths = iter(())

    def step():
        with torch.no_grad():
            return block(torch.randn(4, next(lengths), 64)).sum().item()

    def timed(adaptive: bool) -> float:
        # Both modes get the same lengths (so the same work), each new to the runtime.
        nonlocal lengths
        lengths = iter(range(8, 8 + steps))
        with ae.enabled() if adaptive else contextlib.nullcontext():
            return _timed(step, steps)
    timed(adaptive=False)                         # the allocator meets every shape once
    seconds, compiles = {False: [], True: []}, []
    for round_ in range(rounds):                  # a fresh runtime and empty cache each round
        with _empty_cache():
            for adaptive in (False, True) if round_ % 2 == 0 else (True, False):
                seconds[adaptive].append(timed(adaptive))
            compiles.append(ae.stats().compiles)
    return {"eager_s": statistics.median(seconds[False]),
            "adaptive_s": statistics.median(seconds[True]), "compiles": max(compiles)}


def _until_judged(run, most: int = 12) -> None:
    """Call ``run`` until every kernel has been judged side by side with eager (Note [Side by
    side]: its first runs after the checked one alternate with per-op runs), so timed runs
    measure kernels, not their trial."""
    from adaptive_eager.runtime.engine import shared_table
    from adaptive_eager.runtime.entries import KeyState
    for _ in range(most):
        run()
        if all(entry.judged for entry in shared_table().entries()
               if entry.state is KeyState.READY):
            return


def recurring_lengths(quick: bool, rounds: int = 4) -> dict:
    """Bucketed sequence lengths (8 lengths, over and over): one generic kernel for all."""
    lengths = [256 * k for k in range(1, 9)]
    inputs = {length: torch.randn(4, length, 1024) for length in lengths}

    def block(x):
        return torch.nn.functional.layer_norm(torch.nn.functional.gelu(x) * 2 + x, (1024,))

    def cycle():
        for length in lengths:
            out = block(inputs[length])
            ae.sync()                                # with ``out`` alive: it is written
        return out
    ae.reset()
    eager, adaptive = [], []
    with ae.enabled():
        for _ in range(3):
            cycle()                                  # every length hot: one generic compile
        ae.sync(wait_compiles=600)
        _until_judged(cycle)                         # lengths the pause skipped get it now,
        for _ in range(rounds):                      # and each its checked run and trial
            with ae.paused():
                eager.append(_timed(cycle, 1))
            adaptive.append(_timed(cycle, 1))
    stats = ae.stats()
    return {"eager_s": statistics.median(eager), "adaptive_s": statistics.median(adaptive),
            "compiles": stats.compiles, "generic_kernels": stats.generic_kernels}


# ---------------------------------------------------------------------- large tensors

def _large(make, numel: int) -> dict:
    step = make(numel)

    def adaptive_step():
        out = step()
        ae.sync()
        return out
    ae.reset()
    eager, adaptive = [], []
    with ae.enabled():
        for _ in range(8):
            kept = step()
        ae.sync(wait_compiles=600)
        for _ in range(6):
            kept = step()
        ae.sync()
        del kept
        fused_before = ae.stats().fused_executions
        for _ in range(4):
            with ae.paused():
                eager.append(_timed(step, 5) / 5)
            adaptive.append(_timed(adaptive_step, 5) / 5)
        stats = ae.stats()
    # A row near 1.0x says why: how many timed runs were fused, and what ran per-op instead.
    return {"eager_s": statistics.median(eager), "adaptive_s": statistics.median(adaptive),
            "fused": f"{stats.fused_executions - fused_before}/20",
            "per_op": dict(stats.fallbacks)}


def large_chain8(quick: bool) -> dict:
    return _large(pointwise_chain, 8 << 20)


def large_ln_gelu_residual(quick: bool) -> dict:
    return _large(layernorm_gelu_residual, 8 << 20)


# ---------------------------------------------------------------------- the process

# What each scenario of scenarios.SCENARIOS measures, by its name.
MEASUREMENTS = {measure.__name__: measure for measure in (
    tiny_chain, tiny_mlp, new_length_every_step, first_steps_small_mlp, first_steps_wide_mlp,
    recurring_lengths, large_chain8, large_ln_gelu_residual)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", required=True, choices=list(MEASUREMENTS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True, help="directory for result.json")
    options = parser.parse_args(argv)
    measured = MEASUREMENTS[options.scenario](options.quick)
    with open(os.path.join(options.out, "result.json"), "w") as file:
        json.dump(measured, file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
