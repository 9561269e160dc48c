"""Hugging Face transformers models built from small configs (random weights, no downloads):
a decoder LM, an encoder and a seq2seq model train under the runtime as they do eagerly."""
import copy

import pytest
import torch

import adaptive_eager as ae
from helpers import assert_equal

transformers = pytest.importorskip("transformers")


def _gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=32, attn_pdrop=0.0, embd_pdrop=0.0,
                                     resid_pdrop=0.0, bos_token_id=0, eos_token_id=1)
    return transformers.GPT2LMHeadModel(config)


def _bert():
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100,
                                     max_position_embeddings=32, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(config)


def _t5():
    config = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64,
                                   num_heads=2, d_kv=16, vocab_size=100, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(config)


STEPS = 6


def _train(model, ids, steps=STEPS):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("make", [_gpt2, _bert, _t5], ids=["gpt2_decoder", "bert_encoder",
                                                        "t5_seq2seq"])
def test_hf_model_training_equals_eager(make):
    torch.manual_seed(0)
    model = make().train()
    eager_model = copy.deepcopy(model)
    ids = torch.randint(2, 100, (2, 12))
    eager_losses = _train(eager_model, ids)
    with ae.enabled():
        losses = _train(model, ids)
    assert_equal(losses, eager_losses)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert_equal(p, q)
        assert_equal(p.grad, q.grad)
    # At least a whole step's worth of ops ran fused (steps 1-2 record; a count of kernel
    # runs would fall as segments grow longer).
    stats = ae.stats()
    assert stats.fused_ops >= stats.ops_seen // STEPS, stats


def test_a_training_step_is_cut_alike_every_step_on_the_cpp_backend(default_backend):
    """Once its keys are known, a training step's cold plans run it whole, step after step:
    none misses, and no new key turns up (Note [Storages without Python objects]: autograd
    adds gradients in place under C++'s runs and Python's recording alike)."""
    if default_backend != "cpp":
        pytest.skip("the C++ backend cannot be built here")
    from adaptive_eager.config import config
    torch.manual_seed(0)
    model = _gpt2().train()
    ids = torch.randint(2, 100, (2, 12))
    with config.patch(COMPILE=False), ae.enabled():
        _train(model, ids, steps=4)            # recorded, then registered as cold plans
        before = ae.stats()
        _train(model, ids, steps=6)
        after = ae.stats()
    assert after.fallbacks.get("cold_plan_missed", 0) == \
        before.fallbacks.get("cold_plan_missed", 0), after
    assert after.keys_seen == before.keys_seen, after
