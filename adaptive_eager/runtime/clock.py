"""The clocks the runtime's policy reads (Note [Clock]).

# Note [Clock]
Policy decisions depend on measured time: what a cold segment's ops compute (too cheap to
compile? extern-bound? what would it save?), a segment's wall time (interception), a fused run's
and the plain per-op runs timed beside it (Note [Side by side], runtime/profit.py), and when a
pause ends. The runtime reads every such time here, as ``clock.perf_counter()`` (durations) and
``clock.monotonic()`` (deadlines): a module attribute looked up at each call, as cheap as
``time.perf_counter()``. Tests replace both with a fake clock (tests/helpers.py, FakeClock) to
state timings instead of measuring them on a busy machine. Times that decide no policy (compile
and load seconds for stats, the worker's timeouts, the decision log's repeat interval) read
``time`` directly.
"""
from __future__ import annotations

import time

perf_counter = time.perf_counter
monotonic = time.monotonic


def is_the_machines() -> bool:
    """Is the clock the machine's (not one a test states)? Times measured in C++ are the
    machine's: where a test states times, they must not decide policy."""
    return perf_counter is time.perf_counter
