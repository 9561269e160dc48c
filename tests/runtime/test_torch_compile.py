"""A function the user compiled with torch.compile still runs compiled under the runtime."""
import pytest
import torch

import adaptive_eager as ae
from helpers import assert_equal

pytestmark = pytest.mark.inductor


def test_a_torch_compiled_function_runs_compiled_and_untouched():
    from torch._dynamo.utils import counters as dynamo_counters

    @torch.compile
    def user_compiled(x):
        return (x * 2 + 1).sin().cos()

    x = torch.randn(256)
    dynamo_counters.clear()
    with ae.enabled():
        results = [user_compiled(x) for _ in range(3)]
        stats = ae.stats()
    graphs = dynamo_counters["stats"]["unique_graphs"]
    assert graphs >= 1                                   # Dynamo compiled it...
    assert stats.ops_seen == 0                           # ...and its kernels bypassed us
    # Dynamo inlines the mode's __torch_dispatch__ while tracing: a lock taken there (a
    # counter) split the function into two graphs
    assert not dynamo_counters["graph_break"], dict(dynamo_counters["graph_break"])
    for result in results:
        assert_equal(result, (x * 2 + 1).sin().cos())
    user_compiled(x)                                     # no recompile once we are off
    assert dynamo_counters["stats"]["unique_graphs"] == graphs
