"""Helpers for comparing the runtime against plain eager PyTorch, the oracle."""
from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch

import adaptive_eager as ae
from adaptive_eager.testing import CountingCompiler


def chain(x):
    """The tests' usual segment: five pointwise ops, one kernel once hot."""
    return ((x * 2 + 1).sin() * 3).cos()


def other(x):
    """A second segment: other ops than ``chain``'s, so another key."""
    return ((x - 1).exp() * 2).tanh()


def assert_equal(actual, expected, bitwise: bool = False) -> None:
    """Same structure and values; ``bitwise`` demands identical bits (compilation off)."""
    if isinstance(expected, torch.Tensor):
        assert type(actual) is type(expected), (type(actual), type(expected))
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        if bitwise:
            assert torch.equal(actual, expected) or (
                actual.isnan().equal(expected.isnan())
                and torch.equal(actual.nan_to_num(), expected.nan_to_num())), \
                f"max diff {(actual.double() - expected.double()).abs().max()}"
        else:
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_equal(a, e, bitwise)
    else:
        assert actual == expected


def run_both(make_state: Callable[[], object], step: Callable[[object], object], iters: int):
    """Run ``step`` ``iters`` times on two identical states, eagerly and under the runtime.

    Returns (eager results, adaptive results, eager state, adaptive state)."""
    eager_state = make_state()
    adaptive_state = copy.deepcopy(eager_state)
    eager_results = [step(eager_state) for _ in range(iters)]
    with ae.enabled():
        adaptive_results = [step(adaptive_state) for _ in range(iters)]
    return eager_results, adaptive_results, eager_state, adaptive_state


# Tests of the mechanics run tiny tensors, which the adaptive policy's cost gates would
# (rightly) keep per-op, and want compiles to happen now, in the test's thread. The
# fresh_runtime fixture applies these in-process; subprocesses get them as MECHANICS_ENV.
MECHANICS = {"MIN_SEGMENT_US": 0, "MIN_US_PER_OP": 0, "MAX_EXTERN_PERCENT": 100,
             "KEEP_UNPROFITABLE": True, "ASYNC": False, "PAUSE": False, "COMPILE_COST_MS": 0}
MECHANICS_ENV = {f"NEURON_ADAPTIVE_EAGER_{name}": str(int(value))
                 for name, value in MECHANICS.items()}


class FakeClock:
    """The runtime's clock (adaptive_eager.runtime.clock, Note [Clock]) as a test states it,
    one timeline for durations and deadlines. Time passes only while an aten op the runtime
    calls runs (``op_s`` each: seconds, or a function of (op, args)), and when the test
    ``advance``s it (the program's own time between ops, a pause waited out). The
    ``fake_clock`` fixture (conftest.py) installs one."""

    def __init__(self, op_s: float | Callable = 0.0) -> None:
        self.now = 0.0
        self.op_s = op_s
        self._stopped = 0

    def perf_counter(self) -> float:
        return self.now

    monotonic = perf_counter

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def ran(self, op, args: tuple) -> None:
        """``op`` ran (called from OpOverload.__call__ while the fixture is on)."""
        if not self._stopped:
            self.now += self.op_s(op, args) if callable(self.op_s) else self.op_s

    @contextlib.contextmanager
    def stopped(self):
        """Ops run meanwhile take no time (a kernel's own ops: TimedKernels states its time)."""
        self._stopped += 1
        try:
            yield
        finally:
            self._stopped -= 1


def by_size(seconds_per_element: float) -> Callable:
    """An ``op_s`` for FakeClock: an op takes this long per element of its largest tensor
    argument (large tensors compute for long, tiny ones for next to nothing)."""
    def op_s(op, args: tuple) -> float:
        sizes = [a.numel() for a in args if isinstance(a, torch.Tensor)]
        return seconds_per_element * max(sizes, default=1)
    return op_s


class TimedKernels(CountingCompiler):
    """The stand-in compiler, whose kernels run for ``seconds`` of ``clock`` each, whatever
    their ops would take."""

    def __init__(self, clock: FakeClock, seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds = clock, seconds

    def compile(self, graph, example_inputs):
        module = super().compile(graph, example_inputs)

        def kernel(*tensors):
            with self.clock.stopped():
                module(*tensors)
            self.clock.advance(self.seconds)
        return kernel


@contextlib.contextmanager
def results_held(table):
    """The compile worker's results wait, uncollected, until the block ends: what a test
    checks while compiles are in flight does not race a fast worker."""
    table.compiles._collect = lambda wait_s=0.0: None
    try:
        yield
    finally:
        del table.compiles._collect              # the method again
