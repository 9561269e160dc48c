"""A user's torch.compile'd function called under the runtime, against the same call without it.

    python bench/compiled_call.py [--numel 4096] [--calls 2000]

Compiled code runs with the interception off (Note [Dynamo and the key] in
dispatch/interceptor.py); what remains is the call's wrapper. Prints the median µs per call
plain, under the runtime on each backend, and how many times Dynamo compiled (a recompile
caused by the runtime's thread state would show as more than one).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.dispatch import native


def _per_call_us(fn, x: torch.Tensor, calls: int) -> float:
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls // 5):
            fn(x)
        samples.append((time.perf_counter() - started) / (calls // 5) * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000)
    options = parser.parse_args()
    native.prepare(wait_s=native.BUILD_TIMEOUT_S)
    frames = {"compiles": 0}

    def counting_backend(graph, example_inputs):
        frames["compiles"] += 1
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(graph, example_inputs)

    @torch.compile(backend=counting_backend)
    def fn(x):
        return (x.sin() * 2 + x.cos()).relu()

    x = torch.randn(options.numel)
    fn(x)
    rows = [("plain", _per_call_us(fn, x, options.calls), frames["compiles"])]
    for backend in ("cpp", "python"):
        with config.patch(BACKEND=backend), ae.enabled():
            fn(x)
            rows.append((f"under the runtime ({ae.stats().backend})",
                         _per_call_us(fn, x, options.calls), frames["compiles"]))
    plain = rows[0][1]
    print(f"torch.compile'd 4-op function on {options.numel} elements, "
          f"torch {torch.__version__}")
    print(f"{'call':<30}{'us/call':>9}{'x plain':>9}{'compiles so far':>17}")
    for name, micros, compiles in rows:
        print(f"{name:<30}{micros:>9.1f}{micros / plain:>9.2f}{compiles:>17}")


if __name__ == "__main__":
    main()
