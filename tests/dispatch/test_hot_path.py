"""The C++ hot path (Note [The C++ hot path] in csrc/hot_path.cpp): settled kernels deferred and
launched from C++, everything else handed back to Python's engine; plain eager is the oracle.

These run with the counting stand-in compiler (its kernels run the recorded ops), so results
must be bitwise eager's; ``native_fused_executions`` shows the C++ path really ran.
"""
import numpy as np
import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.runtime import engine, native_plans
from helpers import assert_equal

pytestmark = pytest.mark.usefixtures("cpp_extension")


@pytest.fixture(autouse=True)
def cpp_backend():
    with config.patch(BACKEND="cpp"):
        yield


def chain(x, w):
    y = (x * 2.0 + w).relu()
    return (torch.sigmoid(y) * y - 1.5).tanh()


def test_a_settled_kernel_runs_from_cpp_and_equals_eager():
    x, w = torch.randn(64), torch.randn(64)
    with ae.enabled():
        outs = [chain(x, w) for _ in range(10)]
        stats = ae.stats()
    assert stats.backend == "cpp"
    assert stats.native_fused_executions >= 5, stats
    for out in outs:
        assert_equal(out, chain(x, w), bitwise=True)


def test_another_scalar_does_not_match_the_kernel():
    x, w = torch.randn(64), torch.randn(64)
    with ae.enabled():
        for _ in range(6):
            chain(x, w)
        got = ((x * 3.0 + w).relu(), (x * 2.0 + w).relu())    # 3.0: not the kernel's 2.0
        assert ae.stats().native_fused_executions >= 2
    assert_equal(got[0], (x * 3.0 + w).relu(), bitwise=True)
    assert_equal(got[1], (x * 2.0 + w).relu(), bitwise=True)


def test_an_intermediate_kept_alive_goes_to_python_and_stays_right():
    """A run whose live outputs no registered kernel writes is handed over (takeover): the
    Python engine replays it, records the new live set, and that kernel comes too."""
    x, w = torch.randn(64), torch.randn(64)

    def keep_both(x, w):
        y = (x * 2.0 + w).relu()
        return y, (torch.sigmoid(y) * y - 1.5).tanh()

    with ae.enabled():
        for _ in range(6):
            chain(x, w)
        native_before = ae.stats().native_fused_executions
        kept = [keep_both(x, w) for _ in range(8)]
        stats = ae.stats()
    expected = keep_both(x, w)
    for y, out in kept:
        assert_equal(y, expected[0], bitwise=True)
        assert_equal(out, expected[1], bitwise=True)
    assert stats.native_fused_executions > native_before + 2, stats   # the second kernel


def test_a_numpy_read_mid_loop_sees_filled_values():
    x, w = torch.randn(64), torch.randn(64)
    with ae.enabled():
        for _ in range(6):
            chain(x, w)
        out = chain(x, w)
        array = out.numpy()                    # no op: the escape runs the deferred kernel
        assert ae.stats().native_fused_executions >= 3
    np.testing.assert_array_equal(array, chain(x, w).numpy())


def test_a_view_is_all_the_program_keeps():
    x, w = torch.randn(8, 8), torch.randn(8, 8)

    def corner(x, w):
        return ((x * 2.0 + w).relu() * 3.0).t()[:2]

    with ae.enabled():
        views = [corner(x, w) for _ in range(8)]
        assert ae.stats().native_fused_executions >= 3
    for view in views:
        assert_equal(view, corner(x, w), bitwise=True)


def test_in_place_updates_of_inputs_match_eager_values_and_versions():
    def update(state, grad):
        state.mul_(0.9).add_(grad, alpha=0.1)

    eager_state, state, grad = torch.zeros(64), torch.zeros(64), torch.randn(64)
    for _ in range(10):
        update(eager_state, grad)
    with ae.enabled():
        for _ in range(10):
            update(state, grad)
        assert ae.stats().native_fused_executions >= 3
    assert_equal(state, eager_state, bitwise=True)
    assert state._version == eager_state._version


def test_gradients_through_cpp_fused_runs_equal_eager():
    w = torch.randn(64, requires_grad=True)
    x = torch.randn(64)

    def loss_grad(w):
        w.grad = None
        ((x * w).sigmoid() * 2.0 + w).pow(2).sum().backward()
        return w.grad.clone()

    expected = loss_grad(w)
    with ae.enabled():
        grads = [loss_grad(w) for _ in range(8)]
        assert ae.stats().native_fused_executions >= 3
    for grad in grads:
        assert_equal(grad, expected, bitwise=True)


def test_memory_shared_with_numpy_is_never_a_deferred_input():
    """Note [Outside memory]: such a tensor changes with no op (array[:] = ...)."""
    array = np.zeros(64, dtype=np.float32)
    w = torch.randn(64)
    with ae.enabled():
        shared = torch.from_numpy(array)
        for step in range(8):
            array[:] = step
            got = chain(shared, w)
            assert_equal(got, chain(torch.full((64,), float(step)), w), bitwise=True)


def test_a_dropped_kernel_leaves_the_cpp_hot_path():
    x, w = torch.randn(64), torch.randn(64)
    with ae.enabled():
        for _ in range(6):
            chain(x, w)
        assert native_plans.registered()
        table = engine.shared_table()
        for variant in list(native_plans._variants.values()):
            table.demote(variant, "kernel_error: dropped by the test")
        assert not native_plans.registered()
        native_before = ae.stats().native_fused_executions
        outs = [chain(x, w) for _ in range(4)]
        assert ae.stats().native_fused_executions == native_before
    for out in outs:
        assert_equal(out, chain(x, w), bitwise=True)


def test_pooled_memory_of_large_outputs_is_reused_only_when_free():
    """Outputs of 1 MiB and more come from a per-thread pool (as runtime/buffers.py does for
    Python's hot path): memory the program still holds, directly or through a view, is never
    handed out again."""
    x, w = torch.randn(512, 512), torch.randn(512, 512)
    expected = chain(x, w)
    with ae.enabled():
        kept, views = [], []
        for step in range(30):
            out = chain(x, w)
            if step % 3 == 0:
                kept.append(out)
            elif step % 3 == 1:
                views.append(out[::2])          # only a view of it stays
        assert ae.stats().native_fused_executions >= 15   # each of the 3 live sets
    for out in kept:
        assert_equal(out, expected, bitwise=True)
    for view in views:
        assert_equal(view, expected[::2], bitwise=True)


@pytest.mark.inductor
def test_a_judged_kernel_is_called_from_cpp_and_matches_eager():
    """Note [Launching from C++]: a loaded single-kernel artifact, once judged, runs without
    Python at all; its results are Inductor's (close to eager's, not bitwise)."""
    x = torch.randn(4096)
    with config.patch(ASYNC=True), ae.enabled():
        for _ in range(4):
            chain(x, x)
        ae.sync(wait_compiles=300)
        outs = [chain(x, x) for _ in range(30)]
        ae.sync()
        stats = ae.stats()
    assert stats.native_direct_executions >= 20, stats
    for out in outs:
        torch.testing.assert_close(out, chain(x, x))


def test_a_kernel_on_trial_runs_its_per_op_runs_in_cpp_and_they_equal_eager():
    """Note [Side by side]: the runs a kernel's trial wants per-op are replayed from C++
    (replay.cpp), timed, into the tensors the program holds; no run goes to Python's
    engine."""
    x, w = torch.randn(64), torch.randn(64)
    with config.patch(KEEP_UNPROFITABLE=False), ae.enabled():
        outs = [chain(x, w) for _ in range(16)]
        ae.sync()
        [entry] = engine.shared_table().entries()
        assert len(entry.control_samples) >= 2 and all(s > 0 for s in entry.control_samples)
        assert entry.judged
        stats = ae.stats()
    # recorded twice, and once more if the verdict dropped the kernel; never handed over
    assert stats.segments_recorded <= 3 and stats.divergences == 0, stats
    for out in outs:
        assert_equal(out, chain(x, w), bitwise=True)
