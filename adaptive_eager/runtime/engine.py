"""The executor: every intercepted op comes here and leaves eager, deferred or fused.

Cold path: the op runs eagerly and is recorded into the current segment.
Hot path:  at a segment start, an op whose signature begins a compiled segment is *deferred*:
           it returns real, empty plain tensors (views run eagerly on them), and each next op
           must match the next trie node. When the segment ends (a boundary, a non-matching op,
           a read that bypasses the dispatcher, sync, mode exit) the fused kernel runs and writes
           the live outputs into the tensors the user already holds.
Divergence: a deferred run that cannot finish fused is replayed per-op into the same tensors
           (runtime.graph.run_eagerly), counted, and recording goes on from there.

One ``Runtime`` exists per ``enable()``; the key table and the trie of compiled kernels are
shared by all of them (``shared_table()``).

# Note [Fork]
A forked child (DataLoader workers and multiprocessing under the default ``fork`` start method)
gets a copy of the runtime: this thread's mode stays on its mode stack, and the key table holds
the parent's compile worker and database connection. A child that used them took the worker for
dead (it is not the child's child) and started one of its own, one per DataLoader worker, and
wrote through a connection SQLite forbids using, or closing, across a fork. So the parent first
runs deferred work (the child must not copy unfilled buffers); in the child, every runtime that
existed at the fork runs ops plainly (``stand_aside``), the table and what it holds are left
alone for good (``KeyTable.disown``), and locks another thread may have held are made anew. The
child starts with nothing: an ``enable()`` there gets a table, worker and connection of its
own. Processes started with ``spawn`` or ``forkserver`` begin fresh anyway.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

from adaptive_eager.cache.disk import DiskCache
from adaptive_eager.config import config
from adaptive_eager.dispatch import upcalls
from adaptive_eager.dispatch.interceptor import not_intercepted
from adaptive_eager.dispatch.ops import OpClass, OpKind, Reason, classify_call
from adaptive_eager.dispatch.signature import Unkeyable, key_context
from adaptive_eager.fork_safety import reinit_in_child
from adaptive_eager.runtime import clock
from adaptive_eager.runtime.buffers import BufferPool
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime import native_plans
from adaptive_eager.runtime.aside import runs_aside
from adaptive_eager.runtime.fused_runs import FusedRuns, no_autocast
from adaptive_eager.runtime.pausing import MOST_INTERCEPTION_S_PER_OP, Pausing
from adaptive_eager.runtime.policy import KeyTable
from adaptive_eager.runtime.segment import SegmentBuilder, flatten_outputs, unflatten_outputs
from adaptive_eager.runtime.stats import counters
from adaptive_eager.runtime.trie import KernelTrie, TrieNode


_shared_lock = threading.Lock()
reinit_in_child(_shared_lock)   # Note [Fork]
_shared_table: KeyTable | None = None
_live_runtimes: "weakref.WeakSet[Runtime]" = weakref.WeakSet()
# The same, as a tuple of weak references remade at each change: iterating a WeakSet costs
# ~1 us, and every ae.sync() and control point walks the live runtimes.
_live_refs: tuple = ()
_live_lock = threading.Lock()
reinit_in_child(_live_lock)     # Note [Fork]
_disowned: list[KeyTable] = []     # the parent's tables, kept so nothing of theirs is closed


def shared_table() -> KeyTable:
    """The process-wide key table (and, through it, the trie of compiled kernels)."""
    global _shared_table
    table = _shared_table
    if table is not None:
        return table
    with _shared_lock:
        if _shared_table is None:
            _shared_table = KeyTable(KernelTrie(), DiskCache(config.CACHE_DIR))
        return _shared_table


def existing_table() -> KeyTable | None:
    """The process-wide key table if one was made (stats() must not make one)."""
    return _shared_table


def reset_shared_table() -> None:
    """Write what is pending, then forget every key and kernel (tests, benchmarks)."""
    global _shared_table
    with _shared_lock:
        table, _shared_table = _shared_table, None
    if table is not None:
        table.close()


def live_runtimes() -> list["Runtime"]:
    return [runtime for ref in _live_refs if (runtime := ref()) is not None]


def _set_live(runtime: "Runtime", live: bool) -> None:
    global _live_refs
    with _live_lock:
        if live:
            _live_runtimes.add(runtime)
        else:
            _live_runtimes.discard(runtime)
        _live_refs = tuple(weakref.ref(r) for r in _live_runtimes)


upcalls.live_runtimes = live_runtimes


def after_fork_in_child() -> None:
    """Note [Fork]: leave what the parent runs to the parent."""
    global _shared_table
    table, _shared_table = _shared_table, None
    if table is not None:
        table.disown()
        _disowned.append(table)
    for runtime in live_runtimes():
        runtime.stand_aside()
    native_plans.after_fork_in_child()


def release_idle_resources() -> None:
    """No runtime is enabled any more: give back the loaded kernels (the next enable loads
    them from the disk cache at first sight, ~7 ms each) and stop the compile worker if it is
    idle (a process holding Inductor's memory). What is known of keys stays, bounded by
    MAX_KEYS; ``reset()`` forgets that too."""
    table = _shared_table
    if table is not None:
        table.release_kernels()
        table.stop_idle_worker()


@contextlib.contextmanager
def below_autograd() -> Iterator[None]:
    """The state ops see inside the dispatch mode: below autograd, no autocast.

    Deferred work flushed from outside the mode (sync, numpy(), ...) must run here: filling
    buffers with autograd active raises version-counter errors, and recorded ops already carry
    autocast's casts, so autocast must not apply them twice."""
    with _disable_current_modes(), not_intercepted(), \
            torch._C._AutoDispatchBelowADInplaceOrView(), no_autocast():
        yield


def _argument(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    return args[position] if position < len(args) else kwargs[name]


def _bump_versions(op_class: OpClass, args: tuple, kwargs: dict) -> None:
    """Bump version counters as eager does for foreach in-place ops (see OpClass)."""
    for position, name in op_class.written_lists:
        tensors = [t for t in _argument(args, kwargs, position, name) if not t.is_inference()]
        if tensors:
            torch.autograd.graph.increment_version(tensors)


def _out_layouts(op_class: OpClass, args: tuple, kwargs: dict) -> list:
    """Shape and strides of an op's ``out=`` tensors.

    Note [Resized outputs]: ``torch.mm(a, b, out=torch.empty(0))`` resizes its ``out`` inside
    the op, a metadata change no op shows the mode. Deferred, the call would hand back ``out``
    unresized (and a replay could not write the result into it: the program raised). So a
    call that resized its ``out`` when it ran cold is cut out of the segment, like a
    boundary; its signature (``out``'s shape before the call) then never matches a compiled
    segment, and it runs eagerly every time."""
    layouts = []
    for position, name in op_class.out_args:
        tensor = _argument(args, kwargs, position, name)
        layouts.append((tensor.shape, tensor.stride()) if isinstance(tensor, torch.Tensor)
                       else None)
    return layouts


def _count_fallback(func, reason: str) -> None:
    """An op that ran eagerly outside any segment, for ``reason``: counted and logged."""
    counters.fallback(reason)
    decide("fallback", reason=reason, op=func)


def _run_plainly(func, args: tuple, kwargs: dict) -> Any:
    return func(*args, **kwargs)


class Runtime(FusedRuns, Pausing):
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._builder: SegmentBuilder | None = None
        self._hot: TrieNode | None = None      # set while deferring along a compiled segment
        self._busy_thread: int | None = None
        self.owner_thread = threading.get_ident()   # the thread that enabled it
        self._max_ops = config.MAX_SEGMENT_OPS
        self.pool = BufferPool(config.BUFFER_POOL_MB << 20)
        # Per-op counts stay local (no lock per op) and are published at segment ends.
        self._ops_seen = 0
        self._per_op = 0
        self._init_pausing()
        self.stood_aside = False                  # see stand_aside()
        # Ops make copies of tensors it never sees (the C++ backend: Note [Shallow copies]
        # in runtime/segment.py); set by the interceptor, for segments begun after.
        self.unseen_copies = False
        # The C++ extension when it intercepts for this runtime (Note [The C++ hot path] in
        # csrc/hot_path.cpp): it defers and launches settled kernels itself.
        self.native = None
        _set_live(self, True)

    @property
    def table(self) -> KeyTable:
        return shared_table()

    # ---------------------------------------------------------------- entry points

    def on_op(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        """Called by the dispatch mode for every aten op (mode already disabled)."""
        with self._lock:
            self._ops_seen += 1
            self._busy_thread = threading.get_ident()
            try:
                return self._dispatch(func, classify_call(func, args, kwargs), args, kwargs)
            finally:
                self._busy_thread = None

    def publish_counts(self) -> None:
        """Move this runtime's local op counts into the shared counters."""
        with self._lock:
            ops_seen, self._ops_seen = self._ops_seen, 0
            per_op, self._per_op = self._per_op, 0
        counters.add("ops_seen", ops_seen)
        counters.add("per_op_executions", per_op)

    def has_deferred(self) -> bool:
        return self._hot is not None or self._native_run_pending()

    def _native_run_pending(self) -> bool:
        native = self.native   # its runs belong to threads: only the owner's can be seen
        return native is not None and threading.get_ident() == self.owner_thread and \
            native.run_pending()

    def _native_cold_run(self) -> bool:
        """Is this thread on a C++ cold plan's path (Note [Cold plans] in csrc/plans.cpp)?
        A segment end ends it, where Python's recording would end; deferred work to run (an
        escape) does not: it has none."""
        native = self.native
        return native is not None and threading.get_ident() == self.owner_thread and \
            native.cold_run_pending()

    def segment_open(self) -> bool:
        """Is a segment being recorded or deferred here (the C++ hot path starts none)?"""
        return self._hot is not None or bool(self._builder)

    def _sync_native_open(self) -> None:
        if self.native is not None and threading.get_ident() == self.owner_thread:
            self.native.set_open(self.segment_open())

    def flush(self, end_segment: bool = True) -> None:
        """Run deferred work now; with ``end_segment`` also close the segment being recorded.

        Safe to call from anywhere outside the mode; a no-op while this thread is inside it."""
        if self._busy_thread == threading.get_ident():
            return
        if self._native_run_pending():
            with self._lock, below_autograd():
                self.native.end_run()          # fused, now ours (adopt_native_run), or cold
        if end_segment and self._native_cold_run():
            with self._lock:
                self.native.end_run()          # counted: its ops ran already
        if self._hot is None and not (end_segment and self._builder):
            return
        with self._lock, below_autograd():
            self._busy_thread = threading.get_ident()
            try:
                self._end_segment()
            finally:
                self._busy_thread = None
        self._sync_native_open()

    def close(self) -> None:
        self.flush()
        self.publish_counts()
        self.pool.clear()
        if not self.stood_aside:
            self.table.flush()
        _set_live(self, False)

    def stand_aside(self) -> None:
        """Note [Fork]: in a forked child, run every op as it comes, and touch no table."""
        self._lock = threading.RLock()
        self._builder = self._hot = self._busy_thread = None
        self.pause_requested, self.awaited_answers = False, None
        self.stood_aside = True
        self.on_op = _run_plainly

    # ---------------------------------------------------------------- dispatch

    def _dispatch(self, func, op_class: OpClass, args: tuple, kwargs: dict) -> Any:
        if runs_aside(op_class, args, kwargs, self._builder):
            return self._run_aside(func, op_class, args, kwargs)
        if op_class.kind is OpKind.BOUNDARY:
            if self.native is not None:
                native_plans.pass_when_idle(self.native, func,
                                            getattr(op_class.reason, "value", op_class.reason))
            return self._run_boundary(func, args, kwargs, op_class.reason)
        if self._builder is not None and len(self._builder) >= self._max_ops:
            self._end_segment()                # full: the op may begin the next segment
            return self._restart(func, op_class, args, kwargs)
        builder = self._current_builder()
        known_inputs = len(builder.inputs)
        try:
            encoded_args, encoded_kwargs = builder.encode(args, kwargs, func)
        except Unkeyable as err:
            return self._run_boundary(func, args, kwargs, err.reason)
        signature = (func, encoded_args, encoded_kwargs)
        if self._hot is not None:
            child = self._hot.children.get(signature)
            if child is not None:
                return self._defer(child, func, op_class, args, kwargs, signature)
            builder.drop_inputs_from(known_inputs)
            self._end_hot()            # fused (new segment) or replayed (recording goes on)
            return self._restart(func, op_class, args, kwargs)
        if builder.repeats(signature):
            # Note [Loop iterations]: the very same call (op, sources, scalars) comes again,
            # so a loop body has wrapped around. Cutting here aligns segments with iterations;
            # without it, boundary-free loops form MAX_SEGMENT_OPS-long segments whose phase
            # drifts and whose keys never repeat.
            builder.drop_inputs_from(known_inputs)
            self._end_segment()
            return self._restart(func, op_class, args, kwargs)
        elif len(builder) == 0:
            root = self.table.trie.root(builder.context)
            child = root.children.get(signature) if root is not None else None
            if child is not None:
                return self._defer(child, func, op_class, args, kwargs, signature)
        return self._run_cold(func, op_class, args, kwargs, signature, known_inputs)

    def _restart(self, func, op_class: OpClass, args: tuple, kwargs: dict) -> Any:
        """A segment ended at this op, which may begin the next one: on the C++ backend its
        hot path tries first (Note [The C++ hot path]), so the op goes back to it."""
        if self.native is not None and self._hot is None and not self._builder and \
                native_plans.registered():
            self._ops_seen -= 1                 # it comes again
            return native_plans.RETRY
        return self._dispatch(func, op_class, args, kwargs)

    def _current_builder(self) -> SegmentBuilder:
        builder = self._builder
        if builder is not None and len(builder) >= self._max_ops:
            self._end_segment()
            builder = None
        if builder is None:
            builder = self._builder = SegmentBuilder(key_context(), self.unseen_copies)
        return builder

    def _run_aside(self, func, op_class: OpClass, args: tuple, kwargs: dict) -> Any:
        """Note [Ops aside] (runtime/aside.py): run it now; the segment goes on."""
        if op_class.kind is OpKind.BOUNDARY:
            if self.native is not None:
                native_plans.pass_when_idle(self.native, func, op_class.reason.value)
            _count_fallback(func, op_class.reason.value)
        out = func(*args, **kwargs)
        if op_class.written_lists:
            _bump_versions(op_class, args, kwargs)
        self._per_op += 1
        return out

    def _run_boundary(self, func, args: tuple, kwargs: dict, reason: Reason) -> Any:
        self._end_segment()
        _count_fallback(func, getattr(reason, "value", reason))
        self._per_op += 1
        return func(*args, **kwargs)

    def _run_cold(self, func, op_class: OpClass, args, kwargs, signature,
                  known_inputs: int) -> Any:
        layouts = _out_layouts(op_class, args, kwargs) if op_class.out_args else None
        started = clock.perf_counter()
        out = func(*args, **kwargs)
        elapsed = clock.perf_counter() - started
        self._builder.compute_seconds += elapsed
        if op_class.extern:                         # Note [Predicted saving]
            self._builder.extern_seconds += elapsed
        if op_class.written_lists:
            _bump_versions(op_class, args, kwargs)
        self._per_op += 1
        if layouts is not None and layouts != _out_layouts(op_class, args, kwargs):
            self._builder.drop_inputs_from(known_inputs)   # Note [Resized outputs]
            self._end_segment()
            _count_fallback(func, Reason.METADATA_MUTATION.value)
            return out
        self._builder.add(func, op_class, signature[1], signature[2], out)
        return out

    def _defer(self, node: TrieNode, func, op_class: OpClass, args, kwargs, signature) -> Any:
        record = node.record
        if op_class.kind is OpKind.VIEW:            # metadata only: safe on unfilled buffers
            out = func(*args, **kwargs)
        elif op_class.kind is OpKind.FUSIBLE:
            out = unflatten_outputs(record.container, [
                None if meta is None else self.pool.empty(meta) for meta in record.out_metas])
        else:                                       # MUTATING: returns what it writes
            out = unflatten_outputs(record.container, [
                _argument(args, kwargs, position, name)
                for position, name in op_class.returned_args])
            if op_class.written_lists:
                _bump_versions(op_class, args, kwargs)
        self._builder.append(record, flatten_outputs(out)[1])
        self._hot = node
        return out

    # ---------------------------------------------------------------- segment ends

    def _end_segment(self) -> None:
        self.table.poll_compiles()
        if self._hot is not None and self._end_hot():
            return
        builder, self._builder = self._builder, None
        if builder:
            seconds = clock.perf_counter() - builder.started
            entry = self.table.observe(builder.finish(builder.live_refs()), seconds,
                                       builder.compute_seconds, builder.extern_seconds)
            self.unpaid_s += min(max(0.0, seconds - builder.compute_seconds),
                                 len(builder) * MOST_INTERCEPTION_S_PER_OP)
            if self.native is not None:
                native_plans.watch(entry, self.native)   # Note [Cold plans] (csrc/plans.cpp)
                native_plans.offer_recorded(entry, self.table, self.native)
            self._watch(entry)

    # ---------------------------------------------------------------- the C++ hot path

    def ran_native_kernel(self, variant, runs: int = 1) -> None:
        """The extension ran ``variant``'s kernel ``runs`` times (native_plans)."""
        self._watch_kernel(variant, runs)

    def adopt_native_run(self, segment, depth: int, inputs: list, outputs: list,
                         cold_timing: tuple | None = None) -> None:
        """Note [The C++ hot path]: a deferred run the extension cannot end fused becomes
        this engine's own, as if it had deferred the first ``depth`` ops of ``segment``
        itself; the op at hand then comes here as any op does (it may go on along the trie,
        or end the run: fused, or replayed and recorded on). A cold run (Note [Cold plans]),
        whose ops ran already, ``cold_timing`` its (wall, compute, extern) seconds, becomes
        this engine's recording, as if it had recorded those ops itself. ``outputs`` (each
        op's flat outputs, None where dead) is emptied, so only the user's references keep
        them alive (Note [Liveness] in runtime/segment.py)."""
        with self._lock:
            records = segment.ops[:depth]
            builder = SegmentBuilder(segment.context, self.unseen_copies)
            for tensor in inputs:
                builder.add_input(tensor)
            for index, record in enumerate(records):
                builder.append(record, tuple(outputs[index]))
            outputs.clear()
            self._builder = builder
            if cold_timing is not None:
                wall_s, builder.compute_seconds, builder.extern_seconds = cold_timing
                builder.started -= wall_s
                self._hot = None
            else:
                node = self.table.trie.node_at(segment.context, records)
                self._hot = node if node is not None else TrieNode(records[-1])
        self._sync_native_open()
