"""The Hugging Face architectures of the coverage suite, as data: tiny configs, random weights,
nothing downloaded. Chosen by use: the decoder LMs most fine-tuned and served, two
mixture-of-experts models (data-dependent routing), two encoder-decoders and two encoders.

Every config is as small as the architecture allows (2 layers, hidden 32, vocabulary 128) and
keeps the model's own defaults otherwise (dropout included: random ops run eagerly, so a seeded
run draws the same masks under the runtime as in eager).
"""
from __future__ import annotations

import dataclasses

DECODER, MOE, ENC_DEC, ENCODER = "decoder", "moe", "enc-dec", "encoder"
VOCAB = 128
# Token ids below FIRST_ID are special (pad 0, bos 1, eos 2); inputs are drawn above them.
FIRST_ID = 3
_SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# The field names most configs share (GPT-2 and others map them through attribute_map).
_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128,
           **_SPECIAL}
GQA = {**_COMMON, "num_key_value_heads": 2}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One row of the suite: ``model_type`` as transformers names it, ``kind`` (decoder, moe,
    enc-dec, encoder: encoders are trained only, they do not generate), the config fields."""

    name: str
    model_type: str
    kind: str
    fields: dict

    @property
    def generates(self) -> bool:
        return self.kind != ENCODER

    def build(self, seed: int = 0):
        """A freshly initialised model (seeded), in train mode."""
        import torch
        import transformers
        config = transformers.AutoConfig.for_model(self.model_type, **self.fields)
        auto = {ENC_DEC: transformers.AutoModelForSeq2SeqLM,
                ENCODER: transformers.AutoModelForMaskedLM}.get(self.kind,
                                                               transformers.AutoModelForCausalLM)
        torch.manual_seed(seed)
        return auto.from_config(config).train()


def _arch(name, model_type, kind=DECODER, base=GQA, **fields) -> Architecture:
    return Architecture(name, model_type, kind, {**base, **fields})


ARCHITECTURES: tuple[Architecture, ...] = (
    _arch("Llama", "llama"),
    _arch("Mistral", "mistral"),
    _arch("Qwen2", "qwen2"),
    _arch("Qwen3", "qwen3", head_dim=8),
    _arch("Gemma", "gemma", head_dim=8),
    _arch("Gemma 2", "gemma2", head_dim=8, sliding_window=16),
    _arch("Gemma 3", "gemma3_text", head_dim=8, sliding_window=16),
    _arch("Phi-2", "phi", base=_COMMON),
    _arch("Phi-3", "phi3"),
    _arch("StarCoder2", "starcoder2"),
    _arch("GPT-2", "gpt2", base=_COMMON, n_inner=64),
    _arch("GPT-J", "gptj", base=_COMMON, rotary_dim=4, n_inner=64),
    _arch("GPT-NeoX", "gpt_neox", base=_COMMON),
    _arch("GPT-BigCode", "gpt_bigcode", base=_COMMON, n_inner=64),
    _arch("Falcon", "falcon", base=_COMMON),
    _arch("OPT", "opt", base=_COMMON, ffn_dim=64, word_embed_proj_dim=32),
    _arch("Bloom", "bloom", base=_COMMON, n_head=4),
    _arch("Mixtral", "mixtral", kind=MOE, num_local_experts=4, num_experts_per_tok=2),
    _arch("Qwen2-MoE", "qwen2_moe", kind=MOE, num_experts=4, num_experts_per_tok=2,
          moe_intermediate_size=32, shared_expert_intermediate_size=32),
    _arch("Qwen3-MoE", "qwen3_moe", kind=MOE, head_dim=8, num_experts=4, num_experts_per_tok=2,
          moe_intermediate_size=32),
    _arch("T5", "t5", kind=ENC_DEC, base=_SPECIAL, vocab_size=VOCAB, d_model=32, d_ff=64,
          d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2, decoder_start_token_id=0),
    _arch("BART", "bart", kind=ENC_DEC, base=_SPECIAL, vocab_size=VOCAB, d_model=32,
          encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
          decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
          max_position_embeddings=128, decoder_start_token_id=2, forced_eos_token_id=None),
    _arch("BERT", "bert", kind=ENCODER, base=_COMMON),
    _arch("RoBERTa", "roberta", kind=ENCODER, base=_COMMON, max_position_embeddings=130),
)
BY_TYPE = {arch.model_type: arch for arch in ARCHITECTURES}
