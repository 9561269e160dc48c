"""Float scalars that change from step to step become kernel inputs instead of key parts.

# Note [Lifted scalars]
AdamW's bias corrections and an LR scheduler's learning rate are Python floats that change
every step, passed to otherwise identical ops. As parts of the key they made a new key every
step, so the optimizer step (memory-bound foreach ops over every parameter, the best fusion
target of a training step) never ran twice under one key and never fused. So where two keys
differ only in the values of float arguments, the argument positions (op overload, argument)
that differed are *lifted* from then on: each float there is recorded as an external input of
its own, a 0-dim float64 CPU tensor holding the value (``LiftedScalar`` in the key), and the
kernel reads it at run time (``aten._local_scalar_dense`` in its graph). One key then serves
every step. A float that never changes stays a constant of the key and of the kernel, where
Inductor can fold it.

Arguments of type Scalar/float (and their lists) lift. A number passed for a Tensor argument
(``x / 0.9``) is a wrapped number, which type-promotes more weakly than a 0-dim float64 tensor;
the CPU's default AdamW and Adam (one op per parameter, not foreach) divide by their bias
correction that way, so each of their segments was a new key every step, recorded in Python
for as long as the runtime watched. Such a float lifts too, as the tensor itself (the kernel
reads the 0-dim float64 input where eager read the wrapped number), but only in the
arithmetic ops of LIFTED_FOR_TENSORS and only in a call that also takes a floating CPU tensor
of one or more dims: there the two promote alike (a 0-dim tensor never sets the dtype beside a
dimensioned one of its category) and eager computes both the same way, as a CPU scalar. (Other
devices default to the foreach optimizers, which pass Scalars.)
Integers never lift (they may feed shapes). Positions are learned per process and kept;
MAX_POSITIONS bounds them.
"""
from __future__ import annotations

import functools
import threading
from typing import Any

import cachetools
import torch

from adaptive_eager.dispatch.signature import LiftedScalar, ScalarArg, TensorArg
from adaptive_eager.fork_safety import reinit_in_child
from adaptive_eager.runtime.stats import counters

MAX_POSITIONS = 256        # (op, argument) positions lifted, at most
BLIND_KEYS_KEPT = 1024     # recent keys remembered by their scalar-blind form

_lock = threading.Lock()
reinit_in_child(_lock)   # Note [Fork] (runtime/engine.py)
# op overload -> the argument positions (index, or keyword name) it lifts; replaced whole
# on change, so the recording thread reads it without the lock
_positions: dict[Any, frozenset] = {}
_recent: cachetools.LRUCache = cachetools.LRUCache(maxsize=BLIND_KEYS_KEPT)
_VALUE_TYPES = ("number", "float", "Optional[number]", "Optional[float]", "List[number]",
                "List[float]")   # Scalar is "number" in str(argument.type)
_aten = torch.ops.aten
LIFTED_FOR_TENSORS = frozenset([
    _aten.add.Tensor, _aten.add_.Tensor, _aten.sub.Tensor, _aten.sub_.Tensor,
    _aten.mul.Tensor, _aten.mul_.Tensor, _aten.div.Tensor, _aten.div_.Tensor])


def lifted_positions(func) -> frozenset | None:
    """The positions of ``func``'s arguments recorded as LiftedScalars (None: none)."""
    return _positions.get(func)


def learn(key: tuple) -> None:
    """A new key: where it equals a recent key but for float values, lift those positions."""
    ops = key[1]
    if not any(_has_float(op[1]) or _has_float(op[2]) for op in ops):
        return
    blind = (key[0], tuple((op[0], _blind(op[1]), _blind(op[2])) for op in ops), key[2])
    with _lock:
        earlier = _recent.get(blind)
        _recent[blind] = key
    if earlier is None or earlier == key:
        return
    found = {pair for a, b in zip(earlier[1], ops) for pair in _differing(a, b)}
    if found:
        _add(found)


def _has_float(encoded: Any) -> bool:
    if type(encoded) is ScalarArg:
        return encoded.kind is float
    if type(encoded) is tuple:
        return any(_has_float(item) for item in encoded)
    return False


def _blind(encoded: Any) -> Any:
    """``encoded`` with every float's value erased."""
    if type(encoded) is ScalarArg:
        return ScalarArg(float, None) if encoded.kind is float else encoded
    if type(encoded) is tuple:
        return tuple([_blind(item) for item in encoded])
    return encoded


def _differing(a: tuple, b: tuple):
    """(func, position) for each argument of two calls of one op whose floats differ, where
    that argument may lift."""
    func = a[0]
    schema_types = {argument.name: str(argument.type) for argument in func._schema.arguments}
    names = list(schema_types)
    for index, (x, y) in enumerate(zip(a[1], b[1])):
        if x != y and _may_lift(func, schema_types.get(names[index] if index < len(names)
                                                       else ""), x):
            yield func, index
    for (name, x), (_, y) in zip(a[2], b[2]):
        if x != y and _may_lift(func, schema_types.get(name), x):
            yield func, name


def _may_lift(func, schema_type: str | None, encoded: Any) -> bool:
    if schema_type in _VALUE_TYPES:
        return True
    return schema_type == "Tensor" and func in LIFTED_FOR_TENSORS and \
        type(encoded) is ScalarArg and encoded.kind is float


@functools.lru_cache(maxsize=None)
def tensor_positions(func) -> frozenset:
    """The positions (index and name) of ``func``'s Tensor arguments: a LiftedScalar there
    stands for a wrapped number, and a kernel reads it as the 0-dim tensor itself."""
    arguments = func._schema.arguments
    return frozenset([p for i, argument in enumerate(arguments)
                      if str(argument.type) == "Tensor" for p in (i, argument.name)])


def promotes_like_a_number(args: tuple, kwargs: tuple) -> bool:
    """Does this call (encoded) take a floating CPU tensor of one or more dims, beside which a
    0-dim float64 tensor promotes as a wrapped number does? (On other devices the kernel
    would read a CPU tensor beside them: not tried, so not done.)"""
    values = list(args) + [value for _, value in kwargs]
    return any(type(v) is TensorArg and len(v.shape) and v.dtype.is_floating_point and
               v.device.type == "cpu" for v in values)


def _add(found: set) -> None:
    global _positions
    with _lock:
        positions = dict(_positions)
        added = 0
        for func, position in found:
            known = positions.get(func, frozenset())
            if position in known or sum(map(len, positions.values())) >= MAX_POSITIONS:
                continue
            positions[func] = known | {position}
            added += 1
        _positions = positions
    if added:
        counters.add("lifted_positions", added)


def lift(encoded: Any, new_input) -> Any:
    """``encoded`` (one argument) with each float a LiftedScalar on ``new_input(tensor)``'s
    ref."""
    if type(encoded) is ScalarArg and encoded.kind is float:
        return LiftedScalar(new_input(torch.tensor(encoded.value, dtype=torch.float64)))
    if type(encoded) is tuple:
        return tuple([lift(item, new_input) for item in encoded])
    return encoded


def reset() -> None:
    """Forget every lifted position (tests)."""
    global _positions
    with _lock:
        _positions = {}
        _recent.clear()
