"""A recorded Segment as a runnable program: an FX graph for the compiler, or an eager replay.

Both take the same calling convention, ``(*external_inputs, *output_buffers)``: the graph ends
by copying each live output into its buffer (``aten.copy_(buffer, value)``), which Inductor turns
into the kernel writing straight into the caller's memory, with no temporary.
"""
from __future__ import annotations

import operator
from typing import Iterable

import torch
import torch.fx as fx

from adaptive_eager.dispatch.ops import OpKind
from adaptive_eager.dispatch.signature import LiftedScalar, Ref, TensorArg, decode
from adaptive_eager.runtime import clock
from adaptive_eager.runtime.scalars import tensor_positions
from adaptive_eager.runtime.segment import SINGLE, VOID, OpRecord, Segment, flatten_outputs

aten = torch.ops.aten


def build_graph(segment: Segment, live_refs: tuple[Ref, ...]) -> fx.GraphModule:
    """FX graph computing ``segment`` and writing ``live_refs`` into trailing buffer inputs."""
    graph = fx.Graph()
    inputs = [graph.placeholder(f"in_{k}") for k in range(len(segment.input_metas))]
    buffers = [graph.placeholder(f"out_{k}") for k in range(len(live_refs))]
    values: dict[Ref, fx.Node] = {}

    def node_of(arg: TensorArg | LiftedScalar) -> fx.Node:
        if type(arg) is LiftedScalar:        # Note [Lifted scalars] (runtime/scalars.py)
            return graph.call_function(aten._local_scalar_dense.default, (inputs[arg.ref[1]],))
        return inputs[arg.ref[1]] if arg.ref[0] == "in" else values[arg.ref]

    def number_tensor_of(arg: LiftedScalar) -> fx.Node:
        return inputs[arg.ref[1]]

    for index, op in enumerate(segment.ops):
        args, kwargs = _decode_call(op, node_of, number_tensor_of)
        single = _cat_of_one(op, args, kwargs)
        if single is not None:
            values[("out", index, 0)] = graph.call_function(*single)
            continue
        per_tensor = _per_tensor_calls(op, args, kwargs)
        if per_tensor is not None:
            nodes = [graph.call_function(func, tuple(call), keywords)
                     for func, call, keywords in per_tensor]
            if op.kind is not OpKind.MUTATING:
                values.update((("out", index, i), node) for i, node in enumerate(nodes))
            continue
        name_outputs(graph, values, index, op, graph.call_function(op.func, tuple(args), kwargs))
    return write_buffers(graph, buffers, live_refs, values)


# Note [Lifted foreach scalars]
# Inductor lowers a ``_foreach_*.ScalarList`` op whose scalars are constants, but not one whose
# scalars are read from inputs (Note [Lifted scalars]): it calls the aten op as an extern
# kernel, between kernels that write temporaries, and AdamW's update ran ~3x slower fused
# than eager. So a lifted one goes into the graph as the per-tensor ops it stands for, which
# Inductor fuses; they are what the CPU foreach kernels run per tensor anyway
# (``t.div_(scalars[i])``, ``self[i].addcdiv_(t1[i], t2[i], scalars[i])``).
_PER_TENSOR = {    # foreach name -> (per-tensor overload, its in-place one, scalar as kwarg)
    "_foreach_add": ("add.Scalar", "add_.Scalar", None),
    "_foreach_sub": ("sub.Scalar", "sub_.Scalar", None),
    "_foreach_mul": ("mul.Scalar", "mul_.Scalar", None),
    "_foreach_div": ("div.Scalar", "div_.Scalar", None),
    "_foreach_pow": ("pow.Tensor_Scalar", "pow_.Scalar", None),
    "_foreach_clamp_min": ("clamp_min.default", "clamp_min_.default", None),
    "_foreach_clamp_max": ("clamp_max.default", "clamp_max_.default", None),
    "_foreach_lerp": ("lerp.Scalar", "lerp_.Scalar", None),
    "_foreach_addcdiv": ("addcdiv.default", "addcdiv_.default", "value"),
    "_foreach_addcmul": ("addcmul.default", "addcmul_.default", "value"),
}


def _per_tensor_calls(op: OpRecord, args: list, kwargs: dict) -> list | None:
    """(op, args, kwargs) of each per-tensor call a lifted foreach ScalarList op stands for
    (None: it is not one)."""
    func = op.func
    if func._overloadname != "ScalarList" or kwargs or not isinstance(args[-1], list) or \
            not any(isinstance(value, fx.Node) for value in args[-1]):
        return None
    name = func.__name__.split(".")[0]
    entry = _PER_TENSOR.get(name.rstrip("_"))
    if entry is None:
        return None
    packet, overload = entry[name.endswith("_")].split(".")
    per_tensor, as_kwarg = getattr(getattr(aten, packet), overload), entry[2]
    *lists, scalars = args
    calls = []
    for i, scalar in enumerate(scalars):
        tensors = [tensor_list[i] for tensor_list in lists]
        calls.append((per_tensor, tensors, {as_kwarg: scalar}) if as_kwarg
                     else (per_tensor, [*tensors, scalar], {}))
    return calls


# Note [A cat of one tensor]
# ``torch.cat`` skips empty 1-D tensors (transformers' key/value caches start as
# ``torch.tensor([])``). Eager's cat of what is left, one tensor, returns a new contiguous
# tensor; Inductor's decomposition returns a clone in that tensor's own layout. The views the
# segment recorded after it carry eager's strides (``matmul`` records a ``_reshape_alias``),
# and tracing them over the other layout failed: GPT-2's attention never compiled. So such a
# cat goes into the graph as the copy eager makes, in eager's recorded layout.

def _cat_of_one(op: OpRecord, args: list, kwargs: dict) -> tuple | None:
    """(func, args, kwargs) of the copy a ``cat`` of one non-empty tensor makes, in the
    layout eager gave it (Note [A cat of one tensor]); None for any other op or cat."""
    if op.func is not aten.cat.default or \
            not all(type(tensor) is TensorArg for tensor in op.args[0]):
        return None
    out = op.out_metas[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    kept = [index for index, tensor in enumerate(op.args[0])
            if not _skipped_by_cat(tensor.shape, dim)]
    if len(kept) != 1 or out is None:
        return None
    tensor, node = op.args[0][kept[0]], args[0][kept[0]]
    layout = _memory_format(out)
    if tensor.shape != out.shape or layout is None:
        return None
    return aten._to_copy.default, (node,), {"dtype": out.dtype, "memory_format": layout}


def _skipped_by_cat(shape: tuple, dim: int) -> bool:
    return shape == (0,) or (-len(shape) <= dim < len(shape) and shape[dim] == 0)


def _memory_format(meta) -> torch.memory_format | None:
    """The memory format whose strides ``meta`` has (None: neither of these)."""
    probe = torch.empty_strided(meta.shape, meta.stride, device="meta")   # no memory
    for layout in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d):
        if probe.is_contiguous(memory_format=layout):
            return layout
    return None


def name_outputs(graph: fx.Graph, values: dict, index: int, op: OpRecord, node: fx.Node) -> None:
    """Record in ``values`` the nodes of the tensors op ``index`` returns (by Ref)."""
    if op.kind is OpKind.MUTATING or op.container == VOID:
        return                            # it returns tensors that already have a name
    if op.container == SINGLE:
        values[("out", index, 0)] = node
        return
    for out_index, meta in enumerate(op.out_metas):
        if meta is not None:
            values[("out", index, out_index)] = graph.call_function(
                operator.getitem, (node, out_index))


def write_buffers(graph: fx.Graph, buffers: list, live_refs: tuple, values: dict) -> fx.GraphModule:
    """End ``graph`` by copying each live output into its buffer input."""
    for buffer, ref in zip(buffers, live_refs):
        graph.call_function(aten.copy_.default, (buffer, values[ref]))
    graph.output(())
    graph.eliminate_dead_code()
    return fx.GraphModule(torch.nn.Module(), graph)


def run_eagerly(ops: Iterable[OpRecord], inputs: list,
                targets: list[tuple[Ref, torch.Tensor]]) -> float:
    """Execute recorded ops per-op and copy the values of ``targets`` refs into their tensors;
    return the seconds spent inside the ops.

    Used when a deferred segment does not run fused (divergence, kernel failure, a timed
    trial): the results are exactly what eager would have computed, written into the buffers
    the user already holds."""
    values: dict[Ref, torch.Tensor] = {}
    seconds = 0.0

    def tensor_of(arg: TensorArg | LiftedScalar) -> torch.Tensor | float:
        if type(arg) is LiftedScalar:
            return inputs[arg.ref[1]].item()
        return inputs[arg.ref[1]] if arg.ref[0] == "in" else values[arg.ref]

    for index, op in enumerate(ops):
        args, kwargs = _decode_call(op, tensor_of)
        started = clock.perf_counter()
        out = op.func(*args, **kwargs)
        seconds += clock.perf_counter() - started
        if op.kind is OpKind.MUTATING:
            continue
        for out_index, tensor in enumerate(flatten_outputs(out)[1]):
            values[("out", index, out_index)] = tensor
    for ref, target in targets:
        target.copy_(values[ref])
    return seconds


def _decode_call(op: OpRecord, tensor_of, number_tensor_of=None) -> tuple[list, dict]:
    """``op``'s arguments, each TensorArg and LiftedScalar by ``tensor_of``; a LiftedScalar
    passed for a Tensor argument (a wrapped number: Note [Lifted scalars]) by
    ``number_tensor_of`` where given."""
    if number_tensor_of is None:            # per-op replays: no per-argument call
        return ([decode(arg, tensor_of) for arg in op.args],
                {name: decode(value, tensor_of) for name, value in op.kwargs})

    def value(position, arg):
        if type(arg) is LiftedScalar and position in tensor_positions(op.func):
            return number_tensor_of(arg)
        return decode(arg, tensor_of)
    args = [value(index, arg) for index, arg in enumerate(op.args)]
    kwargs = {name: value(name, arg) for name, arg in op.kwargs}
    return args, kwargs
