"""AdamW's step alone, side by side in one process: eager ``foreach``, eager ``fused=True``,
the runtime (``foreach``, once its kernel landed) and ``torch.compile`` of the step.

    python bench/optimizer_step.py [--size medium] [--rounds 9] [--steps 20]

The parameters are those of the bench's GPT-2 (``hf_gpt2_train`` at ``--size``), each mode
on its own copy, with the same fixed gradients. Every mode runs the same number of steps, so
their parameters are compared at the end with eager ``foreach``'s: the largest relative
difference of each mode is printed, and the script exits 1 if the runtime's are not
``allclose`` to them (``RTOL``, ``ATOL``). Times are medians of ``--rounds`` blocks of
``--steps`` steps, the modes taking turns, so the machine's drift hits each alike.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

import adaptive_eager as ae
from adaptive_eager.benchmarks.workloads import GPT2

WARMUP_STEPS = 8          # the runtime's key turns hot and banks here; its compile is awaited
# Then the runtime runs alone this long, and on until no probe of its step judge is running
# (Note [Judged by the step]): the first probe starts 4 s after enable() and times some of its
# steps per-op, which a timed block of a few seconds would weigh as if it came every time.
SETTLE_S = 6.0
SETTLE_MOST_S = 60.0      # (a probe lasts at most a few dozen steps; this only bounds the wait)
RTOL, ATOL = 1e-5, 1e-6   # the fused kernel's float arithmetic may round differently


def _parameters(size: str) -> list[torch.Tensor]:
    from adaptive_eager.benchmarks.workloads import _gpt2
    model, _ = _gpt2(size, "cpu")
    generator = torch.Generator().manual_seed(1)
    for parameter in model.parameters():
        parameter.grad = torch.randn(parameter.shape, generator=generator) * 1e-2
    return list(model.parameters())


def _largest_difference(parameters: list, reference: list) -> float:
    with torch.no_grad():
        return max(float(((a - b).abs() / (b.abs() + ATOL)).max())
                   for a, b in zip(parameters, reference))


def _copy(parameters: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    copies = []
    for parameter in parameters:
        twin = torch.nn.Parameter(parameter.detach().clone())
        twin.grad = parameter.grad.clone()
        copies.append(twin)
    return copies


def _modes(parameters: list[torch.Tensor]) -> dict:
    """name -> (its parameters, its step, runs under the runtime?)"""
    modes = {}
    for name, options in (("eager foreach", dict(foreach=True)),
                          ("eager fused=True", dict(fused=True)),
                          ("runtime foreach", dict(foreach=True)),
                          ("torch.compile foreach", dict(foreach=True))):
        own = _copy(parameters)
        optimizer = torch.optim.AdamW(own, lr=1e-3, **options)
        step = optimizer.step
        if name.startswith("torch.compile"):
            step = torch.compile(optimizer.step)
        modes[name] = (own, step, name.startswith("runtime"))
    return modes


def _block(step, steps: int, intercepted: bool) -> float:
    """Seconds a step, over ``steps`` steps; the runtime's with its deferred work done."""
    context = ae.paused() if not intercepted else contextlib.nullcontext()
    with context:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        ae.sync()
        return (time.perf_counter() - started) / steps


def _settle(parameters: list[torch.Tensor]) -> None:
    """Run the runtime alone (SETTLE_S) on a twin of its optimizer: the same shapes, so the
    same key and kernel, while every mode's own parameters take the same number of steps."""
    step = torch.optim.AdamW(_copy(parameters), lr=1e-3, foreach=True).step
    started = time.perf_counter()
    while time.perf_counter() - started < SETTLE_S or (
            ae.stats().steps_on_trial and time.perf_counter() - started < SETTLE_MOST_S):
        step()
        ae.sync()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="medium", choices=sorted(GPT2))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    options = parser.parse_args(argv)
    try:
        parameters = _parameters(options.size)
    except ImportError:
        print("needs transformers: pip install '.[hf]'", file=sys.stderr)
        return 2
    modes = _modes(parameters)
    times: dict[str, list] = {name: [] for name in modes}
    with ae.enabled():
        for name, (_, step, intercepted) in modes.items():
            _block(step, WARMUP_STEPS, intercepted)        # torch.compile compiles here
        ae.sync(wait_compiles=300)                          # the runtime's kernel lands
        _settle(parameters)
        before = ae.stats()
        for _ in range(options.rounds):
            for name, (_, step, intercepted) in modes.items():
                times[name].append(_block(step, options.steps, intercepted))
        after = ae.stats()
    count = sum(p.numel() for p in parameters)
    print(f"AdamW step over GPT-2 {options.size}'s {len(parameters)} parameters "
          f"({count / 1e6:.1f}M elements), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; medians of {options.rounds} x {options.steps} steps")
    eager = statistics.median(times["eager foreach"])
    print(f"{'mode':<24}{'ms/step':>9}{'x eager foreach':>17}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<24}{median * 1e3:>9.2f}{median / eager:>17.2f}")
    fused_runs = after.fused_executions - before.fused_executions
    steps = options.rounds * options.steps
    print(f"runtime: {fused_runs} fused runs in {steps} steps, "
          f"{after.fused_ops - before.fused_ops} ops fused of "
          f"{after.ops_seen - before.ops_seen} seen")
    reference = modes["eager foreach"][0]
    for name, (own, _, _) in modes.items():
        print(f"{name}: parameters at most {_largest_difference(own, reference):.1e} "
              "(relative) from eager foreach's")
    if not all(torch.allclose(a, b, rtol=RTOL, atol=ATOL)
               for a, b in zip(modes["runtime foreach"][0], reference)):
        print(f"the runtime's parameters differ from eager foreach's beyond rtol={RTOL}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
