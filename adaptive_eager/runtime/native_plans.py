"""What the C++ extension runs without Python: the kernels it defers and launches itself
(Note [The C++ hot path] in csrc/hot_path.cpp), the cold keys it runs per-op and counts (Note
[Cold plans] in csrc/plans.cpp), and the calls it makes back: ``launch`` at a fused segment's
end, ``takeover`` for every run it cannot end fused, ``harvest`` now and then for the
cold runs.

A kernel is offered once its first fused run passed probation, unless VERIFY is on (its
per-run check is Python's); one whose runs never reach Python's engine deferred is offered
on probation, and C++ makes its first run checked (Note [First runs in C++] in
runtime/first_runs.py). Its
segment goes to C++ as plain data: per op the operator, one spec per schema argument (a tensor
by where it comes from and its layout, other values exactly, omitted ones as the schema's
default) and what it returns; a segment whose calls C++ cannot compare stays on Python's hot
path (``refused``, counted once per kernel in the decision log at debug level).
"""
from __future__ import annotations

import itertools
import logging
import threading

import torch

from adaptive_eager.config import config
from adaptive_eager.dispatch import interceptor as interceptors
from adaptive_eager.dispatch import native, upcalls
from adaptive_eager.dispatch.ops import OpKind, Reason, boundary_whatever_the_arguments
from adaptive_eager.dispatch.signature import (KEY_CONTEXT_FIELDS, LiftedScalar, ScalarArg,
                                               TensorArg, decode)
from adaptive_eager.runtime import clock
from adaptive_eager.runtime.first_runs import first_run
from adaptive_eager.runtime.scheduling import program_seconds
from adaptive_eager.runtime.segment import final_results
from adaptive_eager.runtime.stats import counters

log = logging.getLogger("adaptive_eager")

REFUSED = -1                    # Variant.native_handle of a kernel C++ cannot run
RETRY = object()                # on_op's answer: try the C++ hot path, then ask again
# A settled kernel's runs are counted, timed and kept recent (KeyTable.touch: ~9 us, as long as
# the kernel of a small segment) once per this many runs.
TOUCH_EVERY = 16
_KINDS = {OpKind.FUSIBLE: 0, OpKind.VIEW: 1, OpKind.MUTATING: 2}
_CONTEXT_PARTS = ("default_dtype", "grad_enabled", "inference_mode", "autocast_cpu",
                  "autocast_cpu_dtype", "autocast_cuda", "deterministic_algorithms")

# A thread harvests its cold runs (takes their counts into the key table, where keys bank
# toward their compiles, and polls the compile worker) after HARVEST_EVERY of them or
# HARVEST_AFTER_S of their time, whichever comes first. A harvest costs ~30 us: under half a
# microsecond a run of a tiny segment, and a kernel landing waits at most ~2 ms to be seen.
HARVEST_EVERY = 64
HARVEST_AFTER_S = 0.002
# Cold plans registered at once: every change rebuilds the tries (~1 us a node), and a key
# that stops coming back keeps its plan until it is forgotten (MAX_KEYS).
MAX_COLD_PLANS = 512

_lock = threading.Lock()
_variants: dict = {}            # handle -> Variant registered with the extension
_watched: dict = {}             # handle -> KeyEntry of a cold plan (Note [Cold plans])
_handles = itertools.count(1)
_callbacks_set = False


class Unsupported(Exception):
    """A call the C++ hot path cannot compare or reproduce."""


def offer(variant, trie, ext, on_probation: bool = False) -> None:
    """After a fused run of ``variant`` on the C++ backend: register it once its first run
    passed probation (or, ``on_probation``, before it: Note [First runs in C++]). Its
    side-by-side trial (Note [Side by side] in runtime/profit.py) then times the C++ path's
    fused runs: ``_launch`` hands the runs the trial wants per-op to Python's engine, which
    replays and times them."""
    entry = variant.entry
    if variant.native_handle is not None or (variant.on_probation and not on_probation) or \
            config.VERIFY != "off":
        return
    try:
        node_ids = trie.path_ids(variant.segment)
        if node_ids is None:
            raise Unsupported("not in the trie")
        plan = _plan(variant.segment, node_ids, variant.mutates)
    except Unsupported as err:
        variant.native_handle = REFUSED
        log.debug("decision=native_refused key=%s reason=%s", entry.digest, err)
        return
    handle, refused = _register(ext, False, variant.segment, plan, _variants, variant)
    variant.native_handle = REFUSED if refused else handle
    if refused:
        log.debug("decision=native_refused key=%s reason=%s", entry.digest, refused)


def offer_recorded(entry, table, ext) -> None:
    """Python recorded a segment of ``entry``'s key: if it has a kernel C++ does not run yet,
    for want of a first run (Note [First runs in C++] in runtime/first_runs.py), offer it on
    probation."""
    from adaptive_eager.runtime.entries import KeyState    # (entries imports this module)
    if entry.state is not KeyState.READY:      # (and a key seen once is never named)
        return
    variant = table.kernels.get(entry.digest)
    if variant is not None and variant.native_handle is None and variant.on_probation:
        offer(variant, table.trie, ext, on_probation=True)


def hot_path_available() -> bool:
    """Will settled kernels run on the C++ hot path in this process?"""
    return config.BACKEND != "python" and native.loaded() is not None


def registered() -> bool:
    """Does the extension run any kernel or cold plan (and know the callbacks)?"""
    return bool(_variants) or bool(_watched)


def watch(entry, ext) -> None:
    """Note [Cold plans]: after a per-op run of ``entry``'s segment on Python's engine, let
    C++ run and count its next ones, once the key came back (a key seen once is most often a
    new shape or a per-step scalar, never seen again) and while it has no kernel (Python's
    engine defers and checks a new kernel's runs)."""
    from adaptive_eager.runtime.entries import KeyState    # (entries imports this module)
    if entry.cold_plan is not None or entry.cold_refused or entry.seen < 2 or \
            entry.state is KeyState.READY or len(_watched) >= MAX_COLD_PLANS or \
            not clock.is_the_machines():       # C++ times its runs (Note [Clock])
        return
    segment = entry.segment
    try:
        mutates = any(op.kind is OpKind.MUTATING for op in segment.ops)
        plan = _plan(segment, [0] * len(segment.ops), mutates)
    except Unsupported as err:
        entry.cold_refused = True
        log.debug("decision=cold_plan_refused key=%s reason=%s", entry.digest, err)
        return
    handle, refused = _register(ext, True, segment, plan, _watched, entry)
    if refused:
        entry.cold_refused = True
    else:
        entry.cold_plan = handle


def _register(ext, cold: bool, segment, plan: tuple, registry: dict, owner) -> tuple:
    """plan_add under a new handle, kept in ``registry`` unless refused: (handle, why not)."""
    _set_callbacks(ext)
    with _lock:
        handle = next(_handles)
        refused = ext.plan_add(handle, cold, segment, *plan)
        if not refused:
            registry[handle] = owner
    return handle, refused


def unwatch(entry) -> None:
    """``entry`` got a kernel, was forgotten, or its plan missed: Python sees its runs again."""
    handle = entry.cold_plan
    if handle is not None:
        entry.cold_plan = None
        _unregister(_watched, handle)


def forget(variant) -> None:
    """``variant`` left the trie: C++ must not run it either."""
    handle = variant.native_handle
    if handle is not None and handle != REFUSED:
        variant.native_handle = None
        _unregister(_variants, handle)


def _unregister(registry: dict, handle: int) -> None:
    """Out of ``registry`` and out of the extension (_register's inverse)."""
    ext = native.loaded()
    with _lock:
        registry.pop(handle, None)
        if ext is not None:
            ext.plan_remove(handle)


def clear() -> None:
    ext = native.loaded()
    with _lock:
        for variant in _variants.values():
            variant.native_handle = None
        _variants.clear()
        for entry in _watched.values():
            entry.cold_plan = None
        _watched.clear()
        if ext is not None:
            ext.plan_clear()


def touch_pending(table) -> None:
    """Count the C++ launches ``_launch`` has not counted yet, and the cold runs not
    harvested yet (the table is being written, or ae.sync()): as a harvest does, toward
    this thread's pausing too."""
    ext = native.loaded()
    if ext is not None and (_watched or _variants):
        runtime = interceptors.current_runtime()
        _take_counts(table, ext, None if runtime is None or runtime.stood_aside else runtime)
    with _lock:
        pending = [variant for variant in _variants.values() if variant.untouched_runs]
    for variant in pending:
        runs, variant.untouched_runs = variant.untouched_runs, 0
        if runs:
            table.touch(variant, None, runs)


def after_fork_in_child() -> None:
    """Note [Fork] (runtime/engine.py): the parent's kernels are not the child's; the child's
    runtimes run on Python's engine (no lock the parent may have held is taken)."""
    global _lock
    _lock = threading.Lock()
    for variant in _variants.values():
        variant.native_handle = REFUSED
    _variants.clear()
    for entry in _watched.values():
        entry.cold_plan, entry.cold_refused = None, True
    _watched.clear()
    ext = native.loaded()
    if ext is not None:
        ext.hot_path_off()


def publish_counts() -> None:
    """Move the extension's counts (process-wide) into the shared counters."""
    ext = native.loaded()
    if ext is None:
        return
    deferred, fused_runs, fused_ops, divergences, cold_ops, cold_runs, cold_misses, direct, \
        replayed, aside = ext.take_counts()
    counters.add("ops_seen", deferred + cold_ops + aside)
    counters.add("per_op_executions", cold_ops + replayed + aside)   # (aside: runtime/aside.py)
    counters.add("native_cold_runs", cold_runs)
    if cold_misses:
        counters.fallback("cold_plan_missed", cold_misses)
    if divergences:                  # Note [Divergence in C++] (csrc/run_end.cpp)
        counters.add("divergences", divergences)
        counters.fallback("divergence", divergences)
    counters.add("fused_executions", fused_runs)
    counters.add("native_fused_executions", fused_runs)
    counters.add("native_direct_executions", direct)
    counters.add("fused_ops", fused_ops)
    with _lock:              # (a slot registered after take_idle_counts has no runs yet)
        idle = list(zip(_idle_reasons, ext.take_idle_counts()))
    for reason, runs in idle:
        if runs:             # boundaries the extension ran itself, as Python's engine counts
            counters.add("ops_seen", runs)
            counters.add("per_op_executions", runs)
            counters.fallback(reason, runs)


# ---------------------------------------------------------------- the calls back from C++

# _launch's answers (run_end.cpp, Launched)
REFUSED_RUN, FUSED_RUN, PER_OP_RUN, CHECKED_RUN = 0, 1, 2, 3


def _launch(handle: int, inputs: list, buffers: list, waited_s: float) -> int:
    """Run a registered kernel at its segment's end (versions are kept by the caller).
    REFUSED_RUN: it is gone or failed (demoted), and the caller hands the run over;
    PER_OP_RUN: its trial wants this run per-op (the caller runs it and calls _ran_per_op);
    CHECKED_RUN: a first run whose check failed, the outputs per-op's (first_run)."""
    variant = _variants.get(handle)
    runtime = interceptors.current_runtime()
    if variant is None or runtime is None:
        return REFUSED_RUN
    if variant.on_probation:        # Note [First runs in C++] (runtime/first_runs.py)
        return FUSED_RUN if first_run(variant, runtime, inputs, buffers, _call) else CHECKED_RUN
    judged = variant.entry.judged or config.KEEP_UNPROFITABLE
    if not judged and runtime.table.wants_eager_run(variant):
        # Note [Side by side]: timed beside the kernel's, in C++ (where a test states times,
        # by Python's engine, whose ops read that clock: Note [Clock])
        return PER_OP_RUN if clock.is_the_machines() else REFUSED_RUN
    started = clock.perf_counter()
    try:
        _call(variant, inputs, buffers)
    except Exception as err:  # a kernel that fails at run time is dropped, not fatal
        runtime.table.demote(variant, f"kernel_error: {type(err).__name__}: {err}")
        return REFUSED_RUN
    variant.untouched_runs += 1
    if judged and not variant.direct_tried:
        _call_from_cpp(variant)
    if variant.untouched_runs >= TOUCH_EVERY or not judged:   # a trial counts every run
        # waited_s (deferring its ops, and the program's code between them) is the machine's
        # time, measured in C++; where a test states times (Note [Clock]), the kernel's alone
        waited_s = waited_s if clock.is_the_machines() else 0.0
        runtime.table.touch(variant, waited_s + clock.perf_counter() - started,
                            variant.untouched_runs)
        variant.untouched_runs = 0
    runtime.ran_native_kernel(variant)
    return FUSED_RUN


def _call(variant, inputs: list, buffers: list) -> None:
    if torch.autograd.profiler._is_profiler_enabled or torch.is_autocast_enabled("cpu"):
        from adaptive_eager.runtime.fused_runs import no_autocast, profiler_range
        with profiler_range(variant), no_autocast():
            variant.kernel(*inputs, *buffers)
    else:
        variant.kernel(*inputs, *buffers)


def _ran_per_op(handle: int, seconds: float, waited_s: float) -> None:
    """The extension ran a trial's per-op run of a kernel's segment: ``seconds`` in its ops,
    after ``waited_s`` from its first op deferred (Note [Side by side], Note [Like for like])."""
    variant = _variants.get(handle)
    runtime = interceptors.current_runtime()
    if variant is not None and runtime is not None:
        program_s = program_seconds(waited_s, len(variant.segment.ops), "cpp")
        runtime.table.touch_eager(variant, seconds + program_s)


def _call_from_cpp(variant) -> None:
    """Note [Launching from C++] (runtime/direct_call.py): once a kernel is judged, let the
    extension call its generated code itself where it can."""
    from adaptive_eager.runtime.direct_call import direct_kernel
    variant.direct_tried = True
    direct = direct_kernel(variant.kernel)
    ext = native.loaded()
    if direct is None or ext is None or variant.native_handle in (None, REFUSED):
        return
    refused = ext.plan_direct(variant.native_handle, direct.library, direct.arguments)
    if refused:
        log.debug("decision=direct_refused key=%s reason=%s", variant.entry.digest, refused)


def _takeover(segment, depth: int, inputs: list, outputs: list, cold_timing) -> None:
    runtime = interceptors.current_runtime()
    runtime.adopt_native_run(segment, depth, inputs, outputs, cold_timing)


def _harvest() -> None:
    """Every HARVEST_EVERY cold runs of a thread: count them in the key table (a key may turn
    due and start its compile) and swap in the kernels the worker finished (a key with a
    kernel leaves C++'s cold plans then: Python's engine runs it fused)."""
    runtime = interceptors.current_runtime()
    ext = native.loaded()
    if runtime is None or ext is None or runtime.stood_aside:
        return
    _take_counts(runtime.table, ext, runtime)
    runtime.table.poll_compiles()
    if runtime.pause_requested:                # cold runs of keys that never pay: pause now
        upcalls.control_point()                # (between two ops: hot_path_op checks)


def _take_counts(table, ext, runtime=None) -> None:
    """Count what C++ ran since the last time: cold plans' runs, kernels' launches made
    without Python (Note [Launching from C++])."""
    for handle, runs, misses, wall_s, compute_s, fusible_s, last_s in ext.take_plan_counts():
        variant = _variants.get(handle)
        if variant is not None:
            if runs:
                table.touch(variant, last_s if clock.is_the_machines() else None, runs)
                if runtime is not None:
                    runtime.ran_native_kernel(variant, runs)
            continue
        entry = _watched.get(handle)
        if entry is None:
            continue
        if runs and not table.observe_runs(entry, runs, wall_s, compute_s, fusible_s):
            unwatch(entry)                     # forgotten meanwhile
            continue
        if runs and runtime is not None:
            runtime.ran_cold(entry, runs)      # Note [Pausing] (runtime/pausing.py)
        if misses > runs:                    # Python's recording finds what comes instead
            unwatch(entry)
            entry.cold_refused = True
            log.debug("decision=cold_plan_dropped key=%s misses=%d runs=%d", entry.digest,
                      misses, runs)


_named_when_idle: set = set()    # ops offered to the extension to run on an idle thread
_idle_reasons: list = []         # per slot of the extension's, the fallback reason it counts


def pass_when_idle(ext, func, reason: str) -> None:
    """Note [Boundaries passed when idle] (csrc/intercept.cpp): let the extension run
    ``func`` on threads with no segment open, if it ends segments whatever its arguments."""
    if func in _named_when_idle:
        return
    _named_when_idle.add(func)
    if boundary_whatever_the_arguments(func):
        with _lock:
            if ext.pass_when_idle(func._schema.name, func._schema.overload_name,
                                  reason == Reason.HOST_SYNC.value) >= 0:
                _idle_reasons.append(reason)


def _set_callbacks(ext) -> None:
    global _callbacks_set
    if not _callbacks_set:
        ext.set_hot_callbacks(_launch, _takeover, RETRY, _harvest, _ran_per_op,
                              HARVEST_EVERY, HARVEST_AFTER_S)
        _callbacks_set = True


# ---------------------------------------------------------------- a segment as plain data

def _plan(segment, node_ids: list, mutates: bool) -> tuple:
    """(context, ops, live refs, final results, mutates, written inputs): plan_add's
    arguments."""
    ops = [_op_spec(record, node_id) for record, node_id in zip(segment.ops, node_ids)]
    live = [_out_ref(ref) for ref in segment.live_refs]
    final = [_out_ref(ref) for ref in final_results(segment.ops)]   # Note [Results thrown away]
    return (_context(segment.context), ops, live, final, mutates,
            sorted(segment.written_inputs))


def _context(context: tuple) -> tuple:
    parts = dict(zip(KEY_CONTEXT_FIELDS, context))
    unknown = set(parts) - {"torch_version", "settings", *_CONTEXT_PARTS}
    if unknown or parts.get("settings", ()) != () or parts["torch_version"] != torch.__version__:
        raise Unsupported(f"key context {sorted(unknown) or parts.get('settings')}")
    return tuple(parts[name] for name in _CONTEXT_PARTS)


def _out_ref(ref: tuple) -> tuple:
    if ref[0] != "out":
        raise Unsupported(f"ref {ref}")
    return ref[1], ref[2]


def _op_spec(record, node_id: int) -> tuple:
    func = record.func
    schema = func._schema
    names = [argument.name for argument in schema.arguments]
    kwargs = dict(record.kwargs)
    args = []
    for index, argument in enumerate(schema.arguments):
        if index < len(record.args):
            args.append(_arg_spec(record.args[index], argument))
        elif argument.name in kwargs:
            args.append(_arg_spec(kwargs.pop(argument.name), argument))
        else:
            args.append(("d",))
    if kwargs:
        raise Unsupported(f"{func}: keywords {sorted(kwargs)}")
    outs, list_return = _outputs(record, schema)
    op_class = record.op_class
    returned = [names.index(name) for _, name in op_class.returned_args]
    if record.kind is OpKind.MUTATING and len(returned) != len(schema.returns):
        raise Unsupported(f"{func}: returns")
    written = [names.index(name) for _, name in op_class.written_lists]
    return (node_id, schema.name, schema.overload_name, _KINDS[record.kind], args, outs,
            list_return, returned, written, bool(op_class.extern))


def _outputs(record, schema) -> tuple[list, bool]:
    if record.kind is not OpKind.FUSIBLE:
        return [], False
    types = [str(ret.type) for ret in schema.returns]
    list_return = types == ["List[Tensor]"]
    if not list_return and (types != ["Tensor"] * len(types) or
                            len(types) != len(record.out_metas)):
        raise Unsupported(f"{record.func}: returns {types}")
    if any(meta is None for meta in record.out_metas):
        raise Unsupported(f"{record.func}: an output that is no tensor")
    return [(tuple(m.shape), tuple(m.stride), m.dtype, str(m.device))
            for m in record.out_metas], list_return


_NUMBER_KINDS = {bool: "b", int: "i", float: "f", complex: "c"}
_TENSOR_TYPES = ("Tensor", "Optional[Tensor]")


def _arg_spec(encoded, argument) -> tuple:
    if type(encoded) is TensorArg:
        return ("t", _tensor_spec(encoded))
    if type(encoded) is ScalarArg and str(argument.type) in _TENSOR_TYPES:
        return ("w", encoded.value, _NUMBER_KINDS[encoded.kind])   # x * 2.0: a wrapped number
    if type(encoded) is LiftedScalar:                  # Note [Lifted scalars]
        return ("s", [encoded.ref[1]], False, str(argument.type) in _TENSOR_TYPES)
    if type(encoded) is tuple and encoded and all(type(i) is LiftedScalar for i in encoded):
        return ("s", [item.ref[1] for item in encoded], True, False)
    if type(encoded) is tuple and any(type(item) is TensorArg for item in encoded):
        if not all(item is None or type(item) is TensorArg for item in encoded):
            raise Unsupported("a list of tensors and other values")
        return ("l", [None if item is None else _tensor_spec(item) for item in encoded])
    return ("v", decode(encoded, _no_tensor))


def _no_tensor(arg):
    raise Unsupported("a tensor inside a value")


def _tensor_spec(arg: TensorArg) -> tuple:
    ref = arg.ref
    op, index = (-1, ref[1]) if ref[0] == "in" else (ref[1], ref[2])
    return (op, index, tuple(arg.shape), tuple(arg.stride), arg.dtype, str(arg.device),
            arg.aligned)
