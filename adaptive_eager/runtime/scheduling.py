"""Which hot key compiles next, and when: predicted saving, break-even, one compile at a time.

# Note [Predicted saving]
Fusion saves time only in the ops Inductor fuses. A matmul or convolution is called as an
extern library kernel (dispatch/ops.py, EXTERN_OPS) and costs the same fused or not, so a
segment is judged by its *fusible* time: what its ops compute outside extern ops (the least
of its per-op runs). A fused kernel is taken to save FUSION_GAIN of that (measured: 34% for a
LayerNorm+GELU+residual block at 2M elements, 89% for an 8-op pointwise chain at 8M). A
segment whose time is nearly all in extern ops (more than MAX_EXTERN_PERCENT: a forward or
backward chunk of matmuls) is never compiled: such chunks compiled for 17-38 s each on a
transformer step and were then judged unprofitable anyway. One with some fusible time
compiles later the less it saves (Note [When to compile]).

# Note [When to compile]
A background compile costs the program while it runs (the worker's CPU, on a small machine
a share of the program's cores). Like renting skis before buying, a hot key's compile waits
until the savings its per-op runs would have had fused add up to what the compile is taken to
cost: COMPILE_COST_MS, whatever the segment's length. (Compiles on a lent core take 0.2-4 s,
64-op GPT-2 backward chunks as 8-op chains; the first of a process 5-9 s, as the worker
imports Inductor; the program runs about half as fast meanwhile. Scaling the cost with the
ops, as an earlier cost model did, held a 23-op backward for minutes.) A program that ends
sooner never pays for kernels it could not have used, one that runs on loses at most about
that much. A key that runs often and saves much
gets there fast (an 8M pointwise chain in a few runs); one that saves little, late. Savings
are counted per run, not per second, so no decision depends on the wall clock.

A key keeps the runtime watching while it waits only if its runs save more than watching them
costs (WATCH_S_PER_OP an op: ~55 us through Python's mode, ~10 us on the C++ backend). One
that saves less lets the runtime pause, and banks meanwhile at each control point, at the
rate it was seen running while watched (runs_per_second; only keys seen across steps, or in a
bare loop seen again after a pause: a key seen twice within one step, made of per-step
scalars, never comes back); the pause ends when a kernel lands. Any pause (the step judge's
too) banks so, and so does a bare loop's at each wake (Note [Waking a paused thread]).

Due keys compile one at a time, the one that banked the most savings first (the worker
compiles one graph at a time anyway; queued in the worker they would go first come, first
served). The worker runs at the program's priority (Note [Why a process]) on a core the
program lends it while it compiles (Note [Lending a thread]): the share of the machine its
cost above assumes.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from adaptive_eager.config import config
from adaptive_eager.runtime import clock

FUSION_GAIN = 0.5          # share of a segment's fusible time a kernel is taken to save


def predicted_saving_s(entry: Any) -> float:
    """Seconds one fused run of ``entry`` is expected to save over its per-op run."""
    return entry.fusible_seconds * FUSION_GAIN


def extern_bound(entry: Any) -> bool:
    """Is more than MAX_EXTERN_PERCENT of ``entry``'s time in extern ops (matmuls...)?"""
    extern_seconds = entry.compute_seconds - entry.fusible_seconds
    return extern_seconds * 100 > config.MAX_EXTERN_PERCENT * entry.compute_seconds


def compile_cost_s(entry: Any) -> float:
    """What compiling ``entry`` is taken to cost the program (Note [When to compile])."""
    return config.COMPILE_COST_MS / 1e3


# What watching a program costs, per op of a key: through Python's dispatch mode, which records
# and keys each op, ~55 us (bench/overhead.py); on the C++ backend, whose cold plans run known
# keys (Note [Cold plans] in csrc/plans.cpp: ~0.5-2 us an op), ~10 us all told (harvests, ops
# aside, the keys Python still records): measured ~11 us an op over a small MLP's first
# training steps, 8-10 on GPT-2's. A waiting key whose runs save less than this keeps no one
# watching it.
WATCH_S_PER_OP = {"python": 50e-6, "cpp": 10e-6}


# What deferring an op costs a run that ends fused, beyond what running it would have: C++'s
# hot path ~1 us an op (keying against the trie, keeping its arguments: the spike measured
# 0.8-1.0 us an op in a training step, pass-through included), Python's ~25-40 us.
DEFERRING_S_PER_OP = {"python": 40e-6, "cpp": 1e-6}


def program_seconds(waited_s: float, ops: int, backend: str) -> float:
    """Of a deferred run's ``waited_s`` (from its first op deferred to its end), the
    program's own time between its ``ops`` ops, which an eager run spends too (Note [Like for
    like] in runtime/profit.py); 0 where a test states times (Note [Clock])."""
    if not clock.is_the_machines():
        return 0.0
    return max(0.0, waited_s - ops * DEFERRING_S_PER_OP[backend])


def worth_watching(entry: Any, backend: str) -> bool:
    """Do ``entry``'s runs save more fused than watching them per-op on ``backend`` costs?"""
    return predicted_saving_s(entry) > len(entry.segment.ops) * WATCH_S_PER_OP[backend]


def runs_per_second(entry: Any) -> float:
    """How often ``entry`` ran while watched: its runs that followed an earlier one with
    no pause in between, over the time since that one, once there are a few, summed over
    every watched stretch (a resumed runtime may watch only a step or two before it pauses
    again: POINTS_BEFORE_PAUSE in runtime/pausing.py); else since it was first seen, which
    pauses dilute (GPT-2's optimizer key, credited so at a tenth of its rate, was still
    waiting after 90 s). 0 for a key seen within one step only (keys made of per-step
    scalars: they never come back).

    A program that passes no control point (a bare loop) has no steps to cross: there a key
    recurs if it came back after a pause began, and one watched run measures its rate, as
    such a loop's stretches between pauses see each key once or twice. (Counted as a key
    seen within one step, a bare GPT-2 inference loop's forward chunks banked nothing
    while paused and never compiled.)"""
    if entry.seen < 2:
        return 0.0
    if entry.last_point != entry.first_point:          # seen across steps
        least_watched = MIN_WATCHED_RUNS
    elif entry.came_back:                              # in a bare loop
        least_watched = 1
    else:
        return 0.0
    if entry.watched_runs >= least_watched and entry.watched_s > 0:
        return entry.watched_runs / entry.watched_s
    return (entry.seen - 1) / max(entry.last_seen - entry.first_seen, 1e-6)


MIN_WATCHED_RUNS = 4      # runs after an earlier one, watched, that measure a key's rate


def is_due(entry: Any) -> bool:
    """Have ``entry``'s runs banked what its compile costs?"""
    return entry.banked_s >= compile_cost_s(entry)


MAX_WAITING = 256   # keys waiting to compile; past this the least recently seen is dropped


class CompileQueue:
    """Hot keys waiting for their compile (state WAITING), with the savings they banked,
    least recently seen first (keys made of per-step scalars turn hot and never come back)."""

    def __init__(self) -> None:
        self._waiting: OrderedDict[str, Any] = OrderedDict()      # digest -> KeyEntry
        # COMPILE_COST_MS when a scan last found no key due, until a key banks more: every
        # control point of a paused program asks, and a scan walks every waiting key.
        self._none_due_at: float | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, entry: Any) -> bool:
        return self._waiting.get(entry.digest) is entry

    def add(self, entry: Any) -> list:
        """``entry`` turned hot: its runs so far count as if it had been fused. Returns the
        keys dropped to make room (MAX_WAITING)."""
        entry.banked_s = entry.seen * max(0.0, predicted_saving_s(entry))
        self._waiting[entry.digest] = entry
        self._none_due_at = None
        dropped = []
        while len(self._waiting) > MAX_WAITING:
            dropped.append(self._waiting.popitem(last=False)[1])
        return dropped

    def bank(self, entry: Any, runs: int = 1) -> None:
        """``runs`` more per-op runs of a waiting ``entry``."""
        entry.banked_s += max(0.0, predicted_saving_s(entry)) * runs
        entry.credited_at = entry.last_seen
        self._none_due_at = None
        if entry in self:
            self._waiting.move_to_end(entry.digest)

    def bank_elapsed(self, now: float) -> None:
        """The program ran unwatched (paused) since each key's last credit: credit the runs
        it would have made at its rate."""
        self._none_due_at = None
        for entry in self._waiting.values():
            since = max(entry.credited_at, entry.last_seen)
            entry.banked_s += max(0.0, predicted_saving_s(entry)) * \
                runs_per_second(entry) * max(0.0, now - since)
            entry.credited_at = now

    def none_due(self) -> bool:
        """Known to hold no due key (no key banked more since a scan found none)?"""
        return self._none_due_at is not None and self._none_due_at == config.COMPILE_COST_MS

    def due_count(self) -> int:
        if self.none_due():
            return 0
        return sum(map(is_due, self._waiting.values()))     # at most MAX_WAITING keys

    def discard(self, entry: Any) -> None:
        if self._waiting.get(entry.digest) is entry:
            del self._waiting[entry.digest]

    def pop_next(self, everything: bool = False) -> Any | None:
        """The due key that banked the most (any waiting key: ``everything``), or None."""
        if not everything and self.none_due():
            return None
        due = [entry for entry in self._waiting.values()
               if everything or is_due(entry)]
        if not due:
            if not everything:
                self._none_due_at = config.COMPILE_COST_MS
            return None
        best = max(due, key=lambda entry: entry.banked_s)
        del self._waiting[best.digest]
        return best

    def clear(self) -> None:
        self._waiting.clear()


# Note [Serial kernels]
# Inductor's CPU kernels run an OpenMP parallel region with the program's thread count,
# whatever their size. Eager's own ops run serially below 32K elements (ATen's grain size),
# and so should a kernel over tensors that small: a fork-join costs more than the work, and on
# a busy machine the region waits for a thread the OS gives to someone else (an 8-op chain on
# 4,096 elements took ~9 ms a run instead of ~5 us with another process on the second core).
# So a segment whose fused work (its ops but views and extern ops) touches no tensor of
# SERIAL_BELOW_NUMEL elements or more is compiled for one thread (the spike of the kernel
# launch measured the OpenMP kernel winning from ~64K). Extern ops do not count: a matmul runs
# its library's own threads whatever the kernel's count, and a decode step's weights (176K
# elements for a small Llama's MLP) made its 1x256 pointwise kernels parallel, each fused run
# 2.1x as slow as serial (0.93 against 0.43 ms for a layer's 51-op segment). A generic kernel
# (Note [Generic kernels]) is sized by the shapes it is derived from: compiled serial whatever
# they were, one over 1-8M-element LayerNorm blocks ran at 0.91x eager.
SERIAL_BELOW_NUMEL = 65536


def fused_numel(segment: Any) -> int:
    """The most elements one tensor read or written by ``segment``'s fused ops has (views
    and extern ops are not fused: Note [Serial kernels])."""
    from adaptive_eager.dispatch.ops import OpKind            # (torch: imported late)
    from adaptive_eager.dispatch.signature import TensorArg
    largest = 0
    for op in segment.ops:
        if op.kind is OpKind.VIEW or op.op_class.extern:
            continue
        shapes = [meta.shape for meta in op.out_metas if meta is not None]
        for arg in list(op.args) + [value for _, value in op.kwargs]:
            items = arg if type(arg) is tuple else (arg,)
            shapes += [item.shape for item in items if type(item) is TensorArg]
        largest = max([largest] + [math.prod(shape) for shape in shapes])
    return largest


def kernel_threads(largest_numel: int, program_threads: int | None = None) -> int:
    """The intra-op threads to compile a kernel for (Note [Serial kernels]), whose fused ops
    touch tensors of at most ``largest_numel`` elements (fused_numel); ``program_threads``: the
    program's own count (default: this thread's now; Note [Lending a thread])."""
    import torch
    if largest_numel < SERIAL_BELOW_NUMEL:
        return 1
    return program_threads or torch.get_num_threads()
