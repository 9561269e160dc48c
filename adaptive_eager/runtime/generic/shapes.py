"""Output metas of a GenericSegment at new sizes, before its kernel runs: from a generated
function of the symbols (``shape_function``, Note [Symbolic output metas]), else by replaying
the ops on meta tensors; cached per symbol values. These run aten ops (on meta and fake
tensors): call them outside the adaptive dispatch mode.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from adaptive_eager.dispatch.ops import OpKind
from adaptive_eager.dispatch.signature import ScalarArg, TensorArg, TensorMeta
from adaptive_eager.runtime.generic.model import GenericMeta, GenericSegment, SizeExpr, size_value
from adaptive_eager.runtime.segment import flatten_outputs

METAS_CACHE_SIZE = 64          # symbol-value tuples whose output metas a GenericSegment keeps


def output_metas(generic: GenericSegment, input_metas: Sequence[TensorMeta]) -> tuple | None:
    """Every op's output metas (one tuple per op, like ``OpRecord.out_metas``) for these input
    metas, or None where the generic segment does not fit them. Computed once per symbol
    values, by the segment's shape function (~1 µs per op) or else by running the ops on meta
    tensors (~0.1-2 ms per op), then cached."""
    values = generic.bind(input_metas)
    if values is None:
        return None
    cache = generic._metas
    metas = cache.get(values)
    if metas is None:
        metas = generic.shape_fn(*values) if generic.shape_fn else _replay_on_meta(generic, values)
        if metas is False or any(tuple(metas[ref[1]][ref[2]]) != tuple(live.concrete(values))
               for ref, live in zip(generic.example.live_refs, generic.live)):
            metas = False               # a buffer would not have the layout the kernel writes
        if len(cache) >= METAS_CACHE_SIZE:
            del cache[next(iter(cache))]
        cache[values] = metas
    return metas or None


_META = torch.device("meta")


def _replay_on_meta(generic: GenericSegment, values: tuple[int, ...]) -> tuple | bool:
    """Per-op output metas from running the ops on meta tensors; False where an op refuses
    these sizes (a view that cannot be formed, an op without a meta kernel)."""
    inputs = []
    for generic_meta in generic.inputs:
        meta = generic_meta.concrete(values)
        inputs.append(torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype,
                                          device=_META))
    try:
        outputs = _run_calls(generic, inputs, lambda size: size.value(values),
                             lambda device: _META)
    except Exception:               # whatever the op raises: these sizes are not served
        return False
    return tuple(
        tuple(None if tensor is None else
              TensorMeta(tensor.shape, tensor.stride(), tensor.dtype, recorded.device)
              for tensor, recorded in zip(flat, op.out_metas))
        for op, flat in zip(generic.example.ops, outputs))


def _run_calls(generic: GenericSegment, inputs: list, size_of, device_of) -> list[tuple]:
    """Run the generic ops on ``inputs``: per op, its flat outputs (None where the record has
    no tensor). ``size_of`` makes a SizeExpr a size, ``device_of`` rewrites device arguments."""
    computed: dict[tuple, torch.Tensor] = {}

    def tensor_of(arg: TensorArg) -> torch.Tensor:
        return inputs[arg.ref[1]] if arg.ref[0] == "in" else computed[arg.ref]

    def leaf(value: Any) -> Any:
        if isinstance(value, SizeExpr):
            return size_of(value)
        return device_of(value) if isinstance(value, torch.device) else value

    result = []
    for index, (op, (args, kwargs)) in enumerate(zip(generic.example.ops, generic.calls)):
        out = op.func(*decode_args(args, tensor_of, leaf),
                      **{name: decode_args(value, tensor_of, leaf) for name, value in kwargs})
        flat = flatten_outputs(out)[1]
        outputs = []
        for out_index, (tensor, recorded) in enumerate(zip(flat, op.out_metas)):
            if recorded is None or tensor is None:
                outputs.append(None)
                continue
            if op.kind is not OpKind.MUTATING:
                computed[("out", index, out_index)] = tensor
            outputs.append(tensor)
        result.append(tuple(outputs))
    return result


def shape_function(generic: GenericSegment) -> Callable[..., tuple] | None:
    """Note [Symbolic output metas]: run the ops once on fake tensors whose varying sizes are
    ShapeEnv symbols; every output's sizes and strides come out as expressions of them, which
    become one generated Python function (symbol values -> per-op metas, ~1 µs). None where
    the trace had to guard on a symbol (its expressions would not hold for every size) or an
    expression does not print as Python; output_metas then replays on meta tensors."""
    from torch.utils._sympy.printers import PythonPrinter

    fake_mode, symbols, symints = symbolic_mode(generic.hints)
    fakes = symbolic_fakes(fake_mode, generic.inputs, symints)
    try:
        with fake_mode:
            traced = _run_calls(generic, fakes, lambda size: size_value(size, symints),
                                lambda device: device)
    except Exception:               # an op without a symbolic meta kernel, a data-dependent size
        return None
    env = fake_mode.shape_env
    if env.guards or any(symbol in env.replacements for symbol in symbols):
        return None
    printer, names = PythonPrinter(), {}

    def text(value: Any) -> str:
        return printer.doprint(value.node.expr) if isinstance(value, torch.SymInt) else str(value)

    def meta_text(tensor: torch.Tensor, recorded: TensorMeta) -> str:
        name = names.setdefault((recorded.dtype, recorded.device), f"_k{len(names)}")
        return f"_M({_tuple_text(map(text, tensor.shape))}, " \
               f"{_tuple_text(map(text, tensor.stride()))}, *{name})"

    ops = [_tuple_text("None" if t is None else meta_text(t, r)
                       for t, r in zip(outputs, op.out_metas))
           for op, outputs in zip(generic.example.ops, traced)]
    source = f"lambda {', '.join(map(str, symbols))}: {_tuple_text(ops)}"
    scope = {"_M": TensorMeta, "math": math, **{n: key for key, n in names.items()}}
    try:
        return eval(compile(source, "<generic output metas>", "eval"), scope)
    except SyntaxError:
        return None


def _tuple_text(items) -> str:
    return "(" + "".join(item + ", " for item in items) + ")"


def decode_args(encoded: Any, tensor_of, leaf) -> Any:
    """signature.decode, also turning SizeExprs (and devices) into values through ``leaf``."""
    if isinstance(encoded, TensorArg):
        return tensor_of(encoded)
    if isinstance(encoded, ScalarArg):
        return encoded.value
    if isinstance(encoded, tuple):
        return [decode_args(item, tensor_of, leaf) for item in encoded]
    return leaf(encoded)


def symbolic_mode(hints: Sequence[int]) -> tuple:
    """A FakeTensorMode with one DYNAMIC ShapeEnv symbol per hint: (mode, symbols, SymInts)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    env = fake_mode.shape_env
    symbols, symints = [], []
    for j, hint in enumerate(hints):
        source = ConstantSource(f"ae_size{j}")
        symbols.append(env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC))
        symints.append(env.create_symintnode(symbols[-1], hint=hint, source=source))
    return fake_mode, symbols, symints


def symbolic_fakes(fake_mode, metas: Sequence[GenericMeta], symints: list) -> list:
    """Fake tensors of ``metas``, their varying sizes ``symints`` (of ``symbolic_mode``)."""
    with fake_mode:
        return [torch.empty_strided(*meta.concrete(symints)[:2], dtype=meta.dtype,
                                    device=meta.device) for meta in metas]

