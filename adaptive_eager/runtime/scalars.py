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

Only arguments of type Scalar/float (and their lists) lift: a number passed for a Tensor
argument (``x * 0.5``) type-promotes as a wrapped number, which a 0-dim float64 tensor does
not. Integers never lift (they may feed shapes). Positions are learned per process and kept;
MAX_POSITIONS bounds them.
"""
from __future__ import annotations

import threading
from typing import Any

import cachetools
import torch

from adaptive_eager.dispatch.signature import LiftedScalar, ScalarArg
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
        if x != y and schema_types.get(names[index] if index < len(names) else "") in _VALUE_TYPES:
            yield func, index
    for (name, x), (_, y) in zip(a[2], b[2]):
        if x != y and schema_types.get(name) in _VALUE_TYPES:
            yield func, name


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
