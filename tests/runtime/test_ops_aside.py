"""Note [Ops aside] (runtime/aside.py): host syncs of values no deferred op wrote, and
bookkeeping on 0-dim CPU tensors, run where they come without ending the segment; what
touches the segment still ends it or joins it. Plain eager is the oracle."""
import copy

import pytest
import torch

import adaptive_eager as ae
from helpers import assert_equal

pytestmark = pytest.mark.usefixtures("backend")

STEPS = 8


def _kernels_with(compiler, *names: str) -> list:
    """The compiled graphs that hold an op of each name."""
    def holds(graph, name):
        return any(name in str(node.target) for node in graph.graph.nodes)
    return [g for g in compiler.graphs if all(holds(g, name) for name in names)]


def _train(model, steps=STEPS):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(1)
    data, target = torch.randn(32, 8), torch.randn(32, 4)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(data), target).backward()
        optimizer.step()
    return optimizer


def test_adamw_s_update_is_one_kernel_across_its_step_counter_reads(compiler):
    """AdamW adds 1 to 0-dim step counters and reads each back with .item() between its two
    halves; the halves used to be two kernels."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    eager_model = copy.deepcopy(model)
    eager_optimizer = _train(eager_model)
    with ae.enabled():
        optimizer = _train(model)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert_equal(p, q, bitwise=True)
    for state, eager_state in zip(optimizer.state.values(), eager_optimizer.state.values()):
        for field, value in state.items():
            assert_equal(value, eager_state[field], bitwise=True)
    assert _kernels_with(compiler, "_foreach_lerp_", "addcdiv"), \
        "the moments' update and the parameters' update are in different kernels"
    assert not _kernels_with(compiler, "_foreach_add_.Tensor"), \
        "the step counters' bookkeeping went into a kernel"
    assert ae.stats().fused_executions > 0


def _read_between(x, flag, written_read: bool):
    y = (x * 2.0).sin()
    # .item() of a tensor no op here wrote, or of one this function just computed
    value = y.sum().item() if written_read else flag.item()
    return (y * 3.0).cos() + value


@pytest.mark.parametrize("written_read", [False, True], ids=["input", "computed"])
def test_a_host_sync_ends_the_segment_only_if_it_reads_what_the_segment_wrote(
        compiler, written_read):
    x, flag = torch.randn(64), torch.tensor([0.5])     # 1-dim: not bookkeeping, a host sync
    expected = _read_between(x, flag, written_read)
    with ae.enabled():
        for _ in range(6):
            got = _read_between(x, flag, written_read)
            assert_equal(got, expected, bitwise=True)
        ae.sync()
    across = _kernels_with(compiler, "sin", "cos")
    if written_read:
        assert not across, "a kernel ran past a read of the value it computes"
        assert _kernels_with(compiler, "cos") or _kernels_with(compiler, "sin")
    else:
        assert across, "the read of an untouched input ended the segment"
    assert ae.stats().fused_executions > 0


def _scale_then_count(x, count):
    y = x * count           # the segment reads the 0-dim counter...
    count.add_(1)           # ...so its bump must wait for the read: it joins the segment
    return (y * 2.0).exp()


def test_bookkeeping_on_a_tensor_the_segment_reads_is_not_run_early(compiler):
    x, count = torch.randn(64), torch.tensor(1.0)
    expected = [_scale_then_count(x, count) for _ in range(8)]
    expected_count, count = count, torch.tensor(1.0)
    with ae.enabled():
        got = [_scale_then_count(x, count) for _ in range(8)]
        ae.sync()
    for result, eager_result in zip(got, expected):
        assert_equal(result, eager_result, bitwise=True)
    assert_equal(count, expected_count, bitwise=True)
    assert _kernels_with(compiler, "add_", "exp"), "the bump did not join the segment"
    assert ae.stats().fused_executions > 0

