"""The Segment record and the builder that records one.

A segment is a short run of aten ops between boundaries. While it is recorded (cold path) or
matched against a compiled one (hot path), a ``SegmentBuilder`` gives every tensor a ``Ref``
(see dispatch.signature), so a recorded op says "add(in0, out(2,0))" rather than holding tensors.
The finished, frozen ``Segment`` is what flows on: key → policy → compile → replay.

# Note [Liveness]
Outputs are held only through weakrefs. When the segment ends, an output whose weakref is still
alive is *live*: the user (or autograd, which saved it) can still read it, so a fused kernel must
write it. Dead intermediates need no buffer. Views are never written themselves (an expanded
view cannot even be): an output is also live when a view of it is, and is then written whole
into the view's storage. Views of external inputs need nothing: they see the input itself. The
key of a segment includes its live set, so a kernel only replays where it writes all that is
live.

# Note [Results thrown away]
A loop that drops what it computes (``for _ in range(n): model(x)``, the first timing loop
anyone writes) leaves nothing live, and a kernel of nothing would have no output (Inductor's
cannot even be saved): its compile failed and the loop ran per-op for good. Where nothing is
live and nothing is written, the segment's final results count as live instead, so such a
loop fuses and costs what computing its results costs, as it does in eager. They are read from
the records, since a run the C++ backend hands over brings no tensor for an output already
dead (Engine.adopt_native_run).
"""
from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from adaptive_eager.dispatch.escapes import (raw_untyped_storage, shares_outside_memory,
                                             storage_address, storage_weak_ref)
from adaptive_eager.dispatch.ops import OpClass, OpKind, Reason
from adaptive_eager.runtime.buffers import pooled_storages
from adaptive_eager.dispatch.signature import (Ref, TensorArg, TensorMeta, Unkeyable, encode_call,
                                               is_cpu_scalar, is_plain_tensor, tensor_arg,
                                               tensor_args, without_input_identity)
from adaptive_eager.runtime import clock
from adaptive_eager.runtime.scalars import (lift, lifted_positions, promotes_like_a_number,
                                            tensor_positions)

SINGLE, TUPLE, LIST, VOID = "single", "tuple", "list", "void"
_new_tuple = tuple.__new__      # skips OpRecord's Python-level __new__: once per recorded op


def flatten_outputs(out: Any) -> tuple[str, tuple]:
    """(container kind, flat outputs) of what an op returned."""
    if out is None:
        return VOID, ()
    if isinstance(out, torch.Tensor):
        return SINGLE, (out,)
    return (TUPLE if isinstance(out, tuple) else LIST), tuple(out)


def unflatten_outputs(container: str, flat: list) -> Any:
    if container == VOID:
        return None
    if container == SINGLE:
        return flat[0]
    return tuple(flat) if container == TUPLE else list(flat)


# Note [Shallow copies]
# Autograd saves an op's output for its backward as a shallow copy (tensor_data(): a new
# TensorImpl on the same storage, made without any op), and unpacking a saved output for the
# backward makes another. Under a Python dispatch mode each copy is made by an aten.detach the
# mode sees (TensorImpl::shallow_copy_and_detach asks the mode), so it is a view of the output
# like any other. The C++ backend (dispatch/interceptor.py) sees no op, which broke two things:
# - Liveness: an intermediate whose only survivor was autograd's copy was judged dead, so its
#   kernel did not write it and a later backward read an unfilled buffer. So with that
#   backend, outputs are also live while something else holds their storage (a weak
#   reference to it: held strongly, it would keep every intermediate's memory until the
#   segment ends). Pooled buffers (runtime/buffers.py) are held by the pool too.
# - Dataflow: a backward op in the same segment as its forward reads the unpacked copy, a
#   tensor the segment did not know, so it was recorded as a new external input. Fused, that
#   input is the deferred output's own buffer, read before the kernel fills it (the first
#   fused run's probation saw garbage on both sides, and kept garbage gradients). So with
#   that backend, an unknown tensor on the storage of one of the segment's outputs, with the
#   same offset, shape, strides and dtype as that output (or a view of it), *is* that output:
#   it gets the output's ref, as the detach's view would under the Python mode. Any other
#   tensor on an output's storage made without an op cannot be followed: it ends the segment
#   (reason unseen_alias), so the deferred work is done before it is read.
_use_count = torch._C._storage_Use_Count


def _layout(tensor: torch.Tensor) -> tuple:
    return tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype


class OpRecord(NamedTuple):
    """One recorded op call. ``signature`` (func, args, kwargs) is what the hot path matches."""
    func: torch._ops.OpOverload
    op_class: OpClass
    args: tuple                     # encoded (dispatch.signature.encode)
    kwargs: tuple                   # encoded, as (name, value) pairs
    container: str                  # SINGLE / TUPLE / LIST / VOID
    out_metas: tuple                # TensorMeta (or None) per flat output
    signature: tuple

    @property
    def kind(self) -> OpKind:
        return self.op_class.kind


@dataclasses.dataclass(frozen=True)
class Segment:
    """A finished segment: ops, external inputs, the outputs live at its end, and its key."""
    ops: tuple[OpRecord, ...]
    input_metas: tuple[TensorMeta, ...]
    live_refs: tuple[Ref, ...]
    context: tuple

    @functools.cached_property
    def key(self) -> tuple:
        return (self.context, tuple(op.signature for op in self.ops), self.live_refs)

    @property
    def compute_ops(self) -> int:
        """Ops that do arithmetic (not views): what fusion can save."""
        return sum(op.kind is not OpKind.VIEW for op in self.ops)

    @functools.cached_property
    def written_inputs(self) -> frozenset:
        """The external inputs whose memory an in-place op of the segment writes, directly or
        through a view made in the segment (fused_runs: another input on that memory)."""
        written = set()
        for op in self.ops:
            if op.kind is OpKind.MUTATING:
                for position, name in op.op_class.returned_args + op.op_class.written_lists:
                    encoded = op.args[position] if position < len(op.args) else \
                        dict(op.kwargs).get(name)
                    items = encoded if type(encoded) is tuple else (encoded,)
                    written.update(self._input_under(item.ref) for item in items
                                   if type(item) is TensorArg)
        written.discard(None)
        return frozenset(written)

    def _input_under(self, ref: Ref) -> int | None:
        """The external input whose memory ``ref`` is (through views), or None (new memory)."""
        while ref[0] != "in":
            op = self.ops[ref[1]]
            base = next((arg for arg in op.args if type(arg) is TensorArg), None)
            if op.kind is not OpKind.VIEW or base is None:
                return None
            ref = base.ref
        return ref[1]

    def out_meta(self, ref: Ref) -> TensorMeta:
        _, op_index, out_index = ref
        return self.ops[op_index].out_metas[out_index]

    def describe(self) -> str:
        return " → ".join(str(op.func).replace("aten.", "") for op in self.ops)


def to_wire(segment: Segment) -> tuple:
    """``segment`` as plain picklable data (ops by name), for the compile worker: a few
    hundred microseconds, where pickling its FX graph costs ~10 ms of the program's time."""
    ops = tuple((op.func.namespace, op.func._opname, op.func._overloadname, op.args,
                 op.kwargs, op.container, op.out_metas) for op in segment.ops)
    return ops, segment.input_metas, segment.live_refs


def from_wire(wire: tuple) -> Segment:
    """Inverse of ``to_wire`` (without the key context, which only keys need)."""
    from adaptive_eager.dispatch.ops import classify_call
    wire_ops, input_metas, live_refs = wire
    ops = []
    for namespace, name, overload, args, kwargs, container, out_metas in wire_ops:
        func = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        ops.append(OpRecord(func, classify_call(func, args, dict(kwargs)), args, kwargs,
                            container, out_metas, (func, args, kwargs)))
    return Segment(tuple(ops), input_metas, live_refs, ())


def final_results(ops) -> tuple[Ref, ...]:
    """Note [Results thrown away]: the non-view outputs of ``ops`` that no later compute op
    reads (a view's reads do not count: a result reshaped at the end is still a result),
    from the records: a handed-over run's dead outputs are not among a builder's outputs."""
    read = {arg.ref for op in ops if op.kind is not OpKind.VIEW
            for arg in tensor_args((op.args, op.kwargs))}
    return tuple(ref for index, op in enumerate(ops) if op.kind is OpKind.FUSIBLE
                 for out, meta in enumerate(op.out_metas)
                 if meta is not None and (ref := ("out", index, out)) not in read)


class SegmentBuilder:
    """Records a segment op by op; knows each tensor's Ref and which outputs are still alive."""

    def __init__(self, context: tuple, unseen_copies: bool = False) -> None:
        self.context = context
        self._unseen_copies = unseen_copies            # Note [Shallow copies]
        self.started = clock.perf_counter()            # a segment's wall time starts here
        self.compute_seconds = 0.0                     # of which inside per-op calls
        self.extern_seconds = 0.0                      # of which inside extern ops (matmuls)
        self.ops: list[OpRecord] = []
        self.inputs: list[torch.Tensor] = []           # strong: fused kernels read them at the end
        self._known: dict[int, tuple[weakref.ref, Ref]] = {}
        self._outputs: dict[Ref, weakref.ref] = {}     # non-view outputs: what kernels write
        self._views_of: dict[Ref, list[weakref.ref]] = {}  # output ref -> views of it
        self._view_roots: dict[Ref, Ref] = {}
        self._storages: dict[Ref, StorageWeakRef] = {}   # Note [Shallow copies]
        # Note [Shallow copies]: StorageImpl address -> (a weak reference to the storage,
        # {(offset, shape, strides, dtype): ref of the output or view with that layout})
        self._layouts: dict[int, tuple[StorageWeakRef, dict[tuple, Ref]]] = {}
        self.device: torch.device | None = None       # every tensor of a segment lives here
        self._signatures: dict[Any, list[tuple]] = {}  # func -> signatures recorded for it
        self._opening_shape: tuple | None = None      # ops[0].signature, inputs unnumbered

    def __len__(self) -> int:
        return len(self.ops)

    def _new_input(self, tensor: torch.Tensor) -> Ref:
        """Register ``tensor`` as the segment's next external input (it is not known yet)."""
        if shares_outside_memory(tensor):
            raise Unkeyable(Reason.OUTSIDE_MEMORY, "memory shared with numpy or a buffer")
        ref = ("in", len(self.inputs))
        self.inputs.append(tensor)
        self._known[id(tensor)] = (weakref.ref(tensor), ref)
        return ref

    def add_input(self, tensor: torch.Tensor) -> None:
        """An external input a run deferred elsewhere (the C++ hot path) already numbered:
        they come in order."""
        self._new_input(tensor)
        if tensor.device.type != "cpu" or tensor.dim():   # 0-dim CPU scalars go anywhere
            self.device = self.device or tensor.device

    def encode(self, args: tuple, kwargs: dict, func=None) -> tuple[tuple, tuple]:
        """Encode the arguments of a call of ``func``; on failure, forget inputs this call
        registered. Floats where ``func`` lifts them become inputs (Note [Lifted scalars]);
        without ``func`` nothing is lifted.

        Raises Unkeyable for arguments no key can hold, and for ops that leave the segment's
        device (cross-device copies are boundaries)."""
        registered = len(self.inputs)
        try:
            encoded = encode_call(args, kwargs, self._tensor_arg)
            positions = None if func is None else lifted_positions(func)
            if positions is not None:
                encoded = self._lift(func, positions, *encoded)
            device = kwargs.get("device")
            if device is not None and torch.device(device) != self.device:
                self._enter_device(torch.device(device))
            return encoded
        except Unkeyable:
            self.drop_inputs_from(registered)
            raise

    def _lift(self, func, positions: frozenset, args: tuple,
              kwargs: tuple) -> tuple[tuple, tuple]:
        wrapped = tensor_positions(func)
        if not positions.isdisjoint(wrapped) and \
                not promotes_like_a_number(args, kwargs):   # Note [Lifted scalars]
            positions = positions - wrapped
        new_input = self._new_input
        args = tuple([lift(arg, new_input) if index in positions else arg
                      for index, arg in enumerate(args)])
        kwargs = tuple([(name, lift(value, new_input) if name in positions else value)
                        for name, value in kwargs])
        return args, kwargs

    def drop_inputs_from(self, count: int) -> None:
        """Forget external inputs registered after the first ``count`` (an op that was encoded
        but then belongs to the next segment must not leave inputs in this one)."""
        for tensor in self.inputs[count:]:
            self._known.pop(id(tensor), None)
        del self.inputs[count:]

    def _tensor_arg(self, tensor: torch.Tensor) -> TensorArg:
        known = self._known.get(id(tensor))       # once per tensor argument of every op
        if known is not None and known[0]() is tensor:
            ref = known[1]
        else:
            ref = (self._layouts and self._unseen_alias(tensor)) or self._new_input(tensor)
        arg = tensor_arg(tensor, ref)
        if arg.device != self.device and not is_cpu_scalar(arg):
            self._enter_device(arg.device)
        return arg

    def _unseen_alias(self, tensor: torch.Tensor) -> Ref | None:
        """Note [Shallow copies]: the ref of the output an unknown tensor aliases, if any."""
        address = storage_address(tensor)
        entry = self._layouts.get(address)
        if entry is None or entry[0].expired():
            return None
        ref = entry[1].get(_layout(tensor))
        if ref is None:
            if any(storage_address(t) == address for t in self.inputs):
                return None     # other memory of an input (a view of it was an output): an input
            raise Unkeyable(Reason.UNSEEN_ALIAS, "a tensor on an output's memory made by no op")
        self._known[id(tensor)] = (weakref.ref(tensor), ref)
        return ref

    def _enter_device(self, device: torch.device) -> None:
        if self.device is not None:
            raise Unkeyable(Reason.CROSS_DEVICE, f"op leaves {self.device} for {device}")
        self.device = device

    def add(self, func, op_class: OpClass, args: tuple, kwargs: tuple, out: Any) -> OpRecord:
        """Record an op that ran eagerly and returned ``out``."""
        container, flat = flatten_outputs(out)
        metas = tuple([TensorMeta.of(t) if is_plain_tensor(t) else None for t in flat])
        record = _new_tuple(OpRecord, (func, op_class, args, kwargs, container, metas,
                                       (func, args, kwargs)))
        self.append(record, flat)
        return record

    def append(self, record: OpRecord, flat_outputs: tuple) -> None:
        """Record ``record`` (hot path: the trie's own record) with its actual outputs."""
        index = len(self.ops)
        self.ops.append(record)
        self._signatures.setdefault(record.func, []).append(record.signature)
        if record.op_class.kind is not OpKind.MUTATING:   # it returns tensors we know
            self._register_outputs(index, record, flat_outputs)

    def _register_outputs(self, index: int, record: OpRecord, flat: tuple) -> None:
        root = None
        if record.op_class.kind is OpKind.VIEW:
            base = next(tensor_args(record.args[:1])).ref   # aten views view their first arg
            root = self._view_roots.get(base, base)
        for out_index, tensor in enumerate(flat):
            if tensor is None:
                continue
            ref = ("out", index, out_index)
            wref = weakref.ref(tensor)
            self._known[id(tensor)] = (wref, ref)
            if self._unseen_copies and tensor.layout is torch.strided:   # (sparse: no storage)
                self._watch_storage(ref, tensor, root is None)
            if root is None:
                self._outputs[ref] = wref
            else:
                self._view_roots[ref] = root
                if root[0] == "out":                  # views of inputs never need writing
                    self._views_of.setdefault(root, []).append(wref)

    def _watch_storage(self, ref: Ref, tensor: torch.Tensor, whole: bool) -> None:
        """Note [Shallow copies]: remember where ``ref`` lives, to know its unseen aliases."""
        address = storage_address(tensor)      # Note [Storages without Python objects]
        entry = self._layouts.get(address)
        if entry is not None and whole:
            # A new output on a known storage: a pooled buffer handed out again
            # (runtime/buffers.py), so the outputs it held before are dead, whatever holds it.
            for old in entry[1].values():
                self._storages.pop(old, None)
        if entry is None or entry[0].expired() or whole:
            entry = self._layouts[address] = (storage_weak_ref(tensor), {})
        entry[1].setdefault(_layout(tensor), ref)
        if whole:
            self._storages[ref] = entry[0]

    def touches(self, tensors: list) -> bool:
        """Does any of ``tensors`` share memory with an input or output of this segment
        (Note [Ops aside] in runtime/aside.py)? Outputs that died count while their memory
        is known to live on (Note [Shallow copies])."""
        if not self.ops and not self.inputs:
            return False
        mine = {storage_address(t) for t in self.inputs}
        for wrefs in (self._outputs.values(), *self._views_of.values()):
            for wref in wrefs:
                tensor = wref()
                if tensor is not None and tensor.layout is torch.strided:
                    mine.add(storage_address(tensor))
        mine.update(weak.cdata for weak in self._storages.values() if not weak.expired())
        return any(storage_address(t) in mine for t in tensors)

    def repeats(self, signature: tuple) -> bool:
        """Has a loop wrapped around? True if this exact call (same op, sources, scalars) is
        already recorded, or if it is the segment's opening call again on other inputs (a
        loop over fresh tensors, such as batches)."""
        recorded = self._signatures.get(signature[0])
        if not recorded:
            return False
        if signature in recorded:
            return True
        opening = self.ops[0].signature
        if opening[0] is not signature[0]:
            return False
        if self._opening_shape is None:
            self._opening_shape = without_input_identity(opening)
        return self._opening_shape == without_input_identity(signature)

    def live_refs(self) -> tuple[Ref, ...]:
        """Outputs still readable now, directly or through a view (see Note [Liveness]); when
        none is, its final results (Note [Results thrown away])."""
        live = tuple(ref for ref, wref in self._outputs.items()
                     if wref() is not None or self._live_view(ref) is not None
                     or self._held_elsewhere(ref))
        if live or any(op.kind is OpKind.MUTATING for op in self.ops):
            return live
        return final_results(self.ops)

    def _held_elsewhere(self, ref: Ref) -> bool:
        """Note [Shallow copies]: does a tensor no op returned share the output's storage?"""
        weak = self._storages.get(ref)
        if weak is None or weak.expired():
            return False
        if weak.cdata not in pooled_storages:
            return True
        # Counted in place (the weak reference keeps the StorageImpl readable), beside the
        # pool's own reference: a storage object made from the weak reference adds none,
        # since it comes back as the pool's own Python object.
        return _use_count(weak.cdata) > 1

    def _live_view(self, ref: Ref) -> torch.Tensor | None:
        for wref in self._views_of.get(ref, ()):
            view = wref()
            if view is not None:
                return view
        return None

    def live_tensor(self, ref: Ref) -> torch.Tensor | None:
        """The tensor to write ``ref``'s value into: the output itself or, when the user kept
        only views of it, the whole output rebuilt on their storage (hot-path outputs are
        allocated at storage offset 0 with the recorded strides)."""
        wref = self._outputs.get(ref)
        tensor = None if wref is None else wref()
        if tensor is not None:
            return tensor
        view = self._live_view(ref)
        if view is not None:
            storage = raw_untyped_storage(view)
        elif self._held_elsewhere(ref):           # Note [Shallow copies]
            storage = torch.UntypedStorage._new_with_weak_ptr(self._storages[ref].cdata)
        else:
            return None
        meta = self.ops[ref[1]].out_metas[ref[2]]
        whole = torch.empty((0,), dtype=meta.dtype, device=meta.device)
        return whole.set_(storage, 0, meta.shape, meta.stride)

    def finish(self, live_refs: tuple[Ref, ...]) -> Segment:
        metas = tuple(TensorMeta.of(t) for t in self.inputs)
        return Segment(tuple(self.ops), metas, live_refs, self.context)
