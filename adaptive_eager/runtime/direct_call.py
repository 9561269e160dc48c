"""Calling a compiled kernel without AOTAutograd's runtime wrapper.

# Note [Calling the generated code]
A ``standalone_compile`` artifact is called through AOTAutograd's runtime wrapper, which
costs ~5 us a call beside a kernel of a few us (shared/spikes/kernel-launch: 9.4 us against
4.8 us for the generated module's ``call`` at 4096 elements); a tiny fused segment paid it at
every run. For the graphs we compile (inputs and output buffers in, nothing returned, writes
into the buffers kept in the graph: runtime/graph.py) AOTAutograd generates a wrapper that
only bumps the versions of the inputs the graph writes (which the runtime puts back anyway:
engine._run_kernel, the C++ hot path's KeepVersions), turns grad mode off around the call and
checks that nothing came back. Where the generated wrapper is exactly that (its code names
nothing else), the kernel is called as the generated module's ``call(list)`` with grad mode
off. Any other wrapper (aliased outputs, mutations it applies itself, a joint graph) keeps the
artifact's own call, as does an artifact whose structure is not the one this was written
against (internal structure of torch 2.13: not found, nothing changes).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

# Every name the plain inference wrapper's code uses (torch 2.13).
PLAIN_WRAPPER_NAMES = frozenset({"_increment_version_", "torch", "is_grad_enabled", "_C",
                                 "_set_grad_enabled", "isinstance", "tuple", "list", "len",
                                 "AssertionError"})


def fast_call(kernel: Any) -> Callable:
    """``kernel``, or a cheaper callable doing the same (Note [Calling the generated code])."""
    try:
        call = _generated_call(kernel)
    except (AttributeError, TypeError, ValueError):
        call = None
    if call is None:
        return kernel
    is_grad_enabled, set_grad_enabled = torch.is_grad_enabled, torch._C._set_grad_enabled

    def run(*tensors: torch.Tensor) -> None:
        if not is_grad_enabled():
            call(list(tensors))
            return
        set_grad_enabled(False)
        try:
            call(list(tensors))
        finally:
            set_grad_enabled(True)
    run.artifact = kernel
    return run


def _generated_call(kernel: Any) -> Callable | None:
    """The generated module's ``call`` behind a plain inference wrapper, else None."""
    from torch._inductor.output_code import CompiledFxGraph
    boxed = getattr(kernel, "_compiled_fn", None)           # CacheCompiledArtifact's lambda
    runtime_wrapper = _closure(boxed).get("compiled_fn")
    parts = _closure(runtime_wrapper)
    generated, graph = parts.get("_codegen_runtime_wrapper"), parts.get("_inner_compiled_fn")
    if not isinstance(graph, CompiledFxGraph) or graph.current_callable is None or \
            generated is None:
        return None
    if not set(generated.__code__.co_names) <= PLAIN_WRAPPER_NAMES:
        return None
    return graph.current_callable


def _closure(function: Any) -> dict:
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    if code is None or not cells:
        return {}
    values = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            values[name] = cell.cell_contents
        except ValueError:                 # an empty cell
            pass
    return values
