"""The benchmark workloads: a registry of name → builder(size, device) → Case.

A ``Case`` separates the computation (``fn``, what torch.compile compiles) from its arguments
(``inputs(i)``, built outside it), so every mode runs the same function on the same seeded
tensors: random ops inside a compiled graph would draw different numbers than eager.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

SIZES = ("tiny", "medium", "large")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How close a mode's output must be to eager's (torch.testing.assert_close)."""

    rtol: float
    atol: float


# Fused kernels reorder float arithmetic and use their own transcendental approximations;
# matmuls, reductions and optimizer steps add accumulation-order differences on top.
POINTWISE = Tolerance(rtol=1e-4, atol=1e-4)
REDUCTION = Tolerance(rtol=1e-3, atol=1e-3)


@dataclasses.dataclass(frozen=True)
class Case:
    """One workload at one size: iteration ``i`` is ``fn(*inputs(i))``; ``fresh_inputs``:
    ``inputs`` makes new tensors each iteration (else it hands back the same ones)."""

    fn: Callable[..., Any]
    inputs: Callable[[int], tuple]
    fresh_inputs: bool = False

    def step(self, iteration: int = 0) -> Any:
        return self.fn(*self.inputs(iteration))


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    description: str
    build: Callable[[str, str], Case]          # (size, device) -> Case
    shapes: Mapping[str, str]                  # size -> what it means, for tables and --list
    tolerance: Tolerance = REDUCTION           # how close to eager its outputs must be
    requires: str | None = None                # an optional module it needs...
    extra: str | None = None                   # ...and the package extra that installs it

    def missing_requirement(self) -> str | None:
        """A one-line reason this workload cannot run here, or None."""
        if self.requires is None or importlib.util.find_spec(self.requires) is not None:
            return None
        install = f" (pip install 'adaptive-eager[{self.extra}]')" if self.extra else ""
        return f"{self.requires} is not installed{install}"


def _same_every_time(*args) -> Callable[[int], tuple]:
    return lambda iteration: args


def _no_grad(module: nn.Module) -> Callable[..., torch.Tensor]:
    def forward(*args):
        with torch.no_grad():
            return module(*args)
    return forward


# ---------------------------------------------------------------------- pointwise and norms

CHAIN_NUMEL = {"tiny": 4096, "medium": 1 << 20, "large": 8 << 20}


def chain8(x: torch.Tensor) -> torch.Tensor:
    """8 pointwise ops on one tensor."""
    y = x * 1.5
    y = y + 0.25
    y = torch.sin(y)
    y = y * y
    y = y - 0.5
    y = torch.tanh(y)
    y = y * 3.0
    return y + x


def _build_chain8(size: str, device: str) -> Case:
    torch.manual_seed(0)
    x = torch.randn(CHAIN_NUMEL[size], device=device)
    return Case(chain8, _same_every_time(x))


def pointwise_chain(numel: int) -> Callable[[], torch.Tensor]:
    """chain8 on a fresh random fp32 tensor of ``numel`` elements, as a no-argument step."""
    x = torch.randn(numel)
    return lambda: chain8(x)


def _layernorm_gelu_case(numel: int, width: int, device: str) -> Case:
    width = min(width, numel)
    x = torch.randn(numel // width, width, device=device)
    norm = nn.LayerNorm(width).to(device)

    def ln_gelu_residual(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return F.gelu(norm(x)) + x
    return Case(ln_gelu_residual, _same_every_time(x))


def _build_ln_gelu_residual(size: str, device: str) -> Case:
    torch.manual_seed(0)
    return _layernorm_gelu_case(CHAIN_NUMEL[size], 1024, device)


def layernorm_gelu_residual(numel: int, width: int = 1024) -> Callable[[], torch.Tensor]:
    """LayerNorm → GELU → residual over a (numel / width, width) fp32 activation, as a step."""
    return _layernorm_gelu_case(numel, width, "cpu").step


# ---------------------------------------------------------------------- attention and blocks

ATTENTION = {"tiny": (1, 2, 16, 16), "medium": (4, 8, 128, 64), "large": (4, 8, 512, 64)}


def attention(q, k, v, mask) -> torch.Tensor:
    """Causal softmax attention written out, so the scale, mask and softmax are fusible."""
    scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5) + mask
    return torch.softmax(scores, dim=-1) @ v


def _causal_mask(length: int, device: str) -> torch.Tensor:
    return torch.full((length, length), float("-inf"), device=device).triu(1)


def _build_attention(size: str, device: str) -> Case:
    torch.manual_seed(0)
    batch, heads, length, dim = ATTENTION[size]
    q, k, v = (torch.randn(batch, heads, length, dim, device=device) for _ in range(3))
    return Case(attention, _same_every_time(q, k, v, _causal_mask(length, device)))


MLP = {"tiny": (1, 64), "medium": (64, 512), "large": (256, 1024)}   # batch, width


def _build_mlp(size: str, device: str) -> Case:
    torch.manual_seed(0)
    batch, width = MLP[size]
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                          nn.Linear(4 * width, width)).to(device).eval()
    x = torch.randn(batch, width, device=device)
    return Case(_no_grad(model), _same_every_time(x))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm self-attention + GELU MLP, written out: nn.TransformerEncoderLayer's
    inference fast path is one opaque aten op, which would leave nothing to fuse."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        mixed = attention(q, k, v, mask).transpose(1, 2).reshape(batch, length, width)
        x = x + self.proj(mixed)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


BLOCK = {"tiny": (1, 8, 32, 2), "medium": (4, 128, 256, 4), "large": (4, 256, 512, 8)}


def _build_transformer_block(size: str, device: str) -> Case:
    torch.manual_seed(0)
    batch, length, width, heads = BLOCK[size]
    block = TransformerBlock(width, heads).to(device).eval()
    x = torch.randn(batch, length, width, device=device)
    return Case(_no_grad(block), _same_every_time(x, _causal_mask(length, device)))


# ---------------------------------------------------------------------- training

TRAIN = {"tiny": (8, 32), "medium": (64, 256), "large": (256, 1024)}   # batch, width


def _build_train_step(size: str, device: str) -> Case:
    torch.manual_seed(0)
    batch, width = TRAIN[size]
    model = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.LayerNorm(2 * width),
                          nn.Linear(2 * width, width)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    data, target = (torch.randn(batch, width, device=device) for _ in range(2))

    def train_step(data, target):
        optimizer.zero_grad()
        loss = F.mse_loss(model(data), target)
        loss.backward()
        optimizer.step()
        # The parameters too: a wrong update shows there before it shows in the loss.
        return (loss.detach(), *(p.detach() for p in model.parameters()))
    return Case(train_step, _same_every_time(data, target))


# ---------------------------------------------------------------------- dynamic and tiny

VARIABLE = {"tiny": (16, 8), "medium": (256, 64), "large": (512, 256)}   # width, first length
VARIABLE_CYCLE = 128


def _build_variable_shape(size: str, device: str) -> Case:
    torch.manual_seed(0)
    width, first_length = VARIABLE[size]
    block = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)).to(device)

    def inputs(iteration: int) -> tuple:
        # A new sequence length every iteration (cycling, so pytest-benchmark's thousands of
        # rounds do not grow it without bound), the same tensor in every mode.
        generator = torch.Generator().manual_seed(iteration)
        length = first_length + iteration % VARIABLE_CYCLE
        x = torch.randn(4, length, width, generator=generator)
        return (x.to(device),)
    return Case(_no_grad(block.eval()), inputs, fresh_inputs=True)


TINY_LOOP = {"tiny": 16, "medium": 64, "large": 256}   # width of batch-1 layers


def _build_tiny_loop(size: str, device: str) -> Case:
    torch.manual_seed(0)
    width = TINY_LOOP[size]
    layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(4)).to(device).eval()

    def tiny_loop(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for _ in range(8):            # 32 module calls on one batch-1 row
                for layer in layers:
                    x = layer(x)
        return x
    return Case(tiny_loop, _same_every_time(torch.randn(1, width, device=device)))


# ---------------------------------------------------------------------- Hugging Face

GPT2 = {"tiny": dict(n_layer=2, n_embd=32, n_head=2, batch=1, length=16),
        "medium": dict(n_layer=4, n_embd=256, n_head=4, batch=2, length=128),
        "large": dict(n_layer=4, n_embd=384, n_head=6, batch=2, length=256)}


def _gpt2(size: str, device: str):
    """A GPT-2 LM of ``size`` with random weights (no dropout), and a batch of token ids."""
    import transformers
    torch.manual_seed(0)
    shape = dict(GPT2[size])
    batch, length = shape.pop("batch"), shape.pop("length")
    config = transformers.GPT2Config(**shape, vocab_size=2048, n_positions=length,
                                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(config).to(device)
    return model, torch.randint(0, config.vocab_size, (batch, length), device=device)


def _build_hf_gpt2(size: str, device: str) -> Case:
    model, ids = _gpt2(size, device)
    model.eval()

    def gpt2_logits(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits
    return Case(gpt2_logits, _same_every_time(ids))


def _build_hf_gpt2_train(size: str, device: str) -> Case:
    model, ids = _gpt2(size, device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def gpt2_train_step(ids: torch.Tensor):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        return (loss.detach(), *(p.detach() for p in model.parameters()))
    return Case(gpt2_train_step, _same_every_time(ids))


# ---------------------------------------------------------------------- the registry

def _shapes(table: Mapping[str, Any], describe: Callable[[Any], str]) -> dict[str, str]:
    return {size: describe(value) for size, value in table.items()}


def _numel(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("chain8", "8-op pointwise chain", _build_chain8,
             _shapes(CHAIN_NUMEL, lambda n: f"{_numel(n)} fp32"), POINTWISE),
    Workload("ln_gelu_residual", "LayerNorm+GELU+residual", _build_ln_gelu_residual,
             _shapes(CHAIN_NUMEL, lambda n: f"{_numel(n)} fp32, rows of 1024")),
    Workload("attention", "causal softmax attention", _build_attention,
             _shapes(ATTENTION, lambda s: "batch×heads×len×dim " + "×".join(map(str, s)))),
    Workload("mlp", "MLP inference (Linear-GELU-Linear)", _build_mlp,
             _shapes(MLP, lambda s: f"batch {s[0]}, width {s[1]}")),
    Workload("transformer_block", "transformer block inference", _build_transformer_block,
             _shapes(BLOCK, lambda s: f"batch {s[0]}, len {s[1]}, width {s[2]}, {s[3]} heads")),
    Workload("train_step", "MLP training step (fwd, bwd, AdamW foreach)", _build_train_step,
             _shapes(TRAIN, lambda s: f"batch {s[0]}, width {s[1]}")),
    Workload("variable_shape", "new sequence length every step", _build_variable_shape,
             _shapes(VARIABLE, lambda s: f"4×(len {s[1]}+i)×{s[0]}")),
    Workload("tiny_loop", "32 batch-1 Linear+Tanh calls", _build_tiny_loop,
             _shapes(TINY_LOOP, lambda w: f"1×{w}")),
    Workload("hf_gpt2", "Hugging Face GPT-2 logits (random weights)", _build_hf_gpt2,
             _shapes(GPT2, lambda s: f"{s['n_layer']} layers, width {s['n_embd']}, "
                                     f"batch {s['batch']}×{s['length']}"),
             requires="transformers", extra="hf"),
    Workload("hf_gpt2_train", "Hugging Face GPT-2 training step (AdamW foreach)",
             _build_hf_gpt2_train,
             _shapes(GPT2, lambda s: f"{s['n_layer']} layers, width {s['n_embd']}, "
                                     f"batch {s['batch']}×{s['length']}"),
             requires="transformers", extra="hf"),
)}
