"""Ops that run where they come, outside the segment, without ending it.

# Note [Ops aside]
A segment ends at an op it cannot hold, and each end costs a kernel boundary. Two kinds of op
need not end it, because nothing the segment defers reads or writes their tensors:

- a host sync (``.item()``, ``is_nonzero``, ``equal``...) of tensors the segment did not
  write: the value it reads is already there;
- an op whose tensors are all 0-dim CPU tensors (step counters, ``torch.tensor(1.0)``,
  Python numbers wrapped as tensors): bookkeeping on the host, which a kernel cannot make
  faster.

Such an op runs at once, as in eager, and the segment goes on around it. Running it before
the deferred ops that came first is safe only if none of them touches its tensors: no tensor
of the op may share memory with the segment's inputs or outputs (``SegmentBuilder.touches``),
and then the deferred ops neither wrote what it reads nor read what it writes. Later ops that
read what it made take it as a new input.

AdamW (``foreach``, step counters on the CPU) is why: it counts ``step += 1`` on 0-dim
tensors, reads each counter back with ``.item()`` for its bias corrections, then updates the
parameters. Each ``.item()`` ended the segment, so the update ran as two kernels with a pass
over every parameter, moment and gradient between them; with the counters aside it is one.

The C++ hot path applies the same rule where a run's next op matches none of its plan's
(``runs_aside`` in csrc/hot_path.cpp), so a path Python recorded is the path C++ walks.
"""
from __future__ import annotations

from typing import Any

import torch

from adaptive_eager.dispatch.ops import OpClass, OpKind, Reason
from adaptive_eager.dispatch.signature import is_plain_tensor

_STRIDED = torch.strided


def _tensors_of(args: tuple, kwargs: dict) -> list | None:
    """The tensors among the arguments (in lists too; None skipped); None if one is not a
    plain strided tensor (a subclass or sparse tensor: its memory is not ours to reason on)."""
    found = []
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor):
                if not is_plain_tensor(item) or item.layout is not _STRIDED:
                    return None
                found.append(item)
    return found


def _cpu_scalars(tensors: list) -> bool:
    return bool(tensors) and all(t.dim() == 0 and t.device.type == "cpu" and not t.is_meta
                                 for t in tensors)


def runs_aside(op_class: OpClass, args: tuple, kwargs: dict, builder: Any) -> bool:
    """Note [Ops aside]: may this op run now, outside the open segment (``builder``, None or
    empty when none is open), without ending it?"""
    host_sync = op_class.kind is OpKind.BOUNDARY and op_class.reason is Reason.HOST_SYNC
    first = args[0] if args else None
    # The common case answers at the first argument: a tensor that is not a 0-dim CPU tensor
    # (or a list of them) rules out bookkeeping.
    if not host_sync and not _may_be_scalar(first):
        return False
    tensors = _tensors_of(args, kwargs)
    if tensors is None or not (host_sync and tensors or _cpu_scalars(tensors)):
        return False
    return builder is None or not builder.touches(tensors)


def _may_be_scalar(first: Any) -> bool:
    if isinstance(first, torch.Tensor):
        return first.dim() == 0
    if isinstance(first, (list, tuple)):
        return not first or not isinstance(first[0], torch.Tensor) or first[0].dim() == 0
    return True
