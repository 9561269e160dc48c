"""Decode loops: greedy ``generate()`` tokens per second on a small Llama, plain eager vs the
runtime (default settings, empty kernel cache) with the dynamic and the static cache, and vs
torch.compile (transformers' own compiled decode step) with the static cache.

    python -m adaptive_eager.benchmarks.decode --out decode.json

Per cache: the runtime warms up (compiles land), then eager, runtime and (static cache)
compiled calls alternate ``REPS`` times in this process; medians. Every mode's tokens are
checked against eager's.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

from adaptive_eager.benchmarks.architectures import GQA, DECODER, Architecture
from adaptive_eager.benchmarks.coverage import CACHES, NEW_TOKENS, WARMUP_S, generate

SMALL_LLAMA = Architecture("Llama (small)", "llama", DECODER, {
    **GQA, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
    "max_position_embeddings": 256})
PROMPT = 16
REPS = 7


def _compiled(model):
    """transformers' compiled decode step (as it does on GPUs), allowed on the CPU."""
    from transformers import CompileConfig
    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    model.generation_config.compile_config = config
    return model


def _timed(call) -> tuple[float, object]:
    import adaptive_eager as ae
    started = time.perf_counter()
    tokens = call()
    ae.sync()
    return time.perf_counter() - started, tokens


def measure(cache: str, with_compile: bool) -> dict:
    import torch

    import adaptive_eager as ae
    eager = SMALL_LLAMA.build().eval()
    runtime = copy.deepcopy(eager)
    ids = torch.randint(3, 1024, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    calls = {"eager": lambda: generate(eager, ids, cache),
             "runtime": lambda: generate(runtime, ids, cache)}
    if with_compile:
        compiled = _compiled(copy.deepcopy(eager))
        calls["compile"] = lambda: generate(compiled, ids, cache)
        calls["compile"]()                    # compiles (prefill runs plainly, as in eager)
    before = ae.stats()
    times = {name: [] for name in calls}
    mismatches = []
    with ae.enabled():
        deadline = time.perf_counter() + WARMUP_S
        while time.perf_counter() < deadline:
            calls["runtime"]()
        ae.sync(wait_compiles=120)
        for _ in range(3):
            calls["runtime"]()
        for _ in range(REPS):
            results = {}
            for name, call in calls.items():
                if name == "runtime":
                    times[name].append((result := _timed(call))[0])
                else:
                    with ae.paused():
                        times[name].append((result := _timed(call))[0])
                results[name] = result[1]
            mismatches += [name for name, tokens in results.items()
                           if not torch.equal(tokens, results["eager"])]
    after = ae.stats()
    seen = after.ops_seen - before.ops_seen
    return {"tokens_per_s": {name: NEW_TOKENS / statistics.median(t) for name, t in times.items()},
            "fused_fraction": (after.fused_ops - before.fused_ops) / seen if seen else 0.0,
            "compiles": after.compiles - before.compiles,
            "generic_instances": after.generic_instances - before.generic_instances,
            "mismatches": sorted(set(mismatches))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="decode tokens per second, small Llama")
    parser.add_argument("--out", required=True)
    options = parser.parse_args(argv)
    result = {cache: measure(cache, with_compile=cache == "static") for cache in CACHES}
    with open(options.out, "w") as file:
        json.dump(result, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
