"""Deriving a GenericSegment from recorded variants (``generalize``), and matching a recorded
shape against one (``fits``). An integer argument becomes a ``SizeExpr`` when it follows the
varying sizes: a product of them (the ``[16, 16]`` of a ``view`` that flattens ``[2, 8, 16]`` is
recorded as ``[2 * s0, 16]``) or, where no product fits, ``coeff * product + offset``.

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
from typing import Any, Sequence

from adaptive_eager.dispatch.signature import LiftedScalar, ScalarArg, TensorArg, TensorMeta
from adaptive_eager.runtime.generic.model import (Dim, GenericMeta, GenericSegment, NotGeneric,
                                                  Size, SizeExpr, dense_order, size_at)
from adaptive_eager.runtime.generic.shapes import output_metas, shape_function
from adaptive_eager.runtime.segment import Segment

MAX_SYMBOLS_PER_SIZE = 3       # an integer argument is c * (a product of at most this many)
MIN_AFFINE_VARIANTS = 3        # two points fit any line: an offset must be confirmed by a third


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

def _lifts_scalars(segment: Segment) -> bool:
    def lifts(encoded) -> bool:
        if type(encoded) is LiftedScalar:
            return True
        return type(encoded) is tuple and any(lifts(item) for item in encoded)
    return any(lifts(op.args) or lifts(op.kwargs) for op in segment.ops)


def generalize(variants: Sequence[Segment], symbolic: bool = True) -> GenericSegment:
    """One GenericSegment for these recorded variants of one op structure (the first is the
    example). Raises NotGeneric, saying why, where they differ in more than sizes that follow
    their inputs' varying dims. ``symbolic``: derive output metas as expressions of the
    symbols once (Note [Symbolic output metas], generic/shapes.py) rather than by meta
    replay per new shape."""
    if len(variants) < 2:
        raise NotGeneric("needs at least two variants")
    if _lifts_scalars(variants[0]):
        raise NotGeneric("lifted scalars")      # Note [Lifted scalars]: not both, yet
    _check_structure(variants)
    varying = varying_dims([s.input_metas for s in variants])
    if varying is None:
        raise NotGeneric("input counts, ranks, dtypes, devices or layouts differ")
    if not varying:
        raise NotGeneric("no input size varies")
    symbols = _group_symbols(variants, varying)
    values = [tuple(size_at(s.input_metas, group[0]) for group in symbols) for s in variants]
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
        groups.setdefault(tuple(size_at(s.input_metas, dim) for s in variants), []).append(dim)
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


def _all_ints(values) -> bool:
    return all(type(v) is int for v in values)


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
