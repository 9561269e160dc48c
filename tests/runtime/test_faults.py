"""Faults (injected with adaptive_eager.faults): whatever breaks, the program's results are
eager's, the reason is counted, and the runtime goes on."""
import logging
import os
import shutil
import sqlite3

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.runtime import engine
from adaptive_eager.runtime.entries import KeyState
from adaptive_eager.testing import faults
from helpers import assert_equal, chain, other


def in_place(x):
    x.mul_(2).add_(1).sin_()
    return x


def _states():
    return {entry.state for entry in engine.shared_table().entries()}


def _run(step, x, times=6):
    with ae.enabled():
        return [step(x) for _ in range(times)]


def test_the_switch_rejects_unknown_faults():
    with pytest.raises(ValueError, match="unknown faults"):
        with faults.inject("power_cut"):
            pass
    assert not faults.active("compile_error")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "worker"])
def test_a_raising_compiler_is_a_counted_per_op_fallback(asynchronous):
    x = torch.randn(64)
    with faults.inject("compile_error"), config.patch(ASYNC=asynchronous):
        with ae.enabled():
            outs = [chain(x) for _ in range(4)]
            ae.sync(wait_compiles=120)
            outs += [chain(x) for _ in range(2)]
    assert _states() == {KeyState.FAILED}
    stats = ae.stats()
    assert stats.compile_failures == 1 and stats.fallbacks["compile_failed"] == 1
    assert stats.fused_executions == 0
    for out in outs:
        assert_equal(out, chain(x))


@pytest.mark.parametrize("fault", ["wrong_arity", "wrong_values"])
@pytest.mark.parametrize("step", [chain, in_place], ids=["chain", "in_place"])
def test_a_broken_kernel_never_reaches_the_results(fault, step):
    """wrong_arity raises when called; wrong_values writes garbage of the wrong shape into
    every tensor it gets (outputs and inputs): the first fused run is checked against per-op
    execution (Note [Probation]), so neither is ever seen."""
    x = torch.randn(64)
    eager_x, adaptive_x = x.clone(), x.clone()
    expected = [step(eager_x).clone() for _ in range(6)]
    with faults.inject(fault), ae.enabled():
        got = [step(adaptive_x).clone() for _ in range(6)]
    assert_equal(got, expected)
    assert_equal(adaptive_x, eager_x)
    [entry] = engine.shared_table().entries()
    reason = "kernel_error" if fault == "wrong_arity" else "kernel_mismatch"
    assert entry.state is KeyState.FAILED and entry.reason.startswith(reason)
    assert ae.stats().fallbacks[reason] == 1 and ae.stats().fused_executions == 0


def test_a_good_kernel_passes_probation_once():
    x = torch.randn(64)
    with ae.enabled():
        outs = [chain(x) for _ in range(6)]
        ae.sync()
        [entry] = engine.shared_table().entries()
        assert entry.state is KeyState.READY and ae.stats().fused_executions == 4
        [variant] = [v for v in engine.shared_table().kernels.values()]
        assert not variant.on_probation
    for out in outs:
        assert_equal(out, chain(x))


def masked(x):
    """Dropout's pattern: an empty_like that the random op after it fills (what it holds
    before is undefined, in eager too)."""
    y = (x * 2).sin()
    mask = torch.empty_like(y)
    mask.bernoulli_(0.5)
    return y * mask


@pytest.mark.parametrize("verify", ["off", "strict"])
def test_uninitialized_outputs_are_not_checked(verify):
    x = torch.randn(4096)
    torch.manual_seed(0)
    expected = [masked(x) for _ in range(6)]
    torch.manual_seed(0)
    with config.patch(VERIFY=verify), ae.enabled():
        got = [masked(x) for _ in range(6)]
        ae.sync()
        holding_the_buffer = [entry for entry in engine.shared_table().entries()
                              if any(op.func is torch.ops.aten.empty_like.default
                                     for op in entry.segment.ops)]
    assert_equal(got, expected)
    assert holding_the_buffer == []           # an uninitialized allocation is a boundary
    assert ae.stats().fallbacks["uninitialized"] >= 6
    assert "kernel_mismatch" not in ae.stats().fallbacks and ae.stats().fused_executions >= 3


def test_a_full_disk_means_one_warning_and_background_compiles_go_on(caplog):
    x = torch.randn(64)
    with faults.inject("disk_full"), config.patch(ASYNC=True), \
            caplog.at_level(logging.WARNING, logger="adaptive_eager"):
        with ae.enabled():
            outs = [chain(x) for _ in range(4)]
            ae.sync(wait_compiles=120)         # the worker ships through a temporary directory
            outs += [chain(x) for _ in range(4)]
            outs += [other(x) for _ in range(4)]
    engine.shared_table().flush()
    warnings = [m for m in caplog.messages if "going on without persisting" in m]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]
    assert ae.stats().compiles == 1 and ae.stats().fused_executions >= 3
    assert not os.path.exists(config.CACHE_DIR) or not _records(config.CACHE_DIR)
    for out in outs[:8]:
        assert_equal(out, chain(x))


def _records(directory):
    path = os.path.join(directory, "segments.sqlite")
    if not os.path.exists(path):         # nothing was ever written (lookups never create it)
        return {}
    with sqlite3.connect(path) as conn:
        return {row[0]: row[1] for row in conn.execute("SELECT digest, artifact FROM segments_v1")}


def test_a_cache_directory_deleted_while_running_is_recreated(caplog):
    x = torch.randn(64)
    with ae.enabled():
        for _ in range(4):
            chain(x)
        shutil.rmtree(config.CACHE_DIR)
        with caplog.at_level(logging.WARNING, logger="adaptive_eager"):
            outs = [other(x) for _ in range(4)]
            ae.sync()
            engine.shared_table().flush()
    records = _records(config.CACHE_DIR)
    other_key = next(e.digest for e in engine.shared_table().entries()
                     if e.segment.ops[0].func is torch.ops.aten.sub.Tensor)
    assert records[other_key] is not None                            # record and artifact
    assert os.path.exists(os.path.join(config.CACHE_DIR, "artifacts", "v1", records[other_key]))
    assert not any("without persisting" in m for m in caplog.messages)
    for out in outs:
        assert_equal(out, other(x))


def test_a_kernel_shipped_through_a_temporary_directory_leaves_nothing_behind(tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))      # the worker's temporary files
    os.makedirs(tmp_path / "tmp")
    x = torch.randn(64)
    with faults.inject("disk_full"), config.patch(ASYNC=True), ae.enabled():
        for _ in range(4):
            chain(x)
        ae.sync(wait_compiles=120)
        assert ae.stats().compiles == 1
    assert os.listdir(tmp_path / "tmp") == []
