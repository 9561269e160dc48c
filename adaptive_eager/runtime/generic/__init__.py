"""Shape-generic segments: one kernel for a segment whose sizes vary along a few dims.

A loop whose sequence length changes every step records the same op structure at many shapes.
From two or more such recorded variants, ``generalize`` derives a ``GenericSegment``: which
input dims vary (each group of dims that always share a size is one *symbol*), and which integer
arguments follow them (the ``[16, 16]`` of a ``view`` that flattens ``[2, 8, 16]`` is recorded
as ``[2 * s0, 16]``). From it:

- ``output_metas`` gives every op's output metas for new concrete input metas, so the hot path
  can hand out real outputs of the right shape before the kernel runs (a generated function of
  the symbols, Note [Symbolic output metas], else meta-device replay; cached per symbol values);
- ``build_generic_graph`` builds the FX graph with the calling convention of
  ``runtime.graph.build_graph`` (``(*inputs, *buffers)``, ``aten.copy_`` into each buffer), with
  varying sizes computed from ``aten.sym_size`` of the inputs;
- ``compile_generic`` compiles it once with Inductor for all sizes (see Note [Symbolic compile]).

These run aten ops (on meta and fake tensors): call them outside the adaptive dispatch mode.

    model.py    GenericSegment, GenericMeta, SizeExpr; ``bind``; the worker's wire format
    derive.py   ``generalize`` (Note [Affine sizes]), ``varying_dims``, ``fits``
    shapes.py   ``output_metas``, ``shape_function`` (Note [Symbolic output metas])
    kernel.py   ``build_generic_graph``, ``compile_generic`` (Note [Symbolic compile])
"""
from adaptive_eager.runtime.generic.model import (GenericMeta, GenericSegment, NotGeneric,
                                                  SizeExpr, from_wire, to_wire)
from adaptive_eager.runtime.generic.shapes import output_metas, shape_function
from adaptive_eager.runtime.generic.derive import fits, generalize, varying_dims
from adaptive_eager.runtime.generic.kernel import (build_generic_graph, compile_generic,
                                                   compile_symbolic, learned_conditions)

__all__ = ["GenericMeta", "GenericSegment", "NotGeneric", "SizeExpr", "build_generic_graph",
           "compile_generic", "compile_symbolic", "fits", "from_wire", "generalize",
           "learned_conditions", "output_metas", "shape_function", "to_wire", "varying_dims"]
