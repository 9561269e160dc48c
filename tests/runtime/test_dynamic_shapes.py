"""Variable batch or sequence length: one shape-generic kernel serves every length of a loop
(Note [Generic kernels]); compiles stay bounded; values equal eager's."""
import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from helpers import assert_equal

LENGTHS = (8, 12, 16, 20, 24, 28)


def _block():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32))


def _run(model, lengths, batch=2):
    """One step per length: (input, output) pairs; ``.item()`` ends each step's segment."""
    pairs = []
    with torch.no_grad():
        for length in lengths:
            x = torch.randn(batch, length, 16)
            out = model(x)
            out.sum().item()
            pairs.append((x, out))
    return pairs


def _check(model, pairs):
    with torch.no_grad():
        for x, out in pairs:
            assert_equal(out, model(x))


def test_recurring_lengths_share_one_generic_kernel(compiler):
    model = _block()
    with ae.enabled():
        pairs = _run(model, LENGTHS * 8)
    stats = ae.stats()
    assert compiler.count == 1 and stats.compiles == 1 and stats.generic_kernels == 1
    assert stats.generic_instances == len(LENGTHS)
    assert stats.fused_executions >= 4 * len(LENGTHS)
    _check(model, pairs)


def test_a_new_length_runs_fused_from_its_second_step(compiler):
    model = _block()
    with ae.enabled():
        pairs = _run(model, LENGTHS * 4)
        fused = ae.stats().fused_executions
        pairs += _run(model, (40, 40, 52, 52))
    stats = ae.stats()
    assert stats.compiles == 1 and stats.generic_instances == len(LENGTHS) + 2
    assert stats.fused_executions == fused + 2          # the second step of 40 and of 52
    _check(model, pairs)


def test_ever_new_lengths_compile_nothing(compiler):
    model = _block()
    with ae.enabled():
        pairs = _run(model, range(8, 48))                # no shape comes twice: nothing hot
    assert compiler.count == 0 and ae.stats().generic_kernels == 0
    _check(model, pairs)


def test_another_batch_size_is_another_symbol_or_another_kernel(compiler):
    model = _block()
    with ae.enabled():
        pairs = _run(model, LENGTHS * 4)
        pairs += _run(model, LENGTHS * 4, batch=3)       # the batch never varied before
    stats = ae.stats()
    assert stats.generic_kernels == 1 and stats.compiles <= 1 + 3   # bounded, not per shape
    _check(model, pairs)


def test_a_generic_kernel_compiles_in_the_background_worker(compiler):
    model = _block()
    with config.patch(ASYNC=True, COMPILE_TIMEOUT_S=120), ae.enabled():
        pairs = _run(model, LENGTHS * 3)
        ae.sync(wait_compiles=120)
        pairs += _run(model, LENGTHS * 3)
    stats = ae.stats()
    assert stats.generic_kernels == 1 and stats.compiles == 1
    assert compiler.count == 0 and compiler.loads == 1        # compiled there, loaded here
    assert stats.fused_executions >= 2 * len(LENGTHS)
    _check(model, pairs)


@pytest.mark.inductor
def test_one_inductor_kernel_fuses_a_variable_length_loop():
    model = _block()
    with ae.enabled():
        pairs = _run(model, LENGTHS * 4)
    stats = ae.stats()
    assert stats.compiles == 1 and stats.generic_kernels == 1
    assert stats.fused_executions >= 2 * len(LENGTHS) and not stats.fallbacks.get("kernel_mismatch")
    _check(model, pairs)
