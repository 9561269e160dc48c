"""Test stand-ins, shipped so that tests and benchmarks of programs using adaptive-eager can use
them too; the runtime itself never imports this package.

- ``CountingCompiler``, ``StandInKernel`` (compiler.py): a compiler that runs each graph as it
  is, and counts the graphs (use it with ``runtime.compiler.use_compiler``);
- ``faults.inject`` (faults.py): the switch for the fault injection points of
  ``adaptive_eager.faults``.
"""
from adaptive_eager.testing.compiler import CountingCompiler, StandInKernel

__all__ = ["CountingCompiler", "StandInKernel"]
