"""Calling a compiled kernel without AOTAutograd's runtime wrapper.

# Note [Calling the generated code]
A ``standalone_compile`` artifact is called through AOTAutograd's runtime wrapper, which
costs ~5 us a call beside a kernel of a few us (shared/spikes/kernel-launch: 9.4 us against
4.8 us for the generated module's ``call`` at 4096 elements); a tiny fused segment paid it at
every run. For the graphs we compile (inputs and output buffers in, nothing returned, writes
into the buffers kept in the graph: runtime/graph.py) AOTAutograd generates a wrapper that
only bumps the versions of the inputs the graph writes (which the runtime puts back anyway:
fused_runs._run_kernel, the C++ hot path's KeepVersions), turns grad mode off around the call and
checks that nothing came back. Where the generated wrapper is exactly that (its code names
nothing else), the kernel is called as the generated module's ``call(list)`` with grad mode
off. Any other wrapper (aliased outputs, mutations it applies itself, a joint graph) keeps the
artifact's own call, as does an artifact whose structure is not the one this was written
against (internal structure of torch 2.13: not found, nothing changes).
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any, Callable, NamedTuple

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


# Note [Launching from C++]
# Even the generated ``call`` costs ~5-10 us a run from the C++ hot path: the GIL, a list of
# wrapped tensors, a Python frame that unpacks, checks sizes and strides the hot path already
# matched, and the binding that takes the data pointers back out of the Python objects. Where
# ``call`` does nothing but call one generated C++ kernel whose arguments are all data
# pointers of the graph's own arguments (a pointwise or reduction segment: one
# ``cpp_fused_*``, no temporaries, no extern kernel), the extension calls that kernel's
# ``extern "C" kernel`` itself, found by name in the shared library the binding was loaded
# from, with the pointers of the run's inputs and buffers (``plan_direct``). Anything else
# keeps the Python call.
_ALLOWED_CHECKS = frozenset({"assert_size_stride", "assert_alignment"})


class DirectKernel(NamedTuple):
    library: str          # the shared library the kernel was loaded from
    arguments: list       # per kernel argument, the graph argument it points into


def direct_kernel(kernel: Any) -> DirectKernel | None:
    """Note [Launching from C++]: what the extension needs to call ``kernel``'s generated
    C++ code itself, or None."""
    call = _generated_call(getattr(kernel, "artifact", None))
    if call is None:
        return None
    function = getattr(call, "__func__", call)
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return None
    found = _one_kernel_call(body)
    if found is None:
        return None
    name, arguments = found
    binding = function.__globals__.get(name)
    library = getattr(getattr(binding, "__self__", None), "__file__", None)
    types = _binding_types(function.__globals__.get("__file__"), name)
    if library is None or not library.endswith(".so") or types is None or \
            len(types) != len(arguments) or not all(t.endswith("*") for t in types):
        return None
    return DirectKernel(library, arguments)


def _one_kernel_call(body: list) -> tuple[str, list] | None:
    """(kernel name, graph argument per kernel argument) if ``call``'s body only unpacks its
    arguments, checks them, calls one ``cpp_fused_*`` kernel on them and returns nothing."""
    if not body or not _unpacks_args(body[0]):
        return None
    names = [target.id for target in body[0].targets[0].elts]
    kernel = None
    for statement in body[1:]:
        if isinstance(statement, ast.Delete) or _returns_nothing(statement):
            continue
        called = _called_name(statement)
        if called == "args.clear" or called in _ALLOWED_CHECKS:
            continue
        if called is None or not called.startswith("cpp_fused_") or kernel is not None:
            return None
        call = statement.value
        if call.keywords or not all(isinstance(a, ast.Name) and a.id in names
                                    for a in call.args):
            return None
        kernel = (called, [names.index(a.id) for a in call.args])
    return kernel


def _unpacks_args(statement) -> bool:
    return isinstance(statement, ast.Assign) and len(statement.targets) == 1 and \
        isinstance(statement.targets[0], ast.Tuple) and \
        all(isinstance(t, ast.Name) for t in statement.targets[0].elts) and \
        isinstance(statement.value, ast.Name) and statement.value.id == "args"


def _returns_nothing(statement) -> bool:
    return isinstance(statement, ast.Return) and isinstance(statement.value, ast.Tuple) and \
        not statement.value.elts


def _called_name(statement) -> str | None:
    if not isinstance(statement, ast.Expr) or not isinstance(statement.value, ast.Call):
        return None
    func = statement.value.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return None


def _binding_types(module_path: str | None, name: str) -> list | None:
    """The C argument types ``name = async_compile.cpp_pybinding([...], ...)`` declares."""
    if module_path is None:
        return None
    try:
        with open(module_path) as source:
            tree = ast.parse(source.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1 and \
                isinstance(statement.targets[0], ast.Name) and \
                statement.targets[0].id == name and isinstance(statement.value, ast.Call) \
                and statement.value.args and isinstance(statement.value.args[0], ast.List):
            types = [item.value for item in statement.value.args[0].elts
                     if isinstance(item, ast.Constant) and isinstance(item.value, str)]
            return types if len(types) == len(statement.value.args[0].elts) else None
    return None
