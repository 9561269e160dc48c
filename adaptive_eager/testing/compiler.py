"""The stand-in compiler unit tests use instead of Inductor.

``CountingCompiler`` "compiles" by returning the graph module itself (which runs the aten ops
one by one), so tests exercise recording, graph building, buffer writing and replay in
milliseconds, and count what would have been compiled. The compile worker imports it by its
module and name, as it does any compiler.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from adaptive_eager.runtime.compiler import FusedKernel
from adaptive_eager.runtime.generic import build_generic_graph


class StandInKernel:
    """The stand-in's kernel: the graph module, run as Inductor's kernels are in one respect
    the runtime must undo: AOTAutograd bumps the version counters of the graph inputs it writes
    (mutated inputs, output buffers), so this bumps every tensor it is given."""

    def __init__(self, graph: fx.GraphModule) -> None:
        self.graph = graph

    def __call__(self, *args: torch.Tensor) -> None:
        self.graph(*args)
        torch.autograd.graph.increment_version([t for t in args if not t.is_inference()])


class CountingCompiler:
    """Test stand-in: runs each graph module as it is (StandInKernel) and remembers every
    graph it got."""

    name = "counting"

    def __init__(self, fail_with: type[Exception] | None = None) -> None:
        self.graphs: list[fx.GraphModule] = []
        self.fail_with = fail_with
        self.loads = 0

    @property
    def count(self) -> int:
        return len(self.graphs)

    def compile(self, graph: fx.GraphModule, example_inputs: list[torch.Tensor]) -> FusedKernel:
        self.graphs.append(graph)
        if self.fail_with is not None:
            raise self.fail_with("compile failure requested by the test")
        return StandInKernel(graph)

    def compile_generic(self, generic) -> tuple:
        return self.compile(build_generic_graph(generic), []), generic

    def save(self, kernel: FusedKernel, path: str) -> bool:
        torch.save(kernel, path)                 # its GraphModule pickles as its code
        return True

    def load(self, path: str) -> FusedKernel:
        self.loads += 1
        return torch.load(path, weights_only=False)
