"""A kernel's first run made by the C++ hot path's launch, checked (Note [Probation] in
runtime/verify.py)."""
from __future__ import annotations

from typing import Callable

from adaptive_eager.runtime import clock
from adaptive_eager.runtime.verify import Verification

# Note [First runs in C++]
# A new kernel's first run is checked against per-op (Note [Probation] in runtime/verify.py),
# and was made by Python's engine only: a kernel came to C++ once it had passed. But where a
# cold plan shares the kernel's first ops (one layer's segment of a model's backward has a
# kernel, the other layers' run cold), C++ starts a cold run there, which parts from its plan
# where the kernel's path goes on, and Python records on from ops that ran already: the
# kernel never had a deferred run to make its first, and its segment was recorded at Python's
# cost every step (GPT-2's backward: ~60 ops a step, seen over a hundred times, never fused).
# So a key with a kernel on probation that Python records is offered to C++ as it is; C++
# starts runs on a kernel's path before a cold one's, and _launch makes the check: a kernel
# that fails it is demoted, and the run keeps the per-op results the check computed.


def first_run(variant, runtime, inputs: list, buffers: list,
              call: Callable[[object, list, list], None]) -> bool:
    """Run ``variant``'s kernel (``call``) for the first time, checked as Python's engine
    checks it (FusedRuns._run_fused): True if it passed; else it is demoted, and ``buffers``
    and ``inputs`` hold what per-op execution leaves."""
    started = clock.perf_counter()
    checker = Verification(variant.segment, inputs, probation=True)
    try:
        call(variant, inputs, buffers)
    except Exception as err:  # a kernel that fails at run time is dropped, not fatal
        runtime.table.demote(variant, f"kernel_error: {type(err).__name__}: {err}")
        checker.keep_per_op_result(buffers, inputs)     # it may have written some
        return False
    if not checker.passes(buffers, inputs):
        runtime.reject(variant, checker, buffers, inputs)
        return False
    variant.on_probation = False
    # The trial's warm-up run: its time (the check's included) is set aside anyway.
    runtime.table.touch(variant, clock.perf_counter() - started)
    runtime.ran_native_kernel(variant)
    return True
