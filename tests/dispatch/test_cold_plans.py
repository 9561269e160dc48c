"""Cold plans (Note [Cold plans] in csrc/plans.cpp): once Python's engine has seen a key
twice, C++ runs its ops per-op and counts its runs; the key table goes on as if Python had
recorded each. Plain eager is the oracle: a cold run computes exactly what eager does, with
the same version counters and autograd graph.
"""
import copy

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.runtime import engine, native_plans
from adaptive_eager.runtime.entries import KeyState
from adaptive_eager.testing import faults
from helpers import assert_equal

pytestmark = pytest.mark.usefixtures("cpp_extension")


@pytest.fixture(autouse=True)
def cpp_backend():
    with config.patch(BACKEND="cpp"):
        yield


def step(x, w):
    return ((x * w + 1.0).sin() * 3.0).cos().relu() + x


def _only_entry():
    [entry] = engine.shared_table().entries()
    return entry


def test_a_known_key_runs_in_cpp_and_is_counted_as_seen():
    x, w = torch.randn(256), torch.randn(256)
    with config.patch(COMPILE=False), ae.enabled():
        outs = [step(x, w) for _ in range(100)]
        ae.sync()
        stats = ae.stats()
        entry = _only_entry()
    assert stats.segments_recorded == 2                 # Python saw it twice...
    assert stats.native_cold_runs == 98, stats          # ...and C++ ran the rest
    assert entry.seen == 100 and entry.state is KeyState.HOT
    assert stats.ops_seen == stats.per_op_executions == 100 * 7
    for out in outs:
        assert_equal(out, step(x, w), bitwise=True)


def test_a_cold_key_banks_toward_its_compile_and_its_kernel_replaces_its_plan():
    """A key waiting for its compile (Note [When to compile]) banks through C++'s runs: seen
    twice by Python it could not have banked what the compile costs. The kernel then takes
    over from the cold plan, and the loop runs fused."""
    x, w = torch.randn(4096), torch.randn(4096)
    with config.patch(ASYNC=True, COMPILE_COST_MS=1), ae.enabled():
        early = [step(x, w) for _ in range(300)]
        entry = _only_entry()
        assert entry.state in (KeyState.COMPILING, KeyState.READY), entry.state
        assert ae.stats().native_cold_runs > 0
        ae.sync(wait_compiles=120)
        late = [step(x, w) for _ in range(10)]
        ae.sync()
        assert entry.state is KeyState.READY and entry.cold_plan is None
        assert ae.stats().fused_executions >= 5
    for out in early + late:
        assert_equal(out, step(x, w), bitwise=True)


def test_foreach_updates_keep_eager_versions_and_values():
    params = [torch.randn(32, requires_grad=True) for _ in range(3)]
    expected = [p.detach().clone().requires_grad_() for p in params]
    grads = [torch.randn(32) for _ in range(3)]

    def update(tensors):
        with torch.no_grad():
            torch._foreach_mul_(tensors, 0.9)
            torch._foreach_add_(tensors, grads, alpha=-0.1)

    with config.patch(COMPILE=False), ae.enabled():
        for _ in range(30):
            update(params)
        ae.sync()
        assert ae.stats().native_cold_runs > 20
    for _ in range(30):
        update(expected)
    for got, want in zip(params, expected):
        assert_equal(got, want, bitwise=True)
        assert got._version == want._version


def test_a_training_step_run_cold_has_eager_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 1))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 16)

    def train(net, steps):
        for _ in range(steps):
            net.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.01 * p.grad

    with config.patch(COMPILE=False), ae.enabled():
        train(model, 20)
        ae.sync()
        assert ae.stats().native_cold_runs > 20
    train(reference, 20)
    for got, want in zip(model.parameters(), reference.parameters()):
        assert_equal(got, want, bitwise=True)


def test_a_plan_whose_runs_keep_other_outputs_alive_goes_back_to_python():
    """The key's segment let its intermediate die; the loop then keeps it: C++'s runs end
    with other outputs live, as misses, and the plan is dropped, so Python's recording
    finds the loop's own key."""
    x, w = torch.randn(256), torch.randn(256)

    def keep_both(x, w):
        y = (x * w + 1.0).sin()
        return y, (y * 3.0).cos()

    with config.patch(COMPILE=False), ae.enabled():
        for _ in range(4):
            keep_both(x, w)[1]                    # the key: y dies
        kept = [keep_both(x, w) for _ in range(200)]
        ae.sync()
        stats = ae.stats()
    assert stats.fallbacks.get("cold_plan_missed", 0) > 0
    assert stats.native_cold_runs > 100, stats    # after a harvest, its own key runs cold
    for y, out in kept:
        assert_equal(y, (x * w + 1.0).sin(), bitwise=True)
        assert_equal(out, ((x * w + 1.0).sin() * 3.0).cos(), bitwise=True)


def test_a_numpy_read_in_a_cold_run_does_not_end_it():
    x, w = torch.randn(256), torch.randn(256)

    def read_between(x, w):
        y = (x * w + 1.0).sin()
        first = float(y.numpy()[0])        # an escape: nothing deferred to run
        return first, (y * 3.0).cos()

    with config.patch(COMPILE=False), ae.enabled():
        got = [read_between(x, w) for _ in range(50)]
        ae.sync()
        stats = ae.stats()
    assert stats.native_cold_runs >= 40 and not stats.fallbacks.get("cold_plan_missed"), stats
    want = read_between(x, w)
    for first, out in got:
        assert first == want[0]
        assert_equal(out, want[1], bitwise=True)


def test_a_reset_forgets_every_cold_plan():
    x, w = torch.randn(256), torch.randn(256)
    with config.patch(COMPILE=False), ae.enabled():
        for _ in range(5):
            step(x, w)
        ae.sync()
        assert native_plans.registered()
    ae.reset()
    assert not native_plans.registered()


def test_an_output_returned_on_an_earlier_output_s_memory_does_not_keep_it_live():
    """A cold run's ops run for real: ``_unsafe_view`` returns the bmm's memory. Python's
    recording takes the later output for the holder of that memory (the earlier one is not
    live through it), and so must C++'s runs, or every run of such a key misses."""
    a, b = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 8, 4)   # 4-d: bmm, then _unsafe_view

    def matmul_then_scale(a, b):
        return (a * 2.0) @ b               # the result kept: on the bmm's memory

    with config.patch(COMPILE=False), ae.enabled():
        kept = [matmul_then_scale(a, b) for _ in range(30)]
        ae.sync()
        stats = ae.stats()
    assert not stats.fallbacks.get("cold_plan_missed"), stats
    assert stats.native_cold_runs >= 25, stats
    for out in kept:
        assert_equal(out, matmul_then_scale(a, b), bitwise=True)


def test_a_bare_loop_of_keys_that_never_pay_pauses_from_a_harvest():
    """Note [Pausing]: C++'s cold runs count toward a pause as Python's per-op runs do, and
    a harvest (between two ops) starts it: such a loop then runs plain eager, though Python
    never sees its ops."""
    x, w = torch.randn(256), torch.randn(256)
    with config.patch(COMPILE=False, PAUSE=True, PAUSE_WINDOW=20), ae.enabled():
        outs = [step(x, w) for _ in range(500)]
        assert ae.is_paused() and ae.stats().pauses >= 1
        assert ae.stats().segments_recorded == 2
    for out in outs:
        assert_equal(out, step(x, w), bitwise=True)


def _sin_then(last):
    def segment(x, w):
        return last((x * w + 1.0).sin())
    return segment


def _entry_ending_with(func):
    [entry] = [e for e in engine.shared_table().entries() if e.segment.ops[-1].func is func]
    return entry


def test_a_run_that_leaves_a_plan_s_path_is_recorded_on_by_python():
    """Two segments share their first ops, as a model's layers do in backward. A cold run
    along the first's path that turns out to be the second is Python's recording from the
    ops that ran (Note [Cold plans]): the second gets its own key and plan, and both then run
    in C++. (They used to run unseen up to where they part: the second had no key.)"""
    first, second = _sin_then(torch.cos), _sin_then(torch.exp)
    x, w = torch.randn(256), torch.randn(256)
    with config.patch(COMPILE=False), ae.enabled():
        for _ in range(3):
            first(x, w)
        pairs = [(first(x, w), second(x, w)) for _ in range(60)]
        ae.sync()
        recorded = ae.stats().segments_recorded
        pairs += [(first(x, w), second(x, w)) for _ in range(20)]
        ae.sync()
        stats = ae.stats()
        firsts, seconds = _entry_ending_with(torch.ops.aten.cos.default), \
            _entry_ending_with(torch.ops.aten.exp.default)
    assert firsts.cold_plan is not None and seconds.cold_plan is not None
    assert stats.segments_recorded == recorded, stats      # settled: C++ runs both
    assert stats.native_cold_runs >= 120, stats
    for a, b in pairs:
        assert_equal(a, first(x, w), bitwise=True)
        assert_equal(b, second(x, w), bitwise=True)


def test_a_run_cut_short_after_its_outputs_died_keeps_its_final_result_live():
    """A cold run that stops short of its plan's end (here at a random op, a boundary) is
    handed to Python's recording with no tensor for the outputs already dead: a loop that
    drops what it computes left none. Its final result still counts as live (Note [Results
    thrown away]): with nothing live, its kernel had no output, could not be saved, and the
    key failed for good (GPT-2's last layer and LM head, in a loop dropping the logits)."""
    x, w = torch.randn(256), torch.randn(256)

    def longer(x, w):
        return ((x * w + 1.0).sin() * 3.0).cos()

    def cut_short(x, w):
        (x * w + 1.0).sin()                 # dropped, like the three ops of longer before it
        torch.rand(2)                       # a boundary where longer goes on

    with config.patch(COMPILE=False), ae.enabled():
        for _ in range(4):
            longer(x, w)
        for _ in range(3):
            cut_short(x, w)
        ae.sync()
        [entry] = [e for e in engine.shared_table().entries() if len(e.segment.ops) == 3]
    assert entry.segment.live_refs == (("out", 2, 0),)       # the sin: its final result


def test_a_loss_whose_backward_passes_no_class_weights_runs_cold_in_cpp():
    """``nll_loss_backward`` gets its ``weight=None`` from autograd as an undefined tensor,
    which Python records as None: the plan must take one for the other, or the key's runs
    all went back to Python."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    reference = copy.deepcopy(model)
    x, target = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def train(net, steps):
        for _ in range(steps):
            net.zero_grad(set_to_none=False)
            torch.nn.functional.cross_entropy(net(x), target).backward()

    with config.patch(COMPILE=False), ae.enabled():
        train(model, 5)
        ae.sync()
        recorded = ae.stats().segments_recorded
        train(model, 20)
        ae.sync()
        stats = ae.stats()
    train(reference, 25)
    assert stats.segments_recorded == recorded, stats
    for got, want in zip(model.parameters(), reference.parameters()):
        assert_equal(got.grad, want.grad, bitwise=True)


def _a_kernel_path_and_a_twin_without_one():
    """Two functions whose segments share their first ops (sin, then cos or exp), their inputs,
    and the digest of the second's key, which DISABLE_KEYS keeps uncompiled."""
    first, second = _sin_then(torch.cos), _sin_then(torch.exp)
    x, w = torch.randn(256), torch.randn(256)
    with config.patch(COMPILE=False), ae.enabled():
        second(x, w), second(x, w)
        never = _entry_ending_with(torch.ops.aten.exp.default).digest
    ae.reset()
    return first, second, x, w, never


def test_a_run_that_leaves_a_kernel_s_path_goes_on_along_a_cold_plan_in_cpp():
    """Note [Divergence in C++] (csrc/run_end.cpp): a kernel's path shares its first ops with
    a segment that has no kernel. A run that parts from the kernel's path is replayed and
    goes on along the other segment's cold plan in C++, instead of being replayed and
    recorded on by Python every time."""
    first, second, x, w, never = _a_kernel_path_and_a_twin_without_one()
    with config.patch(DISABLE_KEYS=(never,)), ae.enabled():
        for _ in range(4):
            first(x, w)
        for _ in range(3):
            second(x, w)
        ae.sync()
        before = ae.stats()
        pairs = [(first(x, w), second(x, w)) for _ in range(40)]
        ae.sync()
        after = ae.stats()
    assert after.segments_recorded == before.segments_recorded, after
    assert after.native_fused_executions - before.native_fused_executions >= 40, after
    assert after.divergences - before.divergences >= 40, after
    assert after.native_cold_runs - before.native_cold_runs >= 40, after
    for a, b in pairs:
        assert_equal(a, first(x, w), bitwise=True)
        assert_equal(b, second(x, w), bitwise=True)


def test_a_kernel_path_that_runs_keep_leaving_stops_being_deferred():
    """Note [Paths that lead nowhere] (csrc/hot_path.cpp): runs that keep parting from a
    kernel's path after its first ops are no longer deferred and replayed every time: they run
    cold in C++ from their first op. The kernel's own segment still fuses when it comes back,
    within a re-probe's passes."""
    first, second, x, w, never = _a_kernel_path_and_a_twin_without_one()
    with config.patch(DISABLE_KEYS=(never,)), ae.enabled():
        for _ in range(4):
            first(x, w)
        for _ in range(20):            # past the first node's allowance of fruitless starts
            second(x, w)
        ae.sync()
        before = ae.stats()
        seconds = [second(x, w) for _ in range(48)]
        ae.sync()
        after = ae.stats()
        firsts = [first(x, w) for _ in range(16)]       # the path pays again: re-probed
        ae.sync()
        back = ae.stats()
        firsts += [first(x, w) for _ in range(8)]
        ae.sync()
        last = ae.stats()
    assert after.divergences - before.divergences <= 48 // 16, after   # only re-probes
    assert after.segments_recorded == before.segments_recorded, after
    assert after.native_cold_runs - before.native_cold_runs >= 48, after
    assert back.native_fused_executions > after.native_fused_executions, back
    assert last.native_fused_executions - back.native_fused_executions == 8, last
    for b in seconds:
        assert_equal(b, second(x, w), bitwise=True)
    for a in firsts:
        assert_equal(a, first(x, w), bitwise=True)


def _behind_a_cold_plan(first, second, x, w, steps: int = 40):
    """``second``'s key compiled while ``first``'s, sharing its first ops, runs cold in C++
    (kept uncompiled); then ``steps`` pairs of calls: (stats before, after, the pairs)."""
    with config.patch(COMPILE=False), ae.enabled():
        first(x, w), first(x, w)
        never = _entry_ending_with(torch.ops.aten.cos.default).digest
    ae.reset()
    with config.patch(DISABLE_KEYS=(never,)), ae.enabled():
        for _ in range(4):
            first(x, w)                                 # a cold plan in C++
        for _ in range(4):
            first(x, w), second(x, w)                   # hot, compiled
        ae.sync(wait_compiles=60)
        before = ae.stats()
        pairs = [(first(x, w), second(x, w)) for _ in range(steps)]
        ae.sync()
        return before, ae.stats(), pairs


def test_a_kernel_whose_first_ops_a_cold_plan_shares_gets_its_first_run_in_cpp():
    """Note [First runs in C++] (runtime/first_runs.py): a new kernel's first run is
    checked. Where a cold plan shares its first ops (a model's backward: one layer's segment
    has a kernel, the others' run cold), C++ starts a cold run there that parts from the plan
    where the kernel's path goes on, and Python records on from ops that ran already. The
    kernel's first run was left to Python's engine, which never deferred it: its key was
    recorded per-op every time and never fused."""
    first, second = _sin_then(torch.cos), _sin_then(torch.exp)
    x, w = torch.randn(256), torch.randn(256)
    before, after, pairs = _behind_a_cold_plan(first, second, x, w)
    assert after.fused_executions - before.fused_executions >= 39, after
    assert after.segments_recorded - before.segments_recorded <= 1, after
    for a, b in pairs:
        assert_equal(a, first(x, w), bitwise=True)
        assert_equal(b, second(x, w), bitwise=True)


@pytest.mark.parametrize("fault", ["wrong_arity", "wrong_values"])
def test_a_broken_kernel_s_first_run_in_cpp_never_reaches_the_results(fault):
    """The check of Note [Probation], made by C++'s launch: a kernel that raises or writes
    garbage (into its inputs too) is demoted, and the run keeps per-op's results."""
    first, second = _sin_then(torch.cos), _sin_then(torch.exp)
    x, w = torch.randn(256), torch.randn(256)
    expected_x, expected_w = x.clone(), w.clone()
    with faults.inject(fault):
        _, after, pairs = _behind_a_cold_plan(first, second, x, w, steps=5)
    entry = _entry_ending_with(torch.ops.aten.exp.default)
    reason = "kernel_error" if fault == "wrong_arity" else "kernel_mismatch"
    assert entry.state is KeyState.FAILED and entry.reason.startswith(reason), entry.reason
    assert after.fallbacks[reason] == 1 and after.fused_executions == 0, after
    assert_equal(x, expected_x, bitwise=True)
    assert_equal(w, expected_w, bitwise=True)
    for a, b in pairs:
        assert_equal(a, first(x, w), bitwise=True)
        assert_equal(b, second(x, w), bitwise=True)
