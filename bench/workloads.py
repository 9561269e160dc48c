"""Workloads shared by the benchmarks: each builds its inputs for a size and returns a step."""
from __future__ import annotations

from typing import Callable

import torch


def pointwise_chain(numel: int) -> Callable[[], torch.Tensor]:
    """8 pointwise ops on one fp32 tensor of ``numel`` elements."""
    x = torch.randn(numel)

    def step() -> torch.Tensor:
        y = x * 1.5
        y = y + 0.25
        y = torch.sin(y)
        y = y * y
        y = y - 0.5
        y = torch.tanh(y)
        y = y * 3.0
        return y + x
    return step


def layernorm_gelu_residual(numel: int, width: int = 1024) -> Callable[[], torch.Tensor]:
    """LayerNorm → GELU → residual add over a (numel / width, width) fp32 activation."""
    width = min(width, numel)
    x = torch.randn(numel // width, width)
    norm = torch.nn.LayerNorm(width)

    def step() -> torch.Tensor:
        with torch.no_grad():
            return torch.nn.functional.gelu(norm(x)) + x
    return step


WORKLOADS = {"chain8": pointwise_chain, "ln_gelu_residual": layernorm_gelu_residual}
