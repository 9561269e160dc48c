"""Shape signatures: an op call turned into a hashable, comparable description.

A signature replaces every tensor argument by a ``TensorArg`` (where it comes from in the
segment, plus shape, stride, dtype, device, alignment) and every Python scalar by a
``ScalarArg`` carrying its type, because ``1``, ``1.0`` and ``True`` hash alike but compute
differently. Lists become tuples. The same structure is the template the compiler rebuilds
the graph from, so recording never has to keep the arguments themselves.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from adaptive_eager.dispatch.ops import Reason

# Where a tensor comes from inside a segment: ("in", k) is the k-th external input,
# ("out", op_index, output_index) the output of an earlier op in the same segment.
Ref = tuple

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_PASSTHROUGH_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format, str,
                      type(None))
_SCALAR_TYPES = (bool, int, float, complex)
_STRIDED = torch.strided
_ALIGNMENT_BYTES = 16
# A namedtuple's own __new__ is a Python function; building the tuple directly saves ~140 ns
# per tensor of every recorded op.
_new_tuple = tuple.__new__


class TensorArg(NamedTuple):
    ref: Ref
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    aligned: bool  # data pointer a multiple of 16 bytes: compiled kernels may assume it


class ScalarArg(NamedTuple):
    kind: type
    value: Any


class LiftedScalar:
    """A float argument that changes between runs of one segment (Note [Lifted scalars] in
    runtime/scalars.py): its value is the external input ``ref`` (a 0-dim float64 tensor), so
    the key holds where it is, not what it is. Not a tuple, so that walks over encoded
    arguments never descend into it."""
    __slots__ = ("ref",)

    def __init__(self, ref: Ref) -> None:
        self.ref = ref

    def __eq__(self, other: Any) -> bool:
        return type(other) is LiftedScalar and other.ref == self.ref

    def __hash__(self) -> int:
        return hash(("lifted", self.ref))

    def __repr__(self) -> str:          # part of stable digests: keep it fixed
        return f"LiftedScalar({self.ref!r})"

    def __reduce__(self):
        return LiftedScalar, (self.ref,)


class TensorMeta(NamedTuple):
    """What it takes to allocate a tensor like a recorded output."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return _new_tuple(cls, (tensor.shape, tensor.stride(), tensor.dtype, tensor.device))

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


class Unkeyable(Exception):
    """An argument that cannot be part of a key; ``reason`` is a dispatch.ops.Reason."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def is_plain_tensor(value: Any) -> bool:
    return type(value) in _PLAIN_TENSOR_TYPES


def tensor_arg(tensor: torch.Tensor, ref: Ref) -> TensorArg:
    # is_meta, not device.type == "meta": every op pays this, and .type builds a string
    if tensor.layout is not _STRIDED or tensor.is_meta or tensor.is_quantized:
        raise Unkeyable(Reason.UNSUPPORTED_TENSOR, f"{tensor.layout} {tensor.device} tensor")
    offset = tensor.storage_offset()
    aligned = offset == 0 or (offset * tensor.element_size()) % _ALIGNMENT_BYTES == 0
    return _new_tuple(TensorArg, (ref, tensor.shape, tensor.stride(), tensor.dtype,
                                  tensor.device, aligned))


def encode(value: Any, arg_of: Callable[[torch.Tensor], TensorArg]) -> Any:
    """Encode one argument; ``arg_of`` makes the TensorArg of each plain tensor."""
    kind = type(value)
    if kind in _PLAIN_TENSOR_TYPES:
        return arg_of(value)
    if kind in _SCALAR_TYPES:
        return ScalarArg(kind, value)
    if kind is list or kind is tuple:
        return tuple([encode(item, arg_of) for item in value])
    if isinstance(value, _PASSTHROUGH_TYPES):
        return value
    if isinstance(value, torch.Tensor):
        raise Unkeyable(Reason.UNSUPPORTED_TENSOR, f"tensor subclass {kind.__name__}")
    raise Unkeyable(Reason.UNKEYABLE_ARGUMENT, f"argument of type {kind.__name__}")


def encode_call(args: tuple, kwargs: dict, arg_of: Callable) -> tuple[tuple, tuple]:
    """Encode the arguments of one op call: (encoded args, encoded kwargs as (name, value)s)."""
    encoded_args = tuple([encode(arg, arg_of) for arg in args])
    if not kwargs:
        return encoded_args, ()
    return encoded_args, tuple([(name, encode(arg, arg_of)) for name, arg in kwargs.items()])


def decode(encoded: Any, tensor_of: Callable[[TensorArg], Any]) -> Any:
    """Inverse of ``encode``, with each TensorArg (and LiftedScalar) replaced by
    ``tensor_of(arg)``."""
    if isinstance(encoded, TensorArg) or type(encoded) is LiftedScalar:
        return tensor_of(encoded)
    if isinstance(encoded, ScalarArg):
        return encoded.value
    if isinstance(encoded, tuple):
        return [decode(item, tensor_of) for item in encoded]
    return encoded


def tensor_args(encoded: Any):
    """Every TensorArg inside an encoded argument, in order."""
    if isinstance(encoded, TensorArg):
        yield encoded
    elif isinstance(encoded, tuple) and not isinstance(encoded, ScalarArg):
        for item in encoded:
            yield from tensor_args(item)


def without_input_identity(encoded: Any) -> Any:
    """``encoded`` with every external input's number erased: the same call on other inputs."""
    if isinstance(encoded, TensorArg):
        return encoded._replace(ref=("in",)) if encoded.ref[0] == "in" else encoded
    if type(encoded) is LiftedScalar:
        return LiftedScalar(("in",))
    if isinstance(encoded, tuple) and not isinstance(encoded, ScalarArg):
        return tuple([without_input_identity(item) for item in encoded])
    return encoded


def without_shapes(encoded: Any) -> Any:
    """``encoded`` with tensor shapes and strides reduced to ranks, and integer lists (the
    sizes of view, reshape, expand...) to their lengths: the call's structure."""
    kind = type(encoded)           # not isinstance: TensorArg and ScalarArg are tuples too
    if kind is TensorArg:
        return (encoded.ref, len(encoded.shape), encoded.dtype, encoded.device)
    if kind is tuple:
        if encoded and type(encoded[0]) is ScalarArg and all(
                type(item) is ScalarArg and item.kind is int for item in encoded):
            return ("ints", len(encoded))
        return tuple([without_shapes(item) for item in encoded])
    return encoded


def is_cpu_scalar(arg: TensorArg) -> bool:
    """0-dim CPU tensors (wrapped Python numbers) may sit beside tensors of any device."""
    return arg.device.type == "cpu" and not arg.shape


KEY_CONTEXT_FIELDS = ("torch_version", "default_dtype", "grad_enabled", "inference_mode",
                      "autocast_cpu", "autocast_cpu_dtype", "autocast_cuda",
                      "deterministic_algorithms")


def key_context() -> tuple:
    """Ambient state that changes what ops compute; part of every segment key (the names of
    its parts are KEY_CONTEXT_FIELDS)."""
    return (
        torch.__version__,
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.are_deterministic_algorithms_enabled(),
    )
