"""Shape-generic segments: one kernel for a segment whose sizes vary along a few dims.

A loop whose sequence length changes every step records the same op structure at many shapes.
From two or more such recorded variants, ``generalize`` derives a ``GenericSegment``: which
input dims vary (each group of dims that always share a size is one *symbol*), and which integer
arguments follow them (the ``[16, 16]`` of a ``view`` that flattens ``[2, 8, 16]`` is recorded
as ``[2 * s0, 16]``). From it:

- ``output_metas`` gives every op's output metas for new concrete input metas, so the hot path
  can hand out real outputs of the right shape before the kernel runs (a generated function of
  the symbols, Note [Symbolic output metas], else meta-device replay; cached per symbol values);
- ``build_generic_graph`` builds the FX graph with the calling convention of
  ``runtime.graph.build_graph`` (``(*inputs, *buffers)``, ``aten.copy_`` into each buffer), with
  varying sizes computed from ``aten.sym_size`` of the inputs;
- ``compile_generic`` compiles it once with Inductor for all sizes (see Note [Symbolic compile]).

These run aten ops (on meta and fake tensors): call them outside the adaptive dispatch mode.

# Note [Symbolic compile]
``standalone_compile(dynamic_shapes="from_example_inputs")`` fakifies real example inputs with
``static_shapes=True``: ``torch._dynamo.mark_dynamic`` on them is ignored. It also accepts a
``fake_mode`` (with a ShapeEnv), and example inputs that are already FakeTensors *of that mode*
are used as they are. So we build the fakes ourselves: one ShapeEnv symbol per varying size,
created once and shared by every input and buffer dim that has that size, strides dense in the
recorded order. Standalone artifacts carry no guards: whatever the ShapeEnv learned while
compiling would be silently assumed at run time. So what it learned (guards such as Inductor's
``256*s0 > 4096`` when it picks a strategy by size, specializations, narrowed ranges) becomes
the generic segment's ``conditions``, Python expressions that ``bind`` evaluates along with
everything else (static dims, strides, dtype, device, shared sizes, sizes >= 2) before a call.

# Note [Affine sizes]
A decode loop with a growing cache (transformers' DynamicCache) concatenates the past keys, of
length s, with the new token's: the output has length s + 1, and the attention mask is sliced
to s + 1. No product of the varying sizes gives s + 1, so those segments had a compile per
length up to MAX_SHAPE_VARIANTS, then ran per-op for good (megamorphic). So where no product
fits, a size may be ``coeff * product + offset``. Two variants fit any such line, so an offset
is only taken from at least MIN_AFFINE_VARIANTS variants, the third confirming it (the policy
generalizes the last three shapes). A size ``s - 1`` at the smallest symbol value may be 1,
which Inductor treats apart (broadcasting): what the compile assumed about it is a condition
like any other, and each new shape's first fused run is checked (probation).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import operator
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.fx as fx

from adaptive_eager.dispatch.ops import OpKind
from adaptive_eager.dispatch.signature import ScalarArg, TensorArg, TensorMeta
from adaptive_eager.runtime.graph import name_outputs, write_buffers
from adaptive_eager.runtime.segment import Segment, flatten_outputs

aten = torch.ops.aten

Dim = tuple[int, int]          # (input index, dim)
MAX_SYMBOLS_PER_SIZE = 3       # an integer argument is c * (a product of at most this many)
METAS_CACHE_SIZE = 64          # symbol-value tuples whose output metas a GenericSegment keeps
MIN_SYMBOL_VALUE = 2           # Inductor specializes sizes 0 and 1; a symbol never takes them
MIN_AFFINE_VARIANTS = 3        # two points fit any line: an offset must be confirmed by a third


class NotGeneric(Exception):
    """The variants, or the compiled kernel, cannot serve other sizes."""


@dataclasses.dataclass(frozen=True)
class SizeExpr:
    """``coeff * prod(symbol values[j] for j in symbols) + offset``: a size that follows the
    inputs (an offset: Note [Affine sizes]).

    Not a tuple on purpose: signature.decode would take a tuple for an int list."""
    coeff: int
    symbols: tuple[int, ...]
    offset: int = 0

    def value(self, values: Sequence[int]) -> int:
        return self.coeff * math.prod(values[j] for j in self.symbols) + self.offset


Size = int | SizeExpr


def size_value(size: Size, values: Sequence[Any]) -> Any:
    """A size for these symbol values (ints, or SymInts when building fakes)."""
    if type(size) is int:
        return size
    result = values[size.symbols[0]] if size.symbols else 1
    for j in size.symbols[1:]:
        result = result * values[j]
    result = result * size.coeff if size.coeff != 1 else result
    return result + size.offset if size.offset else result


class GenericMeta(NamedTuple):
    """A tensor meta whose sizes may follow symbols: static tensors keep their exact strides,
    varying ones are dense in ``order`` (dims from outermost to innermost)."""
    shape: tuple[Size, ...]
    stride: tuple[int, ...] | None      # static tensors
    order: tuple[int, ...] | None       # varying tensors
    dtype: torch.dtype
    device: torch.device

    def concrete(self, values: Sequence[Any]) -> TensorMeta:
        shape = tuple(size_value(size, values) for size in self.shape)
        stride = self.stride if self.order is None else dense_strides(shape, self.order)
        return TensorMeta(shape, stride, self.dtype, self.device)

    def matches(self, meta: TensorMeta, values: Sequence[int]) -> bool:
        if meta.dtype != self.dtype or meta.device != self.device:
            return False
        if self.order is None:
            return meta.shape == self.shape and tuple(meta.stride) == self.stride
        return tuple(meta) == tuple(self.concrete(values))


def _all_ints(values) -> bool:
    return all(type(v) is int for v in values)


# ------------------------------------------------------------------ layouts and varying dims

def dense_strides(shape: Sequence[Any], order: Sequence[int]) -> tuple:
    """Strides of a dense tensor whose dims, from outermost to innermost, are ``order``."""
    strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step = step * shape[dim]
    return tuple(strides)


def dense_order(meta: TensorMeta) -> tuple[int, ...] | None:
    """The dim order in which ``meta`` is dense (no gaps, no overlap), or None."""
    order = tuple(sorted(range(len(meta.shape)), key=lambda d: (-meta.stride[d], d)))
    return order if dense_strides(meta.shape, order) == tuple(meta.stride) else None


def varying_dims(variants: Sequence[Sequence[TensorMeta]]) -> tuple[Dim, ...] | None:
    """The (input index, dim) positions whose size differs between the recorded variants, or
    None when one generic kernel cannot serve them all: other counts, ranks, dtypes or devices,
    a tensor with varying sizes that is not dense in one dim order shared by every variant,
    or one with fixed sizes whose strides differ."""
    if len(variants) < 2 or len({len(metas) for metas in variants}) != 1:
        return None
    varying: list[Dim] = []
    for index, metas in enumerate(zip(*variants)):
        first = metas[0]
        if any(len(m.shape) != len(first.shape) or m.dtype != first.dtype
               or m.device != first.device for m in metas):
            return None
        dims = [d for d in range(len(first.shape)) if len({m.shape[d] for m in metas}) > 1]
        if dims:
            order = dense_order(first)
            if order is None or any(dense_order(m) != order for m in metas):
                return None
        elif any(tuple(m.stride) != tuple(first.stride) for m in metas):
            return None
        varying += [(index, d) for d in dims]
    return tuple(varying)


# ------------------------------------------------------------------ generalizing variants

@dataclasses.dataclass(frozen=True)
class GenericSegment:
    """A segment's op structure for every size its symbols can take."""
    example: Segment                        # the first variant: ops, refs, devices, hints
    symbols: tuple[tuple[Dim, ...], ...]    # per symbol: the input dims that have its size
    hints: tuple[int, ...]                  # the example's value of each symbol
    inputs: tuple[GenericMeta, ...]         # per external input
    calls: tuple[tuple[tuple, tuple], ...]  # per op (args, kwargs); varying ints as SizeExpr
    live: tuple[GenericMeta, ...]           # per live output: the buffers a kernel writes
    # what its compile assumed of the symbols (Note [Symbolic compile]): Python expressions
    # over the symbol values ``v`` that must all hold for its kernel to serve them
    conditions: tuple[str, ...] = ()
    # symbol values -> every op's output metas; None: replay on meta tensors instead
    shape_fn: Callable[..., tuple] | None = dataclasses.field(default=None, compare=False)
    _metas: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def bind(self, input_metas: Sequence[TensorMeta]) -> tuple[int, ...] | None:
        """The symbol values for these input metas, or None where this structure does not fit
        them (other static sizes, strides, dtypes or devices; unequal shared sizes; a size
        below MIN_SYMBOL_VALUE)."""
        if len(input_metas) != len(self.inputs):
            return None
        values = []
        for group in self.symbols:
            sizes = {_size_at(input_metas, dim) for dim in group}
            if len(sizes) != 1:
                return None
            value = sizes.pop()
            if value is None or value < MIN_SYMBOL_VALUE:
                return None
            values.append(value)
        for meta, generic in zip(input_metas, self.inputs):
            if not generic.matches(meta, values):
                return None
        if self.conditions and not self._conditions_hold(values):
            return None
        return tuple(values)

    def _conditions_hold(self, values: list[int]) -> bool:
        check = self._metas.get("conditions")
        if check is None:
            source = "lambda v: " + " and ".join(f"({c})" for c in self.conditions)
            check = self._metas["conditions"] = eval(   # our own printed sympy, not input
                compile(source, "<generic conditions>", "eval"), {"math": math})
        try:
            return bool(check(values))
        except Exception:           # e.g. a division the printer emitted: do not serve
            return False


def _size_at(metas: Sequence[TensorMeta], dim: Dim) -> int | None:
    shape = metas[dim[0]].shape
    return shape[dim[1]] if dim[1] < len(shape) else None


def generalize(variants: Sequence[Segment], symbolic: bool = True) -> GenericSegment:
    """One GenericSegment for these recorded variants of one op structure (the first is the
    example). Raises NotGeneric, saying why, where they differ in more than sizes that follow
    their inputs' varying dims. ``symbolic``: derive output metas as expressions of the
    symbols once (Note [Symbolic output metas]) rather than by meta replay per new shape."""
    if len(variants) < 2:
        raise NotGeneric("needs at least two variants")
    _check_structure(variants)
    varying = varying_dims([s.input_metas for s in variants])
    if varying is None:
        raise NotGeneric("input counts, ranks, dtypes, devices or layouts differ")
    if not varying:
        raise NotGeneric("no input size varies")
    symbols = _group_symbols(variants, varying)
    values = [tuple(_size_at(s.input_metas, group[0]) for group in symbols) for s in variants]
    fit = _Fitter(values)
    symbol_of = {dim: SizeExpr(1, (j,)) for j, group in enumerate(symbols) for dim in group}
    inputs = tuple(
        _generic_meta([s.input_metas[k] for s in variants],
                      tuple(symbol_of.get((k, d), size) for d, size in enumerate(meta.shape)))
        for k, meta in enumerate(variants[0].input_metas))
    calls = tuple(
        (fit.walk([s.ops[i].args for s in variants]), fit.walk([s.ops[i].kwargs for s in variants]))
        for i in range(len(variants[0].ops)))
    live = []
    for ref in variants[0].live_refs:
        metas = [s.out_meta(ref) for s in variants]
        live.append(_generic_meta(metas, tuple(fit.size([m.shape[d] for m in metas])
                                               for d in range(len(metas[0].shape)))))
    generic = GenericSegment(variants[0], symbols, values[0], inputs, calls, tuple(live))
    if symbolic:
        generic = dataclasses.replace(generic, shape_fn=shape_function(generic))
    for segment, symbol_values in zip(variants, values):   # replay must reproduce the records
        if generic.bind(segment.input_metas) != symbol_values or \
                output_metas(generic, segment.input_metas) != _recorded_metas(segment):
            raise NotGeneric("replaying the generic ops does not reproduce a recorded variant")
    return generic


def _check_structure(variants: Sequence[Segment]) -> None:
    first = variants[0]
    for segment in variants[1:]:
        if segment.context != first.context or segment.live_refs != first.live_refs \
                or len(segment.ops) != len(first.ops):
            raise NotGeneric("context, live outputs or op count differ")
        for a, b in zip(first.ops, segment.ops):
            if a.func is not b.func or a.container != b.container or \
                    [m is None for m in a.out_metas] != [m is None for m in b.out_metas]:
                raise NotGeneric(f"ops differ: {a.func} vs {b.func}")


def _group_symbols(variants: Sequence[Segment], varying: tuple[Dim, ...]) -> tuple:
    """Varying dims whose sizes are equal in every variant share one symbol."""
    groups: dict[tuple, list[Dim]] = {}
    for dim in varying:
        groups.setdefault(tuple(_size_at(s.input_metas, dim) for s in variants), []).append(dim)
    return tuple(tuple(group) for group in groups.values())


def _generic_meta(metas: Sequence[TensorMeta], shape: tuple[Size, ...]) -> GenericMeta:
    """The GenericMeta of one tensor recorded as ``metas`` (one per variant) with ``shape``."""
    first = metas[0]
    if _all_ints(shape):
        if any(tuple(m.stride) != tuple(first.stride) for m in metas):
            raise NotGeneric("a tensor of fixed size changes strides")
        return GenericMeta(shape, tuple(first.stride), None, first.dtype, first.device)
    order = dense_order(first)
    if order is None or any(dense_order(m) != order for m in metas):
        raise NotGeneric("a tensor of varying size is not dense in one order")
    return GenericMeta(shape, None, order, first.dtype, first.device)


class _Fitter:
    """Turns the values one integer takes across the variants into a constant or a SizeExpr."""

    def __init__(self, values: list[tuple[int, ...]]) -> None:
        self.values = values
        count = len(values[0])
        self.subsets = [subset for r in range(1, min(count, MAX_SYMBOLS_PER_SIZE) + 1)
                        for subset in itertools.combinations(range(count), r)]

    def size(self, observed: Sequence[int]) -> Size:
        if len(set(observed)) == 1:
            return observed[0]
        fits = [expr for expr in map(self._try, self.subsets, itertools.repeat(observed)) if expr]
        if not fits and len(self.values) >= MIN_AFFINE_VARIANTS:   # Note [Affine sizes]
            fits = [expr for expr in map(self._try_affine, self.subsets,
                                         itertools.repeat(observed)) if expr]
        if len(fits) != 1:
            raise NotGeneric(f"sizes {list(observed)} follow {'no' if not fits else 'several'} "
                             f"products of the varying sizes")
        return fits[0]

    def _try(self, subset: tuple[int, ...], observed: Sequence[int]) -> SizeExpr | None:
        expr = SizeExpr(1, subset)
        base = expr.value(self.values[0])
        if observed[0] % base or observed[0] // base < 1:
            return None
        expr = SizeExpr(observed[0] // base, subset)
        ok = all(expr.value(v) == o for v, o in zip(self.values, observed))
        return expr if ok else None

    def _try_affine(self, subset: tuple[int, ...], observed: Sequence[int]) -> SizeExpr | None:
        products = [SizeExpr(1, subset).value(v) for v in self.values]
        if products[1] == products[0] or (observed[1] - observed[0]) % (products[1] - products[0]):
            return None
        coeff = (observed[1] - observed[0]) // (products[1] - products[0])
        if coeff < 1:
            return None
        expr = SizeExpr(coeff, subset, observed[0] - coeff * products[0])
        ok = all(expr.value(v) == o for v, o in zip(self.values, observed))
        return expr if ok else None

    def walk(self, encoded: Sequence[Any]) -> Any:
        """The encoded argument of the first variant, its varying ints made SizeExprs."""
        first = encoded[0]
        if isinstance(first, TensorArg):
            if any(not isinstance(e, TensorArg) or e.ref != first.ref or e.dtype != first.dtype
                   or len(e.shape) != len(first.shape) for e in encoded):
                raise NotGeneric("tensor arguments differ")
            return first
        if isinstance(first, ScalarArg):
            if any(not isinstance(e, ScalarArg) or e.kind is not first.kind for e in encoded):
                raise NotGeneric("scalar arguments differ in type")
            if first.kind is int:
                size = self.size([e.value for e in encoded])
                return first if type(size) is int else size
            if any(e.value != first.value for e in encoded):
                raise NotGeneric(f"{first.kind.__name__} arguments differ")
            return first
        if isinstance(first, tuple):
            if any(not isinstance(e, tuple) or len(e) != len(first) for e in encoded):
                raise NotGeneric("argument lists differ in length")
            return tuple(self.walk(items) for items in zip(*encoded))
        if any(e != first for e in encoded):
            raise NotGeneric(f"arguments differ: {first!r}")
        return first


def _recorded_metas(segment: Segment) -> tuple:
    return tuple(op.out_metas for op in segment.ops)


# ------------------------------------------------------------------ output metas

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
        out = op.func(*_decode(args, tensor_of, leaf),
                      **{name: _decode(value, tensor_of, leaf) for name, value in kwargs})
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

    fake_mode, symbols, symints = _symbolic_mode(generic.hints)
    fakes = _fakes(fake_mode, generic.inputs, symints)
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


def _decode(encoded: Any, tensor_of, leaf) -> Any:
    """signature.decode, also turning SizeExprs (and devices) into values through ``leaf``."""
    if isinstance(encoded, TensorArg):
        return tensor_of(encoded)
    if isinstance(encoded, ScalarArg):
        return encoded.value
    if isinstance(encoded, tuple):
        return [_decode(item, tensor_of, leaf) for item in encoded]
    return leaf(encoded)


# ------------------------------------------------------------------ graph and compile

def build_generic_graph(generic: GenericSegment) -> fx.GraphModule:
    """``runtime.graph.build_graph`` of the generic segment: the same calling convention,
    varying sizes computed from ``aten.sym_size`` of the inputs. Runs eagerly at any size."""
    segment = generic.example
    graph = fx.Graph()
    inputs = [graph.placeholder(f"in_{k}") for k in range(len(segment.input_metas))]
    buffers = [graph.placeholder(f"out_{k}") for k in range(len(segment.live_refs))]
    sizes = [graph.call_function(aten.sym_size.int, (inputs[k], d))
             for k, d in (group[0] for group in generic.symbols)]
    exprs: dict[SizeExpr, fx.Node] = {}
    values: dict[tuple, fx.Node] = {}

    def tensor_of(arg: TensorArg) -> fx.Node:
        return inputs[arg.ref[1]] if arg.ref[0] == "in" else values[arg.ref]

    def leaf(value: Any) -> Any:
        if not isinstance(value, SizeExpr):
            return value
        if value not in exprs:
            node = sizes[value.symbols[0]]
            for j in value.symbols[1:]:
                node = graph.call_function(operator.mul, (node, sizes[j]))
            if value.coeff != 1:
                node = graph.call_function(operator.mul, (value.coeff, node))
            if value.offset:
                node = graph.call_function(operator.add, (node, value.offset))
            exprs[value] = node
        return exprs[value]

    for index, (op, (args, kwargs)) in enumerate(zip(segment.ops, generic.calls)):
        node = graph.call_function(op.func, tuple(_decode(args, tensor_of, leaf)),
                                   {name: _decode(v, tensor_of, leaf) for name, v in kwargs})
        name_outputs(graph, values, index, op, node)
    return write_buffers(graph, buffers, segment.live_refs, values)


def compile_symbolic(graph: fx.GraphModule, metas: Sequence[GenericMeta],
                     hints: Sequence[int], options: dict | None = None):
    """Compile ``graph`` once for every value of its symbols (Note [Symbolic compile]).

    ``metas`` describe its inputs in order (external inputs, then buffers); SizeExprs in them
    refer to symbols whose example values are ``hints``. Sizes the graph passes to ops must
    already be computed from its inputs (build_generic_graph), not literal. Returns the
    standalone CompiledArtifact (``save``/``load`` work). Raises NotGeneric where the compile
    assumed something about the symbols."""
    from torch._inductor import standalone_compile

    fake_mode, symbols, symints = _symbolic_mode(hints)
    fakes = _fakes(fake_mode, metas, symints)
    quiet = logging.getLogger("torch._inductor.standalone_compile")
    level = quiet.level
    quiet.setLevel(logging.ERROR)       # see InductorCompiler.compile
    try:
        artifact = standalone_compile(graph, fakes, dynamic_shapes="from_example_inputs",
                                      fake_mode=fake_mode, options=options or {})
    finally:
        quiet.setLevel(level)
    return artifact, learned_conditions(fake_mode.shape_env, symbols)


def _symbolic_mode(hints: Sequence[int]) -> tuple:
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


def _fakes(fake_mode, metas: Sequence[GenericMeta], symints: list) -> list[torch.Tensor]:
    with fake_mode:
        return [torch.empty_strided(*meta.concrete(symints)[:2], dtype=meta.dtype,
                                    device=meta.device) for meta in metas]


def learned_conditions(env, symbols: list) -> tuple[str, ...]:
    """What a ShapeEnv learned about ``symbols`` (guards, specializations, ranges narrower
    than [2, oo)), as Python expressions over ``v`` (v[j]: symbol j's value). Raises
    NotGeneric where one involves anything else or does not print as Python."""
    import sympy
    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.printers import PythonPrinter

    facts = [guard.expr for guard in env.guards]
    for symbol in symbols:
        if symbol in env.replacements:
            facts.append(sympy.Eq(symbol, env.replacements[symbol]))
        bounds = env.var_to_range.get(symbol)
        if bounds is not None and bounds.lower != MIN_SYMBOL_VALUE:
            facts.append(sympy.Ge(symbol, bounds.lower))
        if bounds is not None and bounds.upper != int_oo:
            facts.append(sympy.Le(symbol, bounds.upper))
    names = {symbol: sympy.Symbol(f"v[{j}]") for j, symbol in enumerate(symbols)}
    printer, conditions = PythonPrinter(), []
    for fact in facts:
        if not fact.free_symbols <= set(symbols):
            raise NotGeneric(f"the compile assumed {fact}, not only of our sizes")
        try:
            conditions.append(printer.doprint(fact.xreplace(names)))
        except Exception as err:  # an expression sympy cannot print as Python
            raise NotGeneric(f"the compile assumed {fact}, which does not print: {err}")
    return tuple(conditions)


def compile_generic(generic: GenericSegment, options: dict | None = None):
    """One Inductor kernel for every size the generic segment fits: (kernel, the generic
    segment with the conditions its compile assumed). Call the kernel as a build_graph
    kernel, ``kernel(*inputs, *buffers)``, buffers shaped by ``output_metas``, and only for
    input metas the returned segment ``bind``s."""
    graph = build_generic_graph(generic)
    kernel, conditions = compile_symbolic(graph, generic.inputs + generic.live, generic.hints,
                                          options)
    return kernel, dataclasses.replace(generic, conditions=conditions, _metas={})


# ------------------------------------------------------------------ serving recorded keys

def fits(generic: GenericSegment, segment: Segment) -> bool:
    """Can ``generic``'s kernel run ``segment`` (another recorded shape of its structure)?
    Its inputs must bind, its calls be the generic calls at those symbol values (static ints
    equal, varying ones following the symbols), and its live outputs have the layout the
    kernel writes. Intermediate shapes then follow: the same ops on the same inputs."""
    example = generic.example
    if segment.context != example.context or segment.live_refs != example.live_refs \
            or len(segment.ops) != len(example.ops):
        return False
    values = generic.bind(segment.input_metas)
    if values is None:
        return False
    for op, model, (args, kwargs) in zip(segment.ops, example.ops, generic.calls):
        if op.func is not model.func or not _same_call(args, op.args, values) \
                or not _same_call(kwargs, op.kwargs, values):
            return False
    return all(tuple(segment.out_meta(ref)) == tuple(live.concrete(values))
               for ref, live in zip(example.live_refs, generic.live))


def _same_call(generic: Any, recorded: Any, values: tuple[int, ...]) -> bool:
    if isinstance(generic, SizeExpr):
        return isinstance(recorded, ScalarArg) and recorded.kind is int \
            and recorded.value == generic.value(values)
    if isinstance(generic, TensorArg):    # sizes: checked by bind (inputs) and by the ops
        return isinstance(recorded, TensorArg) and recorded.ref == generic.ref \
            and recorded.dtype == generic.dtype and recorded.device == generic.device \
            and len(recorded.shape) == len(generic.shape) and recorded.aligned == generic.aligned
    if isinstance(generic, tuple) and not isinstance(generic, ScalarArg):
        return isinstance(recorded, tuple) and not isinstance(recorded, ScalarArg) \
            and len(recorded) == len(generic) \
            and all(_same_call(g, r, values) for g, r in zip(generic, recorded))
    return generic == recorded


def to_wire(generic: GenericSegment) -> tuple:
    """What the compile worker sends back: everything but the example (the program has it)
    and the shape function."""
    return (generic.symbols, generic.hints, generic.inputs, generic.calls, generic.live,
            generic.conditions)


def from_wire(example: Segment, wire: tuple) -> GenericSegment:
    symbols, hints, inputs, calls, live, conditions = wire
    return GenericSegment(example, symbols, hints, inputs, calls, live, conditions)
