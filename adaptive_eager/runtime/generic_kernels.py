"""Generic kernels: one kernel for every shape of a structure that keeps changing shape.

# Note [Generic kernels]
A key turning hot whose structure keeps coming in other shapes (variable batch or sequence
length) gets, with all its shapes, one kernel compiled for sizes that vary (runtime.generic),
rather than one kernel per shape. It is derived from the structure's last GENERIC_VARIANTS
shapes and, once ready, serves every shape it ``fits`` without a compile. Where the shapes
cannot share one (``NotGeneric``, or its compile failed), the reason is counted as
``not_generic`` and the keys waiting for it compile one by one.
"""
from __future__ import annotations

import functools
import time

from adaptive_eager import faults
from adaptive_eager.cache.digest import stable_digest
from adaptive_eager.runtime.compiler import current_compiler
from adaptive_eager.runtime.compiles import NOT_LOADED, Compiles
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime.entries import (GENERIC_VARIANTS, KeyEntry, KeyState, Structure,
                                            structure_of)
from adaptive_eager.runtime.generic import fits, from_wire, generalize
from adaptive_eager.runtime.kernels import LoadedKernels
from adaptive_eager.runtime.scheduling import fused_numel
from adaptive_eager.runtime.segment import to_wire
from adaptive_eager.runtime.stats import counters


class GenericKernels:
    def __init__(self, loaded: LoadedKernels, compiles: Compiles) -> None:
        self._loaded = loaded
        self._compiles = compiles

    def compile_generically(self, entry: KeyEntry) -> bool:
        """Compile ``entry``'s structure's generic kernel (Note [Generic kernels]), if it
        comes in enough shapes. True when ``entry`` waits for that kernel, or got it; False:
        compile it on its own."""
        structure = entry.structure
        if structure.generic_state == "failed" or len(structure.recent) < GENERIC_VARIANTS:
            return False
        if structure.generic_state == "none":
            self._start(structure)
        if structure.generic_state == "ready":
            return self.serve(entry)
        if structure.generic_state == "failed":
            return False
        entry.state = KeyState.COMPILING
        structure.waiting.append(entry)
        decide("compiling", key=entry.digest, ops=len(entry.segment.ops), generic=True)
        return True

    def _start(self, structure: Structure) -> None:
        variants = list(structure.recent)
        example = variants[0]
        structure.generic_state = "compiling"
        structure.digest = "generic-" + stable_digest(structure_of(example))
        compiler = current_compiler()
        if self._compiles.in_background:
            self._compiles.send(functools.partial(self._finish, structure, example), compiler,
                                structure.digest, to_wire(example), (),
                                tuple(to_wire(v) for v in variants),
                                largest_numel=max(fused_numel(v) for v in variants))
            return
        started = time.perf_counter()
        try:
            faults.check_compile()
            kernel, generic = compiler.compile_generic(generalize(variants, symbolic=False))
        except Exception as err:  # NotGeneric, or the compiler's error: compile per shape
            self._failed(structure, f"{type(err).__name__}: {err}"[:500])
            return
        self._ready(structure, generic, kernel, time.perf_counter() - started)

    def _finish(self, structure: Structure, example, result) -> None:
        if not result.ok:
            self._failed(structure, result.error)
            return
        kernel = self._loaded.load_shipped(result.artifact[0])      # always a transfer file
        if kernel is None:
            self._failed(structure, NOT_LOADED)
            return
        self._ready(structure, from_wire(example, result.generic), kernel, result.seconds)

    def _ready(self, structure: Structure, generic, kernel, seconds: float) -> None:
        structure.generic, structure.kernel = generic, kernel
        structure.generic_state = "ready"
        counters.add("compiles")
        counters.add("generic_kernels")
        counters.add("compile_seconds", seconds)
        decide("compiled", key=structure.digest, ops=len(generic.example.ops),
               symbols=len(generic.symbols), seconds=seconds)
        waiting, structure.waiting = structure.waiting, []
        for entry in waiting:
            if entry.state is KeyState.COMPILING and not self.serve(entry):
                self._compiles.compile(entry)

    def _failed(self, structure: Structure, reason: str) -> None:
        structure.generic_state, structure.kernel = "failed", None
        counters.fallback("not_generic")
        if not reason.startswith(("compile_error: NotGeneric", "NotGeneric")):
            counters.add("compile_failures")
        decide("not_generic", key=structure.digest, reason=reason)
        waiting, structure.waiting = structure.waiting, []
        for entry in waiting:
            if entry.state is KeyState.COMPILING:
                self._compiles.compile(entry)

    def serve(self, entry: KeyEntry) -> bool:
        """Give ``entry`` its structure's generic kernel, if that serves its shape."""
        structure = entry.structure
        if entry.generic_refused or not fits(structure.generic, entry.segment):
            entry.generic_refused = True
            return False
        entry.reason, entry.generic = None, True
        self._loaded.install(entry, structure.kernel)
        counters.add("generic_instances")
        decide("generic_kernel", key=entry.digest, ops=len(entry.segment.ops))
        return True
