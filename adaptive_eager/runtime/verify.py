"""Verify mode (NEURON_ADAPTIVE_EAGER_VERIFY): check each fused run against per-op execution.

Before the kernel runs, the segment is executed per-op on copies of its inputs; afterwards the
kernel's outputs, and the inputs it mutated, are compared with those results using dtype-aware
tolerances (torch.testing's defaults). On a mismatch the caller demotes the key and keeps the
per-op result; with VERIFY=strict it raises VerificationError.
"""
from __future__ import annotations

import torch

from adaptive_eager.runtime.graph import run_eagerly
from adaptive_eager.runtime.segment import Segment

# (rtol, atol) per dtype, as torch.testing.assert_close; other dtypes must match exactly.
TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


class VerificationError(RuntimeError):
    """A fused segment computed something else than its ops do one by one (VERIFY=strict)."""


def _max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.dtype.is_floating_point or actual.dtype.is_complex:
        difference = (actual.to(torch.complex128 if actual.is_complex() else torch.float64)
                      - expected).abs().nan_to_num(nan=0.0)
        return float(difference.max()) if difference.numel() else 0.0
    return float((actual != expected).sum())


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    rtol, atol = TOLERANCES.get(actual.dtype, (0.0, 0.0))
    return bool(torch.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True).all())


class Verification:
    def __init__(self, segment: Segment, inputs: list) -> None:
        self.segment = segment
        self.copies = [t.clone() for t in inputs]          # before the kernel mutates any
        targets = [(ref, segment.out_meta(ref).empty()) for ref in segment.live_refs]
        run_eagerly(segment.ops, self.copies, targets)
        self.expected = [tensor for _, tensor in targets]
        self.max_error = 0.0
        self.reason = ""

    def passes(self, buffers: list, inputs: list) -> bool:
        pairs = list(zip(buffers, self.expected)) + list(zip(inputs, self.copies))
        bad = [(actual, expected) for actual, expected in pairs if not _close(actual, expected)]
        if not bad:
            return True
        self.max_error = max(_max_error(actual, expected) for actual, expected in bad)
        self.reason = f"verify_mismatch: max error {self.max_error:.3g}"
        return False

    def message(self, digest: str) -> str:
        ops = " → ".join(str(op.func) for op in self.segment.ops)
        return (f"fused segment {digest} differs from per-op execution: max error "
                f"{self.max_error:.3g} (ops: {ops})")

    def keep_per_op_result(self, buffers: list, inputs: list) -> None:
        """Overwrite what the kernel wrote with the per-op results."""
        for buffer, expected in zip(buffers, self.expected):
            buffer.copy_(expected)
        for tensor, copy in zip(inputs, self.copies):
            if not torch.equal(tensor, copy):
                tensor.copy_(copy)
