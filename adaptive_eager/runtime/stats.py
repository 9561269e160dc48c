"""Counters of the runtime, and the frozen record ``ae.stats()`` returns."""
from __future__ import annotations

import collections
import dataclasses
import threading
import types

from adaptive_eager.fork_safety import reinit_in_child


@dataclasses.dataclass(frozen=True)
class Stats:
    """A snapshot of the runtime's counters (process-wide, all threads)."""

    ops_seen: int = 0
    segments_recorded: int = 0
    keys_seen: int = 0
    keys_forgotten: int = 0
    hot_keys: int = 0
    compiles: int = 0
    compile_failures: int = 0
    compile_seconds: float = 0.0
    compiles_in_flight: int = 0     # now, not counted: in the worker (warm-up is not over)
    compiles_waiting: int = 0       # now: hot keys whose compile waits (Note [When to compile])
    steps_on_trial: int = 0         # now: runtimes timing steps intercepting against paused
                                    # (Note [Judged by the step], runtime/step_judge.py)
    generic_kernels: int = 0        # compiles for every shape of a structure
                                    # (Note [Generic kernels], runtime/generic_kernels.py)
    generic_instances: int = 0      # keys (shapes) served by one of those, without a compile
    fused_executions: int = 0
    fused_ops: int = 0
    native_fused_executions: int = 0    # of which deferred and launched by the C++ hot path
    native_direct_executions: int = 0   # of those, the kernel's code called from C++ (Note
                                        # [Launching from C++] in runtime/direct_call.py)
    per_op_executions: int = 0
    native_cold_runs: int = 0       # segments C++ ran per-op without Python (Note [Cold
                                    # plans] in csrc/plans.cpp)
    divergences: int = 0
    lifted_positions: int = 0       # float arguments that became kernel inputs (Note [Lifted
                                    # scalars] in runtime/scalars.py)
    cache_hits_memory: int = 0
    cache_hits_disk: int = 0
    cache_load_seconds: float = 0.0
    pauses: int = 0
    pauses_without_kernels: int = 0     # pauses run without kernels that did not pay (Note
                                        # [Kernels that do not pay while paused], the step judge)
    backend: str = ""               # "cpp" or "python": what intercepts (see api.backend)
    fallbacks: types.MappingProxyType = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}))

    def as_dict(self) -> dict:
        result = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        result["fallbacks"] = dict(self.fallbacks)
        return result


# read at snapshot time, not counted
_GAUGES = ("compiles_in_flight", "compiles_waiting", "steps_on_trial")


class Counters:
    """The mutable side: incremented by the runtime under one lock, frozen by ``snapshot``."""

    _FIELDS = tuple(f.name for f in dataclasses.fields(Stats)
                    if f.name not in ("fallbacks", "backend", *_GAUGES))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._values = dict.fromkeys(self._FIELDS, 0)
            self._values["compile_seconds"] = 0.0
            self._values["cache_load_seconds"] = 0.0
            self._fallbacks: collections.Counter[str] = collections.Counter()

    def add(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[name] += amount

    def value(self, name: str) -> float:
        with self._lock:
            return self._values[name]

    def fallback(self, reason: str, amount: int = 1) -> None:
        """Count ops that ran per-op (or segments not fused) for a named reason."""
        with self._lock:
            self._fallbacks[reason] += amount

    def snapshot(self, **gauges: int) -> Stats:
        with self._lock:
            return Stats(**self._values, **gauges,
                         fallbacks=types.MappingProxyType(dict(self._fallbacks)))


counters = Counters()
reinit_in_child(counters._lock)   # Note [Fork] (runtime/engine.py)
