"""PyTorch's own op database (op_db, CPU float32 samples) through the runtime.

Per-op path: every sample, compared bitwise with eager. Where a sample differs, the oracle is
re-run under a do-nothing TorchDispatchMode: some composite ops (matmul's folding, svdvals, ...)
decompose differently under *any* Python dispatch mode, which no runtime built on one can
change; those are counted, not failed. Ops whose eager results differ run to run are skips,
listed below as data with their reason.

Fused path: a deterministic sample of ops, hot at first sight, compiled by the stand-in
compiler (all of them) and by real Inductor (a marked, smaller subset).
"""
from __future__ import annotations

import collections

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.dispatch.mode import PassThroughMode

common = pytest.importorskip("torch.testing._internal.common_methods_invocations")

SKIPS = {   # op name -> why its samples cannot be compared
    "empty": "uninitialized memory", "empty_like": "uninitialized memory",
    "empty_strided": "uninitialized memory", "empty_permuted": "uninitialized memory",
    "new_empty": "uninitialized memory", "new_empty_strided": "uninitialized memory",
    "nn.functional.embedding_bag": "eager differs run to run (parallel reduction)",
    "linalg.lstsq": "eager differs run to run (LAPACK driver)",
}


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _comparable(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach().resolve_conj()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.dtype.is_floating_point:
        tensor = tensor.double()
    return tensor


def _same(actual, expected, exact: bool) -> bool:
    left, right = _tensors(actual), _tensors(expected)
    if len(left) != len(right):
        return False
    for a, e in zip(left, right):
        if a.shape != e.shape or a.dtype != e.dtype:
            return False
        if a.layout != torch.strided:
            continue
        a, e = _comparable(a), _comparable(e)
        if exact:
            if not (torch.equal(a.isnan(), e.isnan())
                    and torch.equal(a.nan_to_num(), e.nan_to_num())):
                return False
        elif not torch.allclose(a, e, rtol=1e-4, atol=1e-5, equal_nan=True):
            return False
    return True


def _samples(ops):
    for op in ops:
        if op.name in SKIPS:
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float32))
        except Exception:                 # the database's own generator needs what we lack
            continue
        for sample in samples:
            yield op, sample


def _call(op, sample):
    torch.manual_seed(0)
    return op(sample.input, *sample.args, **sample.kwargs)


def _call_then_copy(op, sample):
    """The op, then a clone of each tensor it returns: at least two compute ops, so even a
    single-kernel op forms a segment the policy will compile."""
    result = _call(op, sample)
    return [t.clone() for t in _tensors(result)]


def _eager(op, sample):
    try:
        return True, _call(op, sample)
    except Exception:                     # invalid on purpose (error-input samples)
        return False, None


def test_every_sample_per_op_equals_eager():
    compared = mode_dependent = 0
    mismatches = []
    with config.patch(COMPILE=False):
        for op, sample in _samples(common.op_db):
            valid, expected = _eager(op, sample)
            if not valid:
                continue
            with ae.enabled():
                actual = _call(op, sample)
            compared += 1
            if _same(actual, expected, exact=True):
                continue
            with PassThroughMode():
                under_any_mode = _call(op, sample)
            if _same(actual, under_any_mode, exact=True):
                mode_dependent += 1
            else:
                mismatches.append(op.name)
    assert compared > 15000, compared
    assert mismatches == []
    assert mode_dependent < 100, mode_dependent


def _fused_sweep(ops, call=_call, runs=3, per_op=None):
    """Each sample hot at first sight and run ``runs`` times under the runtime (at most
    ``per_op`` samples per op); asserts no mismatch and no compile failure, returns
    (samples compared, samples that ran fused)."""
    compared, fused, mismatches, failed = 0, 0, [], []
    taken = collections.Counter()
    with config.patch(HOT_THRESHOLD=1):
        for op, sample in _samples(ops):
            if per_op is not None and taken[op.name] >= per_op:
                continue
            valid, expected = _eager(op, sample)
            if not valid:
                continue
            taken[op.name] += 1
            ae.reset()
            with ae.enabled():
                results = [call(op, sample) for _ in range(runs)]
            stats = ae.stats()
            compared += 1
            fused += stats.fused_executions > 0
            if stats.compile_failures:
                failed.append(op.name)
            if not all(_same(result, expected, exact=False) for result in results):
                mismatches.append(op.name)
    assert mismatches == [] and failed == [], (mismatches, failed)
    return compared, fused


# A deterministic sample across categories: pointwise, reductions, views, indexing, linalg,
# nn.functional (every third op of the database, in its own order).
SAMPLED_OPS = common.op_db[::3]


def test_sampled_ops_fused_with_the_stand_in_compiler(compiler):
    compared, fused = _fused_sweep(SAMPLED_OPS)
    assert compared > 4000 and fused > 1000, (compared, fused)
    assert compiler.count + compiler.loads >= fused       # the disk cache serves repeats


INDUCTOR_OPS = [op for op in common.op_db if op.name in {
    "add", "mul", "sigmoid", "tanh", "clamp", "where", "sum", "mean", "amax", "softmax",
    "log_softmax", "cumsum", "transpose", "narrow", "index_select", "gather", "addmm",
    "nn.functional.gelu", "nn.functional.layer_norm", "nn.functional.silu"}]


@pytest.mark.inductor
def test_a_few_ops_fused_by_inductor():
    """Two samples per op: a few minutes of real compiles."""
    compared, fused = _fused_sweep(INDUCTOR_OPS, call=_call_then_copy, runs=2, per_op=2)
    assert compared >= 30 and fused >= 10, (compared, fused)
