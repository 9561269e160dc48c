"""Real-model coverage: each architecture of ``architectures.py`` trains and generates under
the runtime as it does in plain eager PyTorch, the oracle.

For one architecture (``check_architecture``):

1. parity, with every hot segment fused (``FORCED``: no cost gates, no pausing, synchronous
   compiles, kernels kept even when unprofitable), so the kernels themselves are what is
   checked: ``TRAIN_STEPS`` AdamW steps from one initialisation (the model is built once and
   deep-copied) and the same seed, losses, gradients and parameters compared; then greedy
   ``generate()`` of ``NEW_TOKENS`` tokens with the default dynamic cache and with the static
   cache, tokens compared. Encoders only train.
2. timing, optional, with the default settings and an empty kernel cache (a user's first run):
   training steps and ``generate()`` calls alternate with eager ones in one process after a
   warm-up, and the medians' ratios are the steady time ratios.

``python -m adaptive_eager.benchmarks.coverage --arch llama --out result.json`` runs one
architecture in a fresh process (what ``adaptive-eager bench --coverage`` does for each).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import tempfile
import time
from typing import Callable

from adaptive_eager.benchmarks.architectures import BY_TYPE, FIRST_ID, VOCAB, Architecture

TRAIN_STEPS = 3
NEW_TOKENS = 32
PASS, FAIL, NOT_APPLICABLE = "pass", "fail", "n/a"
CACHES = ("dynamic", "static")
# Every hot segment compiled at once and kept: parity is checked on kernels, not on per-op runs.
FORCED = {"HOT_THRESHOLD": 2, "MIN_SEGMENT_US": 0, "MIN_US_PER_OP": 0, "MAX_EXTERN_PERCENT": 100,
          "KEEP_UNPROFITABLE": True, "ASYNC": False, "PAUSE": False, "COMPILE_COST_MS": 0}
TIMED_REPS = 5          # alternating eager / runtime pairs whose medians are compared
WARMUP_S = 3.0          # default settings: hot keys compile once their runs bank their cost
# After the compiles land, the runtime takes its new kernels in: it watches the steps again,
# records the segments they cut anew in Python and tries each kernel side by side (~10 of
# these tiny models' steps, at 2-10x eager's time). That is timed on its own, for SETTLE_S,
# and reported beside the steady ratio, which is timed after it.
SETTLE_S = 3.0


@dataclasses.dataclass(frozen=True)
class Check:
    """One parity check: ``train``, ``generate dynamic`` or ``generate static``."""

    name: str
    status: str                  # pass, fail, n/a
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Coverage:
    """What one architecture did under the runtime (JSON-able)."""

    name: str
    model_type: str
    kind: str
    checks: tuple
    ops_seen: int                # forced phase: every op the runtime saw
    fused_ops: int
    fallbacks: dict              # reason → count, forced phase
    timing: dict                 # name → {"eager_s", "runtime_s", "ratio", "fused_fraction"}

    @property
    def passed(self) -> bool:
        return all(check.status != FAIL for check in self.checks)

    @property
    def fused_fraction(self) -> float:
        return self.fused_ops / self.ops_seen if self.ops_seen else 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Coverage":
        checks = tuple(Check(**check) for check in data["checks"])
        return cls(**{**data, "checks": checks})


# ---------------------------------------------------------------------- comparing

def difference(actual, expected, bitwise: bool, rtol: float = 1e-4,
               atol: float = 1e-5) -> str | None:
    """None when ``actual`` equals ``expected`` (bitwise, or within the tolerance the test
    suite uses for fused results), else a sentence saying where they differ."""
    import torch
    if isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            return f"{len(actual)} items instead of {len(expected)}"
        for index, (a, e) in enumerate(zip(actual, expected)):
            found = difference(a, e, bitwise, rtol, atol)
            if found:
                return f"[{index}] {found}"
        return None
    if expected is None or actual is None:
        return None if actual is expected else f"{actual!r} instead of {expected!r}"
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"{tuple(actual.shape)} {actual.dtype} instead of {tuple(expected.shape)} " \
               f"{expected.dtype}"
    same = torch.equal(actual, expected) if bitwise else torch.allclose(
        actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    if same:
        return None
    if not actual.is_floating_point():
        return f"{int((actual != expected).sum())} of {actual.numel()} elements differ"
    return f"max abs diff {float((actual.double() - expected.double()).abs().max()):.3g}"


# ---------------------------------------------------------------------- the workloads

def inputs(seed: int = 0):
    """A batch of token ids (2 × 12) above the special ids."""
    import torch
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_ID, VOCAB, (2, 12), generator=generator)


def train(model, ids, steps: int = TRAIN_STEPS, seed: int = 1) -> dict:
    """``steps`` AdamW steps; the losses, and the last step's gradients."""
    import torch
    torch.manual_seed(seed)                  # the same dropout masks in both runs
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return {"losses": losses, "grads": [p.grad for p in model.parameters()]}


def generate(model, ids, cache: str):
    """Greedy decoding of ``NEW_TOKENS`` tokens with the ``dynamic`` or ``static`` cache."""
    import torch
    implementation = None if cache == "dynamic" else cache
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, cache_implementation=implementation)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def _check_train(model, bitwise: bool) -> Check:
    import adaptive_eager as ae
    eager_model, ids = copy.deepcopy(model), inputs()
    expected = train(eager_model, ids)
    try:
        with ae.enabled():
            actual = train(model, ids)
    except Exception as error:                 # noqa: BLE001 - eager ran: a runtime bug
        return Check("train", FAIL, f"raised under the runtime: {_first_line(error)}")
    for what, a, e in (("losses", actual["losses"], expected["losses"]),
                       ("gradients", actual["grads"], expected["grads"]),
                       ("parameters", list(model.parameters()), list(eager_model.parameters()))):
        found = difference([t.detach() if t is not None else t for t in a],
                           [t.detach() if t is not None else t for t in e], bitwise)
        if found:
            return Check("train", FAIL, f"{what} differ from eager: {found}")
    return Check("train", PASS)


def _check_generate(model, cache: str) -> Check:
    import adaptive_eager as ae
    name, ids = f"generate {cache}", inputs()[:1]
    try:
        expected = generate(model, ids, cache)
    except Exception as error:                 # noqa: BLE001 - transformers' own limit
        return Check(name, NOT_APPLICABLE, f"eager raises {_first_line(error)}")
    try:
        with ae.enabled():
            actual = generate(model, ids, cache)
    except Exception as error:                 # noqa: BLE001
        return Check(name, FAIL, f"raised under the runtime: {_first_line(error)}")
    found = difference(actual, expected, bitwise=True)
    return Check(name, PASS) if found is None else Check(name, FAIL, f"tokens: {found}")


def check_parity(arch: Architecture, bitwise: bool = False) -> list[Check]:
    """Train and generate, runtime vs eager, under the current settings and compiler."""
    model = arch.build()
    decoder = copy.deepcopy(model).eval()      # generation starts from the initial weights
    checks = [_check_train(model, bitwise)]
    if not arch.generates:
        return checks + [Check(f"generate {cache}", NOT_APPLICABLE, "encoder: no generate()")
                         for cache in CACHES]
    return checks + [_check_generate(decoder, cache) for cache in CACHES]


# ---------------------------------------------------------------------- steady timing

def _timed(call: Callable[[], object]) -> float:
    import adaptive_eager as ae
    started = time.perf_counter()
    call()
    ae.sync()                                  # deferred work belongs to this call
    return time.perf_counter() - started


def steady_ratio(eager_call, runtime_call, reps: int = TIMED_REPS) -> dict:
    """Warm the runtime up (compiles included), let it take its kernels in (SETTLE_S, timed),
    then alternate eager and runtime calls in one process: the medians and their ratio (> 1:
    the runtime is slower), and the settling calls' mean."""
    import adaptive_eager as ae
    before = ae.stats()
    with ae.enabled():
        deadline = time.perf_counter() + WARMUP_S
        while time.perf_counter() < deadline:
            runtime_call()
        ae.sync(wait_compiles=120)
        settling = _settle(runtime_call)
        eager, runtime = [], []
        for _ in range(reps):
            with ae.paused():
                eager.append(_timed(eager_call))
            runtime.append(_timed(runtime_call))
    after = ae.stats()
    seen = after.ops_seen - before.ops_seen
    eager_s, runtime_s = statistics.median(eager), statistics.median(runtime)
    return {"eager_s": eager_s, "runtime_s": runtime_s, "ratio": runtime_s / eager_s,
            "eager_spread": (max(eager) - min(eager)) / eager_s,    # the machine's noise
            "settling_s": statistics.mean(settling), "settling_calls": len(settling),
            "fused_fraction": (after.fused_ops - before.fused_ops) / seen if seen else 0.0}


def _settle(runtime_call) -> list[float]:
    """Runtime calls for SETTLE_S (at least 3) right after the compiles landed: their
    times."""
    times: list[float] = []
    deadline = time.perf_counter() + SETTLE_S
    while len(times) < 3 or time.perf_counter() < deadline:
        times.append(_timed(runtime_call))
    return times


def time_architecture(arch: Architecture) -> dict:
    """Steady ratios of a training step and of each cache's ``generate()``."""
    import torch
    model, ids = arch.build(), inputs()
    eager_model = copy.deepcopy(model)
    optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, eager_model)}

    def step(m):
        optimizers[m].zero_grad()
        m(input_ids=ids, labels=ids).loss.backward()
        optimizers[m].step()
    timing = {"train step": steady_ratio(lambda: step(eager_model), lambda: step(model))}
    if arch.generates:
        model.eval(), eager_model.eval()
        for cache in CACHES:
            timing[f"generate {cache}"] = steady_ratio(
                lambda: generate(eager_model, ids[:1], cache),
                lambda: generate(model, ids[:1], cache))
    return timing


# ---------------------------------------------------------------------- one architecture

def check_architecture(arch: Architecture, bitwise: bool = False,
                       timing: bool = False) -> Coverage:
    """Parity under FORCED settings (the current compiler), then optionally steady timing
    under the default settings."""
    import adaptive_eager as ae
    from adaptive_eager.config import config
    before = ae.stats()
    with config.patch(**FORCED):
        checks = check_parity(arch, bitwise)
    after = ae.stats()
    fallbacks = {reason: count - before.fallbacks.get(reason, 0)
                 for reason, count in after.fallbacks.items()
                 if count != before.fallbacks.get(reason, 0)}
    timings = {}
    if timing:
        # A user's first run: nothing known, no kernel of the forced phase in the cache.
        with tempfile.TemporaryDirectory(prefix="ae-coverage-timing-") as directory, \
                config.patch(CACHE_DIR=directory):
            ae.reset()
            timings = time_architecture(arch)
            ae.reset()
    return Coverage(arch.name, arch.model_type, arch.kind, tuple(checks),
                    after.ops_seen - before.ops_seen, after.fused_ops - before.fused_ops,
                    fallbacks, timings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one architecture of the coverage suite")
    parser.add_argument("--arch", required=True, choices=sorted(BY_TYPE))
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--no-timing", action="store_true")
    options = parser.parse_args(argv)
    result = check_architecture(BY_TYPE[options.arch], timing=not options.no_timing)
    with open(options.out, "w") as file:
        json.dump(result.as_dict(), file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
