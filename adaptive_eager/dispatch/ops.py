"""What kind of aten op is this? Decided once per OpOverload, from its schema and tags.

The runtime treats four kinds differently:
  FUSIBLE   functional op with tensor outputs: deferred on the hot path, fused by the compiler.
  VIEW      output aliases an input (``func.is_view``): always run eagerly, it only makes metadata.
  MUTATING  writes one of its arguments (``alias_info.is_write``): deferred like FUSIBLE, but what
            it returns is the written argument itself.
  BOUNDARY  cannot be deferred or fused: the segment ends before it and it runs eagerly.

Every BOUNDARY carries a ``Reason`` that the stats count.
"""
from __future__ import annotations

import dataclasses
import enum

import torch


class OpKind(enum.Enum):
    FUSIBLE = "fusible"
    VIEW = "view"
    MUTATING = "mutating"
    BOUNDARY = "boundary"


class Reason(str, enum.Enum):
    """Why an op ends a segment (or a segment is not fused). Values are the names stats use."""

    HOST_SYNC = "host_sync"                    # reads a value back to Python (.item(), ==)
    DYNAMIC_SHAPE = "dynamic_output_shape"     # output shape depends on data (nonzero, unique)
    RANDOM = "random"                          # consumes the generator: kept eager, same stream
    COLLECTIVE = "collective"                  # torch.distributed communication
    CROSS_DEVICE = "cross_device"              # moves data between devices
    NON_TENSOR_OUTPUT = "non_tensor_output"    # returns something other than tensors
    METADATA_MUTATION = "metadata_mutation"    # resize_, set_, t_: changes a tensor's shape
    UNKNOWN_OP = "unknown_op"                  # not an aten op we can reason about
    # record_function ranges (e.g. "Optimizer.step"): no data, but they mark program structure,
    # and cutting there keeps segments aligned with it.
    PROFILER_RANGE = "profiler_range"
    UNSUPPORTED_TENSOR = "unsupported_tensor"  # sparse, quantized, subclass, meta, ...
    # memory a numpy array (or buffer, DLPack producer) shares: writes through it bypass torch,
    # so a deferred kernel could read them early (dispatch/escapes.py, Note [Outside memory])
    OUTSIDE_MEMORY = "outside_memory"
    UNKEYABLE_ARGUMENT = "unkeyable_argument"  # an argument we cannot put in a key (SymInt, ...)
    # a tensor on a segment output's memory made by no op the C++ backend sees, in a layout
    # no output has (runtime/segment.py, Note [Shallow copies])
    UNSEEN_ALIAS = "unseen_alias"
    # uninitialized memory (empty, empty_strided, ...): code below the dispatcher may fill it
    # without any op (ATen's at::tensor() copies its values in by pointer: ctc_loss's
    # lengths), so it is made eagerly, outside segments, as what later ops read
    UNINITIALIZED = "uninitialized"


@dataclasses.dataclass(frozen=True)
class OpClass:
    kind: OpKind
    reason: Reason | None = None
    # For MUTATING ops: per schema return, the (position, name) of the argument it returns.
    returned_args: tuple[tuple[int, str], ...] = ()
    # For MUTATING ops: written Tensor[] arguments. Under any dispatch mode, foreach in-place
    # ops do not bump their tensors' version counters as eager does; the runtime bumps these.
    written_lists: tuple[tuple[int, str], ...] = ()
    # For MUTATING ops: the ``out=`` arguments, which the op resizes when their shape is not
    # the result's (Note [Resized outputs], runtime/engine.py).
    out_args: tuple[tuple[int, str], ...] = ()
    # A matmul or convolution: Inductor calls it as an extern library kernel, so fusing the
    # segment around it saves nothing of its own time (Note [Predicted saving],
    # runtime/scheduling.py).
    extern: bool = False


# Ops that read device data back to the host; most carry no tag saying so.
_HOST_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal",
    "aten::allclose", "aten::_assert_async", "aten::_assert_async.msg",
})
_METADATA_MUTATIONS = frozenset({
    "aten::resize_", "aten::resize_as_", "aten::set_", "aten::as_strided_", "aten::_resize_output_",
})
# Ops that allocate without initializing: what their outputs hold is undefined in eager too.
UNINITIALIZED_OUTPUT_OPS = frozenset({
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::empty_permuted",
    "aten::new_empty", "aten::new_empty_strided",
})
# Ops Inductor leaves to an extern library kernel (BLAS, oneDNN, attention) on CPU and GPU.
EXTERN_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv",
    "aten::addmv", "aten::dot", "aten::_addmm_activation", "aten::_grouped_mm",
    "aten::convolution",
    "aten::convolution_backward", "aten::_convolution", "aten::mkldnn_convolution",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention_backward",
})
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional",
                                    "_c10d_functional_autograd", "_dtensor"})


# Classification reads the schema once per op overload; each read of ``schema.arguments`` or
# ``schema.returns`` builds new Python objects, so they are read once and passed around.


def _returns_only_tensors(returns: list) -> bool:
    for ret in returns:
        kind = ret.type.kind()
        if kind == "TensorType":
            continue
        if kind == "ListType" and ret.type.getElementType().kind() == "TensorType":
            continue
        if kind == "OptionalType" and ret.type.getElementType().kind() == "TensorType":
            continue
        return False
    return True


def _returned_args(arguments: list, returns: list) -> tuple[tuple[int, str], ...]:
    """Map each return of a mutating op to the written argument it aliases."""
    result = []
    for ret in returns:
        alias = ret.alias_info
        if alias is None:
            return ()
        for position, arg in enumerate(arguments):
            if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set:
                result.append((position, arg.name))
                break
        else:
            return ()
    return tuple(result)


def _written_lists(arguments: list) -> tuple[tuple[int, str], ...]:
    return tuple((position, arg.name) for position, arg in enumerate(arguments)
                 if arg.alias_info is not None and arg.alias_info.is_write
                 and arg.type.kind() == "ListType")


def _classify(func: torch._ops.OpOverload) -> OpClass:
    schema = func._schema
    name = schema.name
    namespace = func.namespace
    tags = set(func.tags)
    if namespace in _COLLECTIVE_NAMESPACES:
        return OpClass(OpKind.BOUNDARY, Reason.COLLECTIVE)
    if namespace == "profiler":
        return OpClass(OpKind.BOUNDARY, Reason.PROFILER_RANGE)
    if namespace != "aten":
        return OpClass(OpKind.BOUNDARY, Reason.UNKNOWN_OP)
    if name in _HOST_SYNC_OPS or name + "." + schema.overload_name in _HOST_SYNC_OPS:
        return OpClass(OpKind.BOUNDARY, Reason.HOST_SYNC)
    if torch.Tag.nondeterministic_seeded in tags:
        return OpClass(OpKind.BOUNDARY, Reason.RANDOM)
    if torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags:
        return OpClass(OpKind.BOUNDARY, Reason.DYNAMIC_SHAPE)
    if name in UNINITIALIZED_OUTPUT_OPS:
        return OpClass(OpKind.BOUNDARY, Reason.UNINITIALIZED)
    if name in _METADATA_MUTATIONS or torch.Tag.inplace_view in tags:
        return OpClass(OpKind.BOUNDARY, Reason.METADATA_MUTATION)
    returns = schema.returns
    if not _returns_only_tensors(returns):
        return OpClass(OpKind.BOUNDARY, Reason.NON_TENSOR_OUTPUT)
    if schema.is_mutable:                       # some argument is written (alias_info.is_write)
        arguments = schema.arguments
        returned = _returned_args(arguments, returns)
        if returns and not returned:
            return OpClass(OpKind.BOUNDARY, Reason.UNKNOWN_OP)  # returns fresh and mutates
        return OpClass(OpKind.MUTATING, returned_args=returned,
                       written_lists=_written_lists(arguments),
                       out_args=tuple((position, arg.name) for position, arg in
                                      enumerate(arguments) if arg.is_out))
    if func.is_view:
        return OpClass(OpKind.VIEW)
    if any(ret.alias_info is not None for ret in returns):
        return OpClass(OpKind.BOUNDARY, Reason.UNKNOWN_OP)  # aliases without being a view
    return OpClass(OpKind.FUSIBLE, extern=name in EXTERN_OPS)


_CLASS_CACHE: dict = {}


def classify(func: torch._ops.OpOverload) -> OpClass:
    """The OpClass of an op overload (memoized: classification reads the schema once)."""
    try:
        return _CLASS_CACHE[func]
    except KeyError:
        return _CLASS_CACHE.setdefault(func, _classify(func))


# Note [Random only through dropout]
# Attention ops are tagged nondeterministic_seeded because they can apply dropout. The CPU one
# draws nothing with ``dropout_p == 0`` (what every model passes when generating, and most when
# training) and refuses any other value: F.scaled_dot_product_attention with dropout takes the
# math path, whose bernoulli_ stays a RANDOM boundary. Classed RANDOM, each attention call ended
# its segment: a Llama decode step was cut in three per layer. So a call with ``dropout_p == 0``
# is FUSIBLE (extern: Inductor calls the same kernel); any other stays RANDOM, run eagerly as
# eager runs it. The CUDA attention ops are left RANDOM: untested here. Name -> position of
# dropout_p (also accepted as a keyword; encoded calls hold it as a ScalarArg).
_SEEDED_ONLY_BY_DROPOUT = {"aten::_scaled_dot_product_flash_attention_for_cpu": 3}
_DROPOUT_FREE = OpClass(OpKind.FUSIBLE, extern=True)


def boundary_whatever_the_arguments(func: torch._ops.OpOverload) -> bool:
    """Does every call of ``func`` end a segment (Note [Boundaries passed when idle] in
    csrc/intercept.cpp)?"""
    return classify(func).kind is OpKind.BOUNDARY and func.name() not in _SEEDED_ONLY_BY_DROPOUT


def classify_call(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> OpClass:
    """The OpClass of one call: ``classify(func)``, but Note [Random only through dropout]."""
    op_class = classify(func)
    if op_class.reason is not Reason.RANDOM:
        return op_class
    position = _SEEDED_ONLY_BY_DROPOUT.get(func.name())
    if position is None:
        return op_class
    dropout_p = args[position] if len(args) > position else kwargs.get("dropout_p", 0.0)
    return _DROPOUT_FREE if getattr(dropout_p, "value", dropout_p) == 0 else op_class
