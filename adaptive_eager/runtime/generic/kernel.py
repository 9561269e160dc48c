"""One Inductor kernel for every size a GenericSegment fits.

``build_generic_graph`` builds the FX graph with the calling convention of
``runtime.graph.build_graph`` (``(*inputs, *buffers)``, ``aten.copy_`` into each buffer), with
varying sizes computed from ``aten.sym_size`` of the inputs; ``compile_generic`` compiles it
once with Inductor for all sizes (Note [Symbolic compile]). Call them outside the adaptive
dispatch mode.

# Note [Symbolic compile]
``standalone_compile(dynamic_shapes="from_example_inputs")`` fakifies real example inputs with
``static_shapes=True``: ``torch._dynamo.mark_dynamic`` on them is ignored. It also accepts a
``fake_mode`` (with a ShapeEnv), and example inputs that are already FakeTensors *of that mode*
are used as they are. So we build the fakes ourselves: one ShapeEnv symbol per varying size,
created once and shared by every input and buffer dim that has that size, strides dense in the
recorded order. Standalone artifacts carry no guards: whatever the ShapeEnv learned while
compiling would be silently assumed at run time. So what it learned (guards such as Inductor's
``256*s0 > 4096`` when it picks a strategy by size, specializations, narrowed ranges) becomes
the generic segment's ``conditions``, Python expressions that ``bind`` evaluates along with
everything else (static dims, strides, dtype, device, shared sizes, sizes >= 2) before a call.
"""
from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx

from adaptive_eager.dispatch.signature import TensorArg
from adaptive_eager.runtime.generic.model import (MIN_SYMBOL_VALUE, GenericMeta, GenericSegment,
                                                  NotGeneric, SizeExpr)
from adaptive_eager.runtime.generic.shapes import decode_args, symbolic_fakes, symbolic_mode
from adaptive_eager.runtime.graph import name_outputs, write_buffers

aten = torch.ops.aten


def build_generic_graph(generic: GenericSegment) -> fx.GraphModule:
    """``runtime.graph.build_graph`` of the generic segment: the same calling convention,
    varying sizes computed from ``aten.sym_size`` of the inputs. Runs eagerly at any size."""
    segment = generic.example
    graph = fx.Graph()
    inputs = [graph.placeholder(f"in_{k}") for k in range(len(segment.input_metas))]
    buffers = [graph.placeholder(f"out_{k}") for k in range(len(segment.live_refs))]
    sizes = [graph.call_function(aten.sym_size.int, (inputs[k], d))
             for k, d in (group[0] for group in generic.symbols)]
    exprs: dict[SizeExpr, fx.Node] = {}
    values: dict[tuple, fx.Node] = {}

    def tensor_of(arg: TensorArg) -> fx.Node:
        return inputs[arg.ref[1]] if arg.ref[0] == "in" else values[arg.ref]

    def leaf(value: Any) -> Any:
        if not isinstance(value, SizeExpr):
            return value
        if value not in exprs:
            node = sizes[value.symbols[0]]
            for j in value.symbols[1:]:
                node = graph.call_function(operator.mul, (node, sizes[j]))
            if value.coeff != 1:
                node = graph.call_function(operator.mul, (value.coeff, node))
            if value.offset:
                node = graph.call_function(operator.add, (node, value.offset))
            exprs[value] = node
        return exprs[value]

    for index, (op, (args, kwargs)) in enumerate(zip(segment.ops, generic.calls)):
        node = graph.call_function(op.func, tuple(decode_args(args, tensor_of, leaf)),
                                   {name: decode_args(v, tensor_of, leaf) for name, v in kwargs})
        name_outputs(graph, values, index, op, node)
    return write_buffers(graph, buffers, segment.live_refs, values)


def compile_symbolic(graph: fx.GraphModule, metas: Sequence[GenericMeta],
                     hints: Sequence[int], options: dict | None = None):
    """Compile ``graph`` once for every value of its symbols (Note [Symbolic compile]).

    ``metas`` describe its inputs in order (external inputs, then buffers); SizeExprs in them
    refer to symbols whose example values are ``hints``. Sizes the graph passes to ops must
    already be computed from its inputs (build_generic_graph), not literal. Returns the
    standalone CompiledArtifact (``save``/``load`` work). Raises NotGeneric where the compile
    assumed something about the symbols."""
    from torch._inductor import standalone_compile

    fake_mode, symbols, symints = symbolic_mode(hints)
    fakes = symbolic_fakes(fake_mode, metas, symints)
    quiet = logging.getLogger("torch._inductor.standalone_compile")
    level = quiet.level
    quiet.setLevel(logging.ERROR)       # see InductorCompiler.compile
    try:
        artifact = standalone_compile(graph, fakes, dynamic_shapes="from_example_inputs",
                                      fake_mode=fake_mode, options=options or {})
    finally:
        quiet.setLevel(level)
    return artifact, learned_conditions(fake_mode.shape_env, symbols)


def learned_conditions(env, symbols: list) -> tuple[str, ...]:
    """What a ShapeEnv learned about ``symbols`` (guards, specializations, ranges narrower
    than [2, oo)), as Python expressions over ``v`` (v[j]: symbol j's value). Raises
    NotGeneric where one involves anything else or does not print as Python."""
    import sympy
    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.printers import PythonPrinter

    facts = [guard.expr for guard in env.guards]
    for symbol in symbols:
        if symbol in env.replacements:
            facts.append(sympy.Eq(symbol, env.replacements[symbol]))
        bounds = env.var_to_range.get(symbol)
        if bounds is not None and bounds.lower != MIN_SYMBOL_VALUE:
            facts.append(sympy.Ge(symbol, bounds.lower))
        if bounds is not None and bounds.upper != int_oo:
            facts.append(sympy.Le(symbol, bounds.upper))
    names = {symbol: sympy.Symbol(f"v[{j}]") for j, symbol in enumerate(symbols)}
    printer, conditions = PythonPrinter(), []
    for fact in facts:
        if not fact.free_symbols <= set(symbols):
            raise NotGeneric(f"the compile assumed {fact}, not only of our sizes")
        try:
            conditions.append(printer.doprint(fact.xreplace(names)))
        except Exception as err:  # an expression sympy cannot print as Python
            raise NotGeneric(f"the compile assumed {fact}, which does not print: {err}")
    return tuple(conditions)


def compile_generic(generic: GenericSegment, options: dict | None = None):
    """One Inductor kernel for every size the generic segment fits: (kernel, the generic
    segment with the conditions its compile assumed). Call the kernel as a build_graph
    kernel, ``kernel(*inputs, *buffers)``, buffers shaped by ``output_metas``, and only for
    input metas the returned segment ``bind``s."""
    graph = build_generic_graph(generic)
    kernel, conditions = compile_symbolic(graph, generic.inputs + generic.live, generic.hints,
                                          options)
    return kernel, dataclasses.replace(generic, conditions=conditions, _metas={})

