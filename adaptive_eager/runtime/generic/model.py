"""A shape-generic segment: one op structure for every size its symbols can take.

``GenericSegment`` holds which input dims vary (each group of dims that always share a size is
one *symbol*), the ops' calls with their varying integers as ``SizeExpr``s of the symbols, and
what a compile assumed of them (``conditions``: Note [Symbolic compile], generic/kernel.py);
``bind`` finds the symbol values for concrete input metas, or refuses them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Sequence

import torch

from adaptive_eager.dispatch.signature import TensorMeta
from adaptive_eager.runtime.segment import Segment

Dim = tuple[int, int]          # (input index, dim)
MIN_SYMBOL_VALUE = 2           # Inductor specializes sizes 0 and 1; a symbol never takes them


class NotGeneric(Exception):
    """The variants, or the compiled kernel, cannot serve other sizes."""


@dataclasses.dataclass(frozen=True)
class SizeExpr:
    """``coeff * prod(symbol values[j] for j in symbols) + offset``: a size that follows the
    inputs (an offset: Note [Affine sizes], generic/derive.py).

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


# ------------------------------------------------------------------ layouts

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


# ------------------------------------------------------------------ the generic segment

@dataclasses.dataclass(frozen=True)
class GenericSegment:
    """A segment's op structure for every size its symbols can take."""
    example: Segment                        # the first variant: ops, refs, devices, hints
    symbols: tuple[tuple[Dim, ...], ...]    # per symbol: the input dims that have its size
    hints: tuple[int, ...]                  # the example's value of each symbol
    inputs: tuple[GenericMeta, ...]         # per external input
    calls: tuple[tuple[tuple, tuple], ...]  # per op (args, kwargs); varying ints as SizeExpr
    live: tuple[GenericMeta, ...]           # per live output: the buffers a kernel writes
    # what its compile assumed of the symbols (Note [Symbolic compile], generic/kernel.py):
    # Python expressions over the symbol values ``v`` that must all hold for its kernel to
    # serve them
    conditions: tuple[str, ...] = ()
    # symbol values -> every op's output metas; None: replay on meta tensors instead
    # (generic/shapes.py)
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
            sizes = {size_at(input_metas, dim) for dim in group}
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


def size_at(metas: Sequence[TensorMeta], dim: Dim) -> int | None:
    """The size at ``dim`` of these metas (None past a tensor's rank)."""
    shape = metas[dim[0]].shape
    return shape[dim[1]] if dim[1] < len(shape) else None


def to_wire(generic: GenericSegment) -> tuple:
    """What the compile worker sends back: everything but the example (the program has it)
    and the shape function."""
    return (generic.symbols, generic.hints, generic.inputs, generic.calls, generic.live,
            generic.conditions)


def from_wire(example: Segment, wire: tuple) -> GenericSegment:
    symbols, hints, inputs, calls, live, conditions = wire
    return GenericSegment(example, symbols, hints, inputs, calls, live, conditions)
