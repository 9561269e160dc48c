"""Checking fused runs against per-op execution.

Note [Probation]: every new kernel's first fused run is checked, whatever the settings, so a
broken kernel (a miscompile, a callable that writes the wrong shapes) is caught before its
results are used: it is demoted and the per-op results are kept. That check allows the
rounding differences fusion brings (its error is measured against the outputs' magnitude, see
PROBATION_TOLERANCES); it is a guard against garbage, not a numerics audit.

Verify mode (NEURON_ADAPTIVE_EAGER_VERIFY) checks every fused run, with torch.testing's
tolerances.

Before the kernel runs, the segment is executed per-op on copies of its inputs; afterwards the
kernel's outputs, and the inputs it mutated, are compared with those results using dtype-aware
tolerances (torch.testing's defaults). On a mismatch the caller demotes the key and keeps the
per-op result; with VERIFY=strict it raises VerificationError.
"""
from __future__ import annotations

import torch

from adaptive_eager.dispatch.ops import UNINITIALIZED_OUTPUT_OPS
from adaptive_eager.dispatch.signature import tensor_args
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


# max |fused - per-op| / max |per-op|, per dtype, for the probation check of a new kernel.
PROBATION_TOLERANCES = {
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
    torch.float32: 1e-3,
    torch.float64: 1e-6,
    torch.complex64: 1e-3,
    torch.complex128: 1e-6,
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


def _magnitude(tensor: torch.Tensor) -> float:
    """The largest finite |value| (0 for empty and non-float tensors)."""
    if not tensor.numel() or not (tensor.is_floating_point() or tensor.is_complex()):
        return 0.0
    return float(tensor.abs().nan_to_num_(nan=0.0, posinf=0.0).max())


def _roughly_equal(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> bool:
    """The probation check: same NaNs, and an error small against the values' magnitude, or
    the segment's (``floor``): a sum of values that cancel out (the sum of a LayerNorm's
    output is ~0) differs between summation orders by rounding of its terms, not of it."""
    tolerance = PROBATION_TOLERANCES.get(actual.dtype)
    if tolerance is None:
        return torch.equal(actual, expected)
    if not actual.numel():
        return True
    if not torch.equal(actual.isnan(), expected.isnan()):
        return False
    if actual.dtype in (torch.float16, torch.bfloat16):    # differences could overflow
        actual, expected = actual.float(), expected.float()
    # In the tensors' own precision: float64 copies of 8M elements took seconds here. NaNs
    # match (checked above) and count as equal; so do equal infinities (inf - inf is NaN).
    error = float((actual - expected).abs().nan_to_num_(nan=0.0).max())
    scale = max(_magnitude(expected), floor, 1e-30)
    return error <= tolerance * scale


def _undefined_outputs(segment: Segment) -> set:
    """Outputs of ops that allocate without initializing that no later op of the segment
    touches: what they hold is undefined in eager too, so no run can be checked against
    another on them (dropout's ``empty_like``, filled by the ``bernoulli_`` after the
    segment, made every kernel of a checkpointed block with dropout fail its check)."""
    touched = {arg.ref for op in segment.ops for arg in tensor_args((op.args, op.kwargs))}
    return {("out", index, 0) for index, op in enumerate(segment.ops)
            if op.func._schema.name in UNINITIALIZED_OUTPUT_OPS} - touched


class Verification:
    def __init__(self, segment: Segment, inputs: list, probation: bool = False) -> None:
        self.segment = segment
        self._close = _roughly_equal if probation else _close
        self.kind = "kernel_mismatch" if probation else "verify_mismatch"
        self.copies = [t.clone() for t in inputs]          # before the kernel mutates any
        targets = [(ref, segment.out_meta(ref).empty()) for ref in segment.live_refs]
        run_eagerly(segment.ops, self.copies, targets)
        self.expected = [tensor for _, tensor in targets]
        undefined = _undefined_outputs(segment)
        self._compared = [index for index, ref in enumerate(segment.live_refs)
                          if ref not in undefined]
        self.max_error = 0.0
        self.reason = ""

    def passes(self, buffers: list, inputs: list) -> bool:
        outputs = [(buffers[index], self.expected[index]) for index in self._compared]
        pairs = outputs + list(zip(inputs, self.copies))
        close = self._close
        if close is _roughly_equal:
            floor = max((_magnitude(expected) for _, expected in pairs), default=0.0)
            close = lambda actual, expected: _roughly_equal(actual, expected, floor)  # noqa: E731
        bad = [(actual, expected) for actual, expected in pairs
               if actual.shape != expected.shape or not close(actual, expected)]
        if not bad:
            return True
        self.max_error = max(_max_error(actual, expected) for actual, expected in bad)
        self.reason = f"{self.kind}: max error {self.max_error:.3g}"
        return False

    def message(self, digest: str) -> str:
        ops = " → ".join(str(op.func) for op in self.segment.ops)
        return (f"fused segment {digest} differs from per-op execution: max error "
                f"{self.max_error:.3g} (ops: {ops})")

    def keep_per_op_result(self, buffers: list, inputs: list) -> None:
        """Overwrite what the kernel wrote with the per-op results."""
        for buffer, expected in zip(buffers, self.expected):
            buffer.copy_(expected)
        self.restore_inputs(inputs)

    def restore_inputs(self, inputs: list) -> None:
        """Undo what a kernel wrote into its inputs (inputs as per-op execution left them)."""
        for tensor, copy in zip(inputs, self.copies):
            if not torch.equal(tensor, copy):
                tensor.copy_(copy)
