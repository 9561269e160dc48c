"""Is a hot segment worth a kernel at all? ``unfusible_reason`` says why not, as a counted reason.

Too few compute ops, an op whose Inductor kernel is known to fail, ops too cheap for any
kernel to beat eager, time spent mostly in extern ops (Note [Predicted saving],
runtime/scheduling.py), or an output that overlaps itself.
"""
from __future__ import annotations

import math

import torch

from adaptive_eager.dispatch.signature import KEY_CONTEXT_FIELDS
from adaptive_eager.runtime import scheduling
from adaptive_eager.runtime.entries import MIN_COMPUTE_OPS, KeyEntry
from adaptive_eager.runtime.segment import Segment


def _grad_enabled(segment: Segment, op) -> bool:
    """Was ``segment`` recorded with autograd on (its key context says)?"""
    return segment.context[KEY_CONTEXT_FIELDS.index("grad_enabled")]


# Ops whose Inductor kernels fail (torch 2.13), when compiled or when run: a segment holding
# one would cost a compile (10 s here) only to run per-op for good (compile_failed,
# kernel_error). Each maps to the calls that fail, given (segment, op).
def _accumulates_one_index_on_cpu(segment: Segment, op) -> bool:
    """An ``index_put(..., accumulate=True)`` on the CPU whose index tensors hold one element
    (the gradient of ``t[..., [i], :]``)."""
    accumulate = op.args[3] if len(op.args) > 3 else dict(op.kwargs).get("accumulate")
    meta = op.out_metas[0] if op.out_metas else None
    indices = [index for index in op.args[1] if index is not None] if len(op.args) > 1 else []
    return getattr(accumulate, "value", False) is True and meta is not None \
        and meta.device.type == "cpu" and bool(indices) \
        and all(math.prod(getattr(index, "shape", (0,))) == 1 for index in indices)


def _grouped_mm_not_bf16(segment: Segment, op) -> bool:
    """A ``_grouped_mm`` of other than bfloat16 matrices: eager runs it on the CPU in any
    float type, but its meta function (which Inductor traces with) takes bfloat16 only."""
    return any(getattr(matrix, "dtype", None) is not torch.bfloat16 for matrix in op.args[:2])


_KERNELS_FAIL = {
    # LSTM on CPU with autograd on (train or eval mode): "expected Tensor() for op:
    # aten.mkldnn_rnn_layer" at run time. Under no_grad it compiles and runs.
    "aten::mkldnn_rnn_layer": _grad_enabled,
    # Note [Accumulating index_put on the CPU]: an Inductor bug (torch 2.13, C++ backend).
    # Falcon's backward (the gradient of its fused-QKV split, ``qkv[..., [-2], :]``) holds
    # index_put(zeros, [None, None, i], values, accumulate=True) with one-element ``i`` and
    # ``values`` read through a transposed layout. Inductor's kernel then runs a 2-D tiled
    # loop whose atomic add stores at ``48*x1 + 96*x1_inner`` where ``48*(x1 + x1_inner)``
    # is due (96: the stride of the values' size-1 dim): wrong sums, and writes past the
    # output, which corrupted the heap (Falcon crashed with SIGSEGV or SIGABRT before
    # probation could judge the kernel). The stand-in compiler runs the same segments as
    # eager; in a small segment probation catches the wrong sums (kernel_mismatch 8.2).
    # Without the runtime (tests/runtime/test_policy.py runs it, in a child process):
    #     def f(x, y, i):
    #         v = (x * y).transpose(1, 2)                          # (2, 12, 1, 8)
    #         return aten.index_put(v.new_zeros(2, 12, 6, 8), [None, None, i], v, True)
    #     x, y = torch.randn(2, 1, 8, 12).transpose(2, 3), torch.randn(1, 1, 12, 8)
    #     torch.compile(f)(x, y, torch.tensor([-1]))    # max abs error 8.2 against f(...)
    # Two-element index tensors, values read in their own layout, or accumulate=False compile
    # right; whether a segment's loop is tiled is Inductor's choice, so every CPU segment with
    # a one-element accumulating index_put stays per-op.
    "aten::index_put": _accumulates_one_index_on_cpu,
    # Mixtral's and the Qwen MoEs' experts in float32: "Expected inputs of BF16 type".
    "aten::_grouped_mm": _grouped_mm_not_bf16,
}


def _kernel_would_fail(segment: Segment) -> bool:
    for op in segment.ops:
        fails = _KERNELS_FAIL.get(op.func.name())
        if fails is not None and fails(segment, op):
            return True
    return False


def unfusible_reason(segment: Segment, entry: KeyEntry) -> str | None:
    if segment.compute_ops < MIN_COMPUTE_OPS:
        return "too_few_ops"
    if _kernel_would_fail(segment):
        return "compiler_unsupported"
    if entry.too_cheap:
        return "too_cheap"                 # see MIN_SEGMENT_US and MIN_US_PER_OP (config)
    if scheduling.extern_bound(entry):
        return "extern_bound"              # matmuls take its time (Note [Predicted saving])
    if any(_overlaps_itself(segment.out_meta(ref)) for ref in segment.live_refs):
        return "overlapping_output"        # a kernel cannot write one memory cell twice
    return None


def _overlaps_itself(meta) -> bool:
    return any(stride == 0 and size > 1 for size, stride in zip(meta.shape, meta.stride))
