"""Hot thresholds, negative entries, segment cuts: what gets compiled and what does not."""
import subprocess
import sys

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.runtime import engine
from adaptive_eager.runtime.compiler import use_compiler
from adaptive_eager.runtime.entries import KeyState
from adaptive_eager.testing import CountingCompiler
from helpers import assert_equal, chain


def _entries():
    return engine.shared_table().entries()


def test_a_key_compiles_once_at_the_hot_threshold(compiler):
    x = torch.randn(8)
    with config.patch(HOT_THRESHOLD=3), ae.enabled():
        chain(x)
        chain(x)
        ae.sync()
        assert compiler.count == 0
        for _ in range(6):
            chain(x)
        ae.sync()
        [entry] = _entries()
        assert entry.state is KeyState.READY and len(entry.digest) == 16
    assert compiler.count == 1
    stats = ae.stats()
    assert stats.hot_keys == 1 and stats.compiles == 1 and stats.keys_seen == 1


def test_compile_failure_is_a_counted_negative_entry():
    x = torch.randn(8)
    with use_compiler(CountingCompiler(fail_with=RuntimeError)) as failing, ae.enabled():
        outs = [chain(x) for _ in range(8)]
    assert failing.count == 1                      # never retried
    stats = ae.stats()
    assert stats.compile_failures == 1 and stats.fallbacks["compile_failed"] == 1
    assert stats.fused_executions == 0
    [entry] = _entries()
    assert entry.state is KeyState.FAILED and "RuntimeError" in entry.reason
    for out in outs:
        assert_equal(out, chain(x))


def test_kernel_failing_at_run_time_falls_back_per_op():
    def broken_kernel(*tensors):
        raise RuntimeError("kernel exploded")

    class BrokenCompiler(CountingCompiler):
        def compile(self, graph, example_inputs):
            super().compile(graph, example_inputs)
            return broken_kernel

    x = torch.randn(8)
    with use_compiler(BrokenCompiler()), ae.enabled():
        outs = [chain(x) for _ in range(6)]
    for out in outs:
        assert_equal(out, chain(x))
    [entry] = _entries()
    assert entry.state is KeyState.FAILED and "kernel exploded" in entry.reason
    assert ae.stats().fallbacks["kernel_error"] == 1


def test_a_loop_that_drops_its_results_fuses_under_the_key_that_keeps_them(compiler):
    # Note [Results thrown away]: with nothing live, the final result counts as live, so the
    # timing loop and the loop that keeps its result are one key and one compile.
    x = torch.randn(8)
    with ae.enabled():
        for _ in range(4):
            chain(x)
        kept = [chain(x) for _ in range(3)]
        ae.sync()
        [entry] = _entries()
        assert entry.state is KeyState.READY and entry.segment.live_refs == (("out", 4, 0),)
    assert compiler.count == 1 and ae.stats().fused_executions >= 4
    for out in kept:
        assert_equal(out, chain(x))


def test_single_ops_are_not_worth_fusing(compiler):
    x = torch.randn(8)
    with ae.enabled():
        for _ in range(4):
            x.sin().sum().item()            # sin + sum, cut by item(): 2 ops, fused
            x.sum().item()                  # one op alone: nothing to fuse
        states = {tuple(str(op.func) for op in e.segment.ops): e for e in _entries()}
        assert states[("aten.sin.default", "aten.sum.default")].state is KeyState.READY
    alone = states[("aten.sum.default",)]
    assert alone.state is KeyState.UNFUSIBLE and alone.reason == "too_few_ops"
    assert ae.stats().fallbacks["too_few_ops"] == 1 and compiler.count == 1


def _states_with(op_name: str) -> list:
    return [(e.state, e.reason) for e in _entries()
            if any(str(op.func) == op_name for op in e.segment.ops)]


def test_an_lstm_under_autograd_is_not_compiled_into_a_kernel_inductor_cannot_run(compiler):
    """Inductor (torch 2.13) compiles ``mkldnn_rnn_layer`` under autograd into a kernel that
    raises when run: the compile (10 s) would only end per-op. Under no_grad it compiles."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(8, 16, batch_first=True)
    x = torch.randn(2, 5, 8)
    with ae.enabled():
        trained = [lstm(x)[0] for _ in range(4)]
        training = _states_with("aten.mkldnn_rnn_layer.default")
        ae.reset()
        with torch.no_grad():
            inferred = [lstm(x)[0] for _ in range(4)]
        inference = _states_with("aten.mkldnn_rnn_layer.default")
    # (the first step's key may be seen once: its first two ops are each a call that comes
    # again, so where a loop's segments start settles in its first steps)
    assert (KeyState.UNFUSIBLE, "compiler_unsupported") in training
    assert all(state in (KeyState.UNFUSIBLE, KeyState.COLD) for state, _ in training)
    assert KeyState.READY in [state for state, _ in inference]
    assert all(state in (KeyState.READY, KeyState.COLD) for state, _ in inference)
    assert compiler.count == 1                                # inference's kernel only
    expected = lstm(x)[0]
    for out in trained + inferred:
        assert_equal(out.detach(), expected.detach())


def test_segments_are_cut_at_max_length(compiler):
    x = torch.randn(8)

    def long_body(x):
        for _ in range(10):
            x = x * 1.01 + 0.1
        return x
    with config.patch(MAX_SEGMENT_OPS=6), ae.enabled():
        for _ in range(4):
            got = long_body(x)
    assert all(len(e.segment.ops) <= 6 for e in _entries())
    assert_equal(got, long_body(x))


def test_loop_iterations_align_segments(compiler):
    x = torch.randn(8)
    with ae.enabled():
        for _ in range(6):
            y = chain(x)                   # no boundary between iterations
    assert ae.stats().keys_seen == 1
    [entry] = _entries()
    assert len(entry.segment.ops) == 5
    assert_equal(y, chain(x))


def test_compile_off_records_and_keys_but_never_compiles(compiler):
    x = torch.randn(8)
    with config.patch(COMPILE=False), ae.enabled():
        outs = [chain(x) for _ in range(6)]
    stats = ae.stats()
    assert compiler.count == 0 and stats.compiles == 0 and stats.fused_executions == 0
    assert stats.keys_seen == 1 and stats.hot_keys == 1
    assert stats.fallbacks["compile_disabled"] == 1
    [entry] = _entries()
    assert entry.state is KeyState.HOT and entry.reason == "compile_disabled"
    for out in outs:
        assert_equal(out, chain(x), bitwise=True)


def test_stats_is_a_frozen_record():
    stats = ae.stats()
    try:
        stats.ops_seen = 5
    except Exception as err:
        assert "frozen" in str(err) or "cannot assign" in str(err)
    else:
        raise AssertionError("Stats should be frozen")
    as_dict = stats.as_dict()
    for name in ("ops_seen", "segments_recorded", "keys_seen", "hot_keys", "compiles",
                 "compile_failures", "compile_seconds", "fused_executions",
                 "per_op_executions", "divergences", "fallbacks"):
        assert name in as_dict
    assert isinstance(as_dict["fallbacks"], dict)


def test_a_float32_grouped_mm_is_not_compiled(compiler):
    """Mixtral's experts in float32: eager runs ``_grouped_mm`` on the CPU, but the meta
    function Inductor traces with takes bfloat16 only, so every such compile failed."""
    offsets = torch.tensor([3, 8], dtype=torch.int32)
    experts = torch.randn(2, 8, 16).transpose(1, 2)

    def step(x):
        return torch._grouped_mm((x * 2).sin(), experts, offs=offsets).relu() + 1
    x = torch.randn(8, 16)
    with ae.enabled():
        got = [step(x) for _ in range(4)]
        states = _states_with("aten._grouped_mm.default")
    assert states and all(s == (KeyState.UNFUSIBLE, "compiler_unsupported") for s in states)
    assert compiler.count == 0
    for result in got:
        assert_equal(result, step(x))


def test_an_accumulating_index_put_on_cpu_is_not_compiled(compiler):
    """Falcon's backward: Inductor's CPU kernels of segments with index_put(accumulate=True)
    and one-element indices wrote past their output (Note [Accumulating index_put on the
    CPU]); they run per-op, as eager, and others still fuse."""
    index = torch.tensor([-2])

    def step(x, accumulate):
        grad = torch.ops.aten.index_put.default(x.new_zeros(2, 6, 8), [None, index],
                                                x[:, :1].sin(), accumulate)
        return grad * 2 + 1
    x = torch.randn(2, 6, 8)
    with ae.enabled():
        accumulated = [step(x, True) for _ in range(4)]
        states = _states_with("aten.index_put.default")
        ae.reset()
        assigned = [step(x, False) for _ in range(4)]
        assigned_states = _states_with("aten.index_put.default")
    assert states and all(s == (KeyState.UNFUSIBLE, "compiler_unsupported") for s in states)
    assert KeyState.READY in [state for state, _ in assigned_states]
    for actual, expected in ((accumulated, step(x, True)), (assigned, step(x, False))):
        for result in actual:
            assert torch.equal(result, expected)


INDUCTOR_INDEX_PUT = """
import torch
aten = torch.ops.aten
def f(x, y, i):
    v = (x * y).transpose(1, 2)
    return aten.index_put(v.new_zeros(2, 12, 6, 8), [None, None, i], v, True)
torch.manual_seed(0)
x, y = torch.randn(2, 1, 8, 12).transpose(2, 3), torch.randn(1, 1, 12, 8)
i = torch.tensor([-1])
print(float((torch.compile(f)(x, y, i) - f(x, y, i)).abs().max()))
"""


@pytest.mark.inductor
def test_inductor_still_miscompiles_the_accumulating_index_put():
    """Note [Accumulating index_put on the CPU], without the runtime, in a child process (the
    kernel writes past its output). When this fails, Inductor is fixed: drop the rule."""
    result = subprocess.run([sys.executable, "-c", INDUCTOR_INDEX_PUT], capture_output=True,
                            text=True, timeout=600)
    if result.returncode < 0:           # killed by a signal: the heap it wrote past
        return
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.split()[-1]) > 1.0, result.stdout      # wrong sums
