"""Readable forms of segments and keys, for the disk store, the CLI and logs.

``key_parts`` names every part of a key, so ``adaptive-eager cache explain K1 K2`` can say which
parts differ; ``op_lines`` renders each op as ``%2 = aten.mul.Tensor(in0:f32[64, 32], 1.5)``.
"""
from __future__ import annotations

from typing import Any

import torch

from adaptive_eager.dispatch.signature import KEY_CONTEXT_FIELDS, LiftedScalar, ScalarArg, TensorArg
from adaptive_eager.runtime.segment import Segment

_DTYPE_NAMES = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
                torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32",
                torch.bool: "bool", torch.uint8: "u8", torch.int8: "i8"}


def ref_name(ref: tuple) -> str:
    if ref[0] == "in":
        return f"in{ref[1]}"
    return f"%{ref[1]}" if ref[2] == 0 else f"%{ref[1]}.{ref[2]}"


def render(encoded: Any) -> str:
    if isinstance(encoded, TensorArg):
        dtype = _DTYPE_NAMES.get(encoded.dtype, str(encoded.dtype).replace("torch.", ""))
        return f"{ref_name(encoded.ref)}:{dtype}{list(encoded.shape)}"
    if isinstance(encoded, ScalarArg):
        return repr(encoded.value)
    if type(encoded) is LiftedScalar:             # Note [Lifted scalars]
        return f"{ref_name(encoded.ref)}.item()"
    if isinstance(encoded, tuple):
        return "[" + ", ".join(render(item) for item in encoded) + "]"
    return str(encoded)


def op_lines(segment: Segment) -> list[str]:
    lines = []
    for index, op in enumerate(segment.ops):
        args = [render(arg) for arg in op.args]
        args += [f"{name}={render(value)}" for name, value in op.kwargs]
        lines.append(f"%{index} = {op.func}({', '.join(args)})")
    return lines


def key_parts(segment: Segment) -> dict:
    """Every named part of the segment's key, as plain JSON-able values."""
    context = dict(zip(KEY_CONTEXT_FIELDS, (str(value) for value in segment.context)))
    return {
        "context": context,
        "ops": [str(op.func) for op in segment.ops],
        "arguments": [render(op.args + tuple(v for _, v in op.kwargs)) for op in segment.ops],
        "inputs": [f"{_DTYPE_NAMES.get(m.dtype, str(m.dtype))}{list(m.shape)} "
                   f"stride={list(m.stride)} {m.device}" for m in segment.input_metas],
        "live_outputs": [ref_name(ref) for ref in segment.live_refs],
    }
