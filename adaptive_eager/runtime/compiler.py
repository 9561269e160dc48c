"""Turning a Segment into a fused kernel, behind one small interface.

A compiler takes the FX graph of a segment (see runtime.graph) and example inputs, and returns a
callable with the same calling convention. ``InductorCompiler`` is the real one; unit tests
use the stand-in ``adaptive_eager.testing.CountingCompiler`` (through ``use_compiler``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Callable, Iterator, Protocol

import torch
import torch.fx as fx

from adaptive_eager import faults
from adaptive_eager.cache import inductor_dir
from adaptive_eager.fork_safety import reinit_in_child
from adaptive_eager.runtime.graph import build_graph
from adaptive_eager.runtime.segment import Segment

FusedKernel = Callable[..., object]


class Compiler(Protocol):
    name: str

    def compile(self, graph: fx.GraphModule, example_inputs: list[torch.Tensor]) -> FusedKernel:
        ...

    def compile_generic(self, generic) -> tuple:
        """(kernel, generic) for a runtime.generic.GenericSegment: a kernel with the calling
        convention of ``compile``'s, for every input shape the returned generic segment (with
        what the compile assumed, if anything) binds."""
        ...

    def save(self, kernel: FusedKernel, path: str) -> bool:
        """Write ``kernel`` to ``path``; False if this kernel cannot be saved."""
        ...

    def load(self, path: str) -> FusedKernel:
        ...


class InductorCompiler:
    """TorchInductor's standalone_compile on the raw aten graph (functionalizes in-place ops).
    Every call into Inductor uses our Inductor cache directory, and only those calls do
    (Note [Our Inductor cache] in cache/inductor_dir.py)."""

    name = "inductor"

    def compile(self, graph: fx.GraphModule, example_inputs: list[torch.Tensor]) -> FusedKernel:
        # It warns when it cannot bundle a saveable artifact (e.g. on an FX-cache hit). We do
        # not save artifacts (yet), and the user's program must not print our internals.
        quiet = logging.getLogger("torch._inductor.standalone_compile")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with inductor_dir.ours():     # imports Inductor first, as the program would
                from torch._inductor import standalone_compile
                return standalone_compile(graph, example_inputs,
                                          dynamic_shapes="from_example_inputs")
        finally:
            quiet.setLevel(level)

    def compile_generic(self, generic) -> tuple:
        """One kernel for every shape a runtime.generic.GenericSegment fits."""
        from adaptive_eager.runtime.generic import compile_generic
        with inductor_dir.ours():
            return compile_generic(generic)

    def save(self, kernel: FusedKernel, path: str) -> bool:
        if not kernel.is_saveable():
            return False
        with inductor_dir.ours():
            kernel.save(path=path, format="binary")
        return True

    def load(self, path: str) -> FusedKernel:
        with inductor_dir.ours():       # unpacks into Inductor's cache, then loads from it
            from torch._inductor.standalone_compile import CompiledArtifact
            return CompiledArtifact.load(path=path, format="binary")

    def prepare_load(self) -> None:
        """Do the one-time work of the first ``load`` ahead, so that the first kernel the
        worker delivers does not stall the program for it: importing Inductor (~2 s here) and
        probing the CPU's vector ISA (~7 s of test builds unless TORCHINDUCTOR_VEC_ISA_OK is
        set; cached for the process). Called on a daemon thread while the worker compiles;
        the ISA probe waits on a C++ compiler (GIL released), and neither is a compile of
        ours (Note [Why a process])."""
        with inductor_dir.ours():       # imports Inductor as the program would, then the
            from torch._inductor.cpu_vec_isa import pick_vec_isa   # probe builds test
            _lowest_priority_for_this_thread()                      # programs in its cache
            pick_vec_isa()


def _lowest_priority_for_this_thread() -> None:
    """On Linux a nice value is a thread's own, and processes it starts inherit it: the ISA
    probe's C++ compilers must not take cores from the program's threads (Note [Lending a
    thread]; this daemon thread ends after the probe). Elsewhere nothing happens."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


_compiler_lock = threading.Lock()
reinit_in_child(_compiler_lock)   # Note [Fork] (runtime/engine.py)
_active: Compiler | None = None


def current_compiler() -> Compiler:
    global _active
    with _compiler_lock:
        if _active is None:
            _active = InductorCompiler()
        return _active


@contextlib.contextmanager
def use_compiler(compiler: Compiler) -> Iterator[Compiler]:
    """Compile with ``compiler`` inside the block (tests use the CountingCompiler)."""
    global _active
    with _compiler_lock:
        saved, _active = _active, compiler
    try:
        yield compiler
    finally:
        with _compiler_lock:
            _active = saved


def compile_segment(segment: Segment, compiler: Compiler) -> tuple[FusedKernel, float]:
    """Compile ``segment`` for its live set; returns (kernel, seconds spent)."""
    started = time.perf_counter()
    graph = build_graph(segment, segment.live_refs)
    example_inputs = [meta.empty() for meta in segment.input_metas]
    example_inputs += [segment.out_meta(ref).empty() for ref in segment.live_refs]
    faults.check_compile()
    from adaptive_eager.runtime.scheduling import fused_numel, kernel_threads
    threads = kernel_threads(fused_numel(segment))          # Note [Serial kernels]
    program_threads = torch.get_num_threads()
    torch.set_num_threads(threads)          # (synchronous compiles: tests and debugging)
    try:
        kernel = compiler.compile(graph, example_inputs)
    finally:
        torch.set_num_threads(program_threads)
    return kernel, time.perf_counter() - started
