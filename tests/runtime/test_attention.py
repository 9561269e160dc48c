"""Attention under the runtime: without dropout it fuses with the ops around it (Note [Random
only through dropout]); with dropout it stays eager and draws the same masks as eager."""
import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae
from helpers import assert_equal, run_both


def _attention(dropout_p):
    def step(state):
        q, k, v = state
        out = F.scaled_dot_product_attention(q.sin(), k.cos(), v, dropout_p=dropout_p,
                                             is_causal=True)
        return (out * 2).relu()
    return step


def _state():
    torch.manual_seed(0)
    return [torch.randn(2, 4, 16, 8) for _ in range(3)]


def test_attention_without_dropout_fuses_and_equals_eager(compiler):
    eager, adaptive, _, _ = run_both(_state, _attention(0.0), iters=5)
    assert_equal(adaptive, eager, bitwise=True)
    fused = [str(node.target) for graph in compiler.graphs for node in graph.graph.nodes]
    assert any("_scaled_dot_product_flash_attention_for_cpu" in name for name in fused), fused
    assert ae.stats().fallbacks.get("random", 0) == 0, ae.stats()


def test_attention_with_dropout_stays_eager_and_draws_eager_masks(compiler):
    def both(step):
        torch.manual_seed(1)
        first = [step(_state()) for _ in range(4)]
        return first
    eager = both(_attention(0.5))
    with ae.enabled():
        adaptive = both(_attention(0.5))
    assert_equal(adaptive, eager, bitwise=True)
    assert ae.stats().fallbacks.get("random", 0) >= 4, ae.stats()


@pytest.mark.inductor
def test_attention_without_dropout_compiles_with_inductor():
    eager, adaptive, _, _ = run_both(_state, _attention(0.0), iters=5)
    assert_equal(adaptive, eager)
    assert ae.stats().fused_executions >= 2 and ae.stats().compile_failures == 0, ae.stats()
