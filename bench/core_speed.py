"""Eager vs adaptive steady state, side by side in one process (issue: core runtime).

    python bench/core_speed.py [--sizes 4096 1048576 8388608] [--iters 20]

For each workload and size: warm up under the runtime until its segment runs fused, then time
eager and adaptive steps in alternating blocks (so machine noise hits both) and print medians
and the eager/adaptive ratio (>1 means adaptive is faster).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import adaptive_eager as ae
from adaptive_eager.benchmarks.workloads import layernorm_gelu_residual, pointwise_chain

WORKLOADS = {"chain8": pointwise_chain, "ln_gelu_residual": layernorm_gelu_residual}


def _time_steps(step, count: int, adaptive: bool) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        result = step()             # kept alive, as a user would, so it must be computed
        if adaptive:
            ae.sync()
        times.append(time.perf_counter() - started)
        del result
    return times


def measure(name: str, numel: int, iters: int) -> dict:
    step = WORKLOADS[name](numel)
    expected = step()
    ae.reset()
    with ae.enabled():
        for _ in range(8):                      # record, turn hot, start compiling
            got = step()
        ae.sync(wait_compiles=600)              # the kernel is swapped in...
        for _ in range(6):                      # ...runs, and is judged profitable or not
            got = step()
        ae.sync()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        before = ae.stats().fused_executions
        eager, adaptive = [], []
        for _ in range(max(1, iters // 5)):     # alternate blocks of 5
            with ae.paused():
                eager += _time_steps(step, 5, adaptive=False)
            adaptive += _time_steps(step, 5, adaptive=True)
        fused = ae.stats().fused_executions - before
    eager_ms = statistics.median(eager) * 1e3
    adaptive_ms = statistics.median(adaptive) * 1e3
    return {"workload": name, "numel": numel, "eager_ms": eager_ms, "adaptive_ms": adaptive_ms,
            "speedup": eager_ms / adaptive_ms, "fused_runs": fused, "timed_runs": len(adaptive)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 1 << 20, 8 << 20])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--workload", nargs="+", default=list(WORKLOADS))
    options = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'workload':<18}{'elements':>10}{'eager ms':>11}{'adaptive ms':>13}{'speedup':>9}"
          f"{'fused':>8}")
    for name in options.workload:
        for numel in options.sizes:
            row = measure(name, numel, options.iters)
            print(f"{row['workload']:<18}{row['numel']:>10}{row['eager_ms']:>11.3f}"
                  f"{row['adaptive_ms']:>13.3f}{row['speedup']:>8.2f}x"
                  f"{row['fused_runs']:>5}/{row['timed_runs']}", flush=True)


if __name__ == "__main__":
    main()
