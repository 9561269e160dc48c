"""Note [Kernels that do not pay while paused]: the ledger's verdict, both ways."""
import pytest

from adaptive_eager.runtime.paused_kernels import (DIVERGENCE_S, LEDGER_OPS,
                                                   PASS_THROUGH_S_PER_OP, KernelLedger)


def _cost_s(ops: int, divergences: int) -> float:
    return ops * PASS_THROUGH_S_PER_OP + divergences * DIVERGENCE_S


def test_no_verdict_before_a_ledgers_worth_of_ops():
    ledger = KernelLedger(divergences_at=0)
    assert not ledger.count_ops(LEDGER_OPS - 1)
    assert ledger.count_ops(1)


@pytest.mark.parametrize("saving_factor, pays", [(1.5, True), (0.5, False)])
def test_kernels_pay_when_their_runs_saved_what_keeping_them_cost(saving_factor, pays):
    ledger = KernelLedger(divergences_at=100)
    ledger.count_ops(LEDGER_OPS)
    cost = _cost_s(LEDGER_OPS, 40)
    ledger.credit(cost * saving_factor / 10, runs=10)
    assert ledger.cost_s(divergences_now=140) == pytest.approx(cost)
    assert ledger.pays(divergences_now=140) is pays


def test_each_window_starts_empty():
    ledger = KernelLedger(divergences_at=0)
    ledger.count_ops(LEDGER_OPS)
    ledger.credit(1.0, runs=1)
    assert ledger.pays(divergences_now=10)
    assert (ledger.ops, ledger.saved_s, ledger.divergences_at) == (0, 0.0, 10)
    ledger.count_ops(LEDGER_OPS)
    assert not ledger.pays(divergences_now=10)        # nothing saved in this one


def test_a_negative_saving_credits_nothing():
    ledger = KernelLedger(divergences_at=0)
    ledger.credit(-1.0, runs=3)
    assert ledger.saved_s == 0.0
