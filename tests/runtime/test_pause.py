"""Pausing: where nothing is worth fusing, the runtime stops intercepting (Note [Pausing])."""
import sys
import time

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.runtime import engine, scheduling
from adaptive_eager.runtime.compiler import use_compiler
from adaptive_eager.runtime.pausing import PAUSE_FIRST_S
from helpers import TimedKernels, assert_equal, by_size, results_held

# The Python mode's pausing: at control points, off the mode stack (the C++ backend pauses
# between ops: tests/dispatch/test_native.py).
pytestmark = pytest.mark.python_mode

TINY_OP_S = 10e-6       # what each op of the tests' tiny tensors computes for (fake clock)


@pytest.fixture
def pausing(fake_clock):
    """Pausing on, and the runtime's clock stated, not measured: each op computes for
    TINY_OP_S (far below MIN_SEGMENT_US, whatever the machine's load), and time passes
    between ops (a pause's end) only when the test advances it."""
    fake_clock.op_s = TINY_OP_S
    with config.patch(PAUSE=True, PAUSE_WINDOW=20, MIN_SEGMENT_US=1000, HOT_THRESHOLD=5,
                      KEEP_UNPROFITABLE=False):
        yield fake_clock


def _tiny_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_tiny_inference_pauses_at_a_module_call_and_stays_correct(pausing):
    model, x = _tiny_mlp(), torch.randn(1, 8)
    expected = model(x)
    with torch.no_grad():
        expected = model(x)
        with ae.enabled():
            outs = []
            for _ in range(60):
                outs.append(model(x))
                outs[-1].sum().item()              # a boundary per step: many segments
            assert ae.is_paused()
            assert _get_current_dispatch_mode() is None          # really off the stack
            seen = ae.stats().ops_seen
            outs.append(model(x))
            assert ae.stats().ops_seen == seen                   # nothing intercepted
    for out in outs:
        assert_equal(out, expected)
    assert ae.stats().pauses == 1
    assert not ae.is_enabled()


def test_a_pause_ends_at_an_optimizer_step_and_backs_off(pausing):
    model = _tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)            # lr 0: same values each step
    x = torch.randn(1, 8)
    clock = pausing

    def train(steps):
        for _ in range(steps):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    with config.patch(MIN_SEGMENT_US=1_000_000), ae.enabled():    # nothing worth fusing
        train(40)
        assert ae.is_paused()
        clock.advance(PAUSE_FIRST_S * 0.9)
        opt.step()                                               # a control point, too early
        assert ae.is_paused()
        clock.advance(PAUSE_FIRST_S * 0.2)
        opt.step()                                               # the pause is over
        assert not ae.is_paused()
        train(40)                                                # nothing new: pause again,
        assert ae.is_paused()                                    # twice as long
        clock.advance(PAUSE_FIRST_S * 1.5)
        opt.step()
        assert ae.is_paused()
        clock.advance(PAUSE_FIRST_S * 0.6)
        opt.step()
        assert not ae.is_paused()
    assert ae.stats().pauses == 2


def test_profitable_work_is_never_paused(pausing, compiler):
    pausing.op_s = 1e-3                                        # ms of compute per run
    x = torch.randn(64)
    with config.patch(KEEP_UNPROFITABLE=True), ae.enabled():   # the stand-in is no faster
        for _ in range(40):
            ((x * 2 + 1).sin() * 3).cos().sum().item()
        torch.nn.Identity()(x)                                   # a control point
        assert not ae.is_paused()
    assert ae.stats().fused_executions > 30 and ae.stats().pauses == 0


def test_a_bare_loop_without_control_points_pauses_too(pausing):
    x = torch.randn(8)
    with ae.enabled():
        outs = [(x * 2).sin().sum() for _ in range(60)]
        assert ae.is_paused()
        assert _get_current_dispatch_mode() is None
        assert sys.getprofile() is None                      # the one-shot hook is gone
        assert ae.stats().pauses == 1
        ae.sync()                                            # a control point: probes again
    for out in outs:
        assert_equal(out, (x * 2).sin().sum())


def test_a_programs_own_profiler_is_left_alone(pausing):
    x = torch.randn(8)
    seen = []
    profiler = lambda frame, event, arg: seen.append(event)  # noqa: E731
    sys.setprofile(profiler)
    try:
        with ae.enabled():
            for _ in range(60):
                (x * 2).sin().sum()
            assert sys.getprofile() is profiler and not ae.is_paused()
    finally:
        sys.setprofile(None)
    assert seen


def test_enabling_around_each_step_pauses_as_one_long_enable_would(pausing):
    model, x = _tiny_mlp(), torch.randn(1, 8)
    with torch.no_grad():
        expected = model(x)
        outs = []
        for _ in range(60):                        # 3 segments a step, PAUSE_WINDOW 20
            with ae.enabled():
                outs.append(model(x))
                outs[-1].sum().item()
        with ae.enabled():
            assert ae.is_paused() and _get_current_dispatch_mode() is None
    assert ae.stats().pauses == 1
    for out in outs:
        assert_equal(out, expected)


def test_ever_new_shapes_pause_within_a_few_steps(pausing):
    pausing.op_s = 1e-3                          # worth compiling, were a shape to come back
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
    with config.patch(PAUSE_WINDOW=64, MAX_SHAPE_VARIANTS=4), torch.no_grad(), ae.enabled():
        for length in range(1, 40):
            out = block(torch.randn(2, length, 8))
            out.sum().item()
            if ae.is_paused():
                break
    # from the third shape on, each new one counts 32 toward the window of 64
    assert length == 4, length
    assert ae.stats().compiles == 0


@pytest.mark.parametrize("op_us, min_segment_us, min_us_per_op, pauses_at_length",
                         [(100, 1000, 0, 4), (200, 1000, 0, 10), (100, 0, 1000, 4),
                          (1000, 0, 1000, 10), (100, 0, 0, 10)])
def test_ever_new_shapes_too_cheap_to_compile_pause_sooner(pausing, op_us, min_segment_us,
                                                            min_us_per_op, pauses_at_length):
    # Lengths 1 and 2 count 1 each; from the third shape on each new one counts 32, or 128
    # when its ops compute for less than MIN_SEGMENT_US + MIN_US_PER_OP per op (7 ops here,
    # each computing for op_us): the window of 256 fills at 4, or 10.
    pausing.op_s = op_us * 1e-6
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
    with config.patch(PAUSE_WINDOW=256, MIN_SEGMENT_US=min_segment_us,
                      MIN_US_PER_OP=min_us_per_op), torch.no_grad(), ae.enabled():
        for length in range(1, 40):
            block(torch.randn(2, length, 8)).sum().item()
            if ae.is_paused():
                break
    assert length == pauses_at_length
    assert ae.stats().compiles == 0


def test_small_dynamic_segments_beside_a_kernel_do_not_pause_the_loop(pausing, compiler):
    # Each iteration: a large chain (compiled, then fused: it empties the pause window) and
    # three small segments of a new shape, each too cheap to compile: 128 toward the window,
    # which they fill, but a pause needs MIN_QUIET_SEGMENTS (4) of them.
    # The stand-in compiler's kernels are no faster than per-op: keep them anyway.
    pausing.op_s = by_size(1e-9)                   # the large chain: 1 ms an op; the small
    big = torch.randn(1 << 20)                     # ones: nanoseconds
    with config.patch(PAUSE_WINDOW=256, MIN_SEGMENT_US=100, MIN_US_PER_OP=20,
                      HOT_THRESHOLD=2, KEEP_UNPROFITABLE=True), ae.enabled():
        for length in range(3, 33):
            out = ((big * 2 + 1).sin() * 3).cos()
            out.sum().item()
            (torch.ones(length) * 2 + 1).sum().item()
            (torch.ones(length, 2) - 1).abs().sum().item()
            (torch.ones(2, length) * 3).exp().sum().item()
            assert not ae.is_paused(), length
    assert ae.stats().fused_executions >= 25
    assert_equal(out, ((big * 2 + 1).sin() * 3).cos())


FUSED_S = 1e-3                  # a fused run of the chain below (TimedKernels)


def _kernel_judged_against(x, eager_s: float) -> None:
    """Run a chain on ``x`` until its kernel is in, then mark the kernel judged side by side
    against a plain eager run of ``eager_s`` seconds."""
    for _ in range(3):
        ((x * 2 + 1).sin() * 3).cos().sum().item()
    [variant] = engine.shared_table().kernels.values()
    variant.entry.judged, variant.entry.control_samples = True, [eager_s]


@pytest.mark.parametrize("saving_s, pauses", [(-FUSED_S, True), (100e-6, True), (1e-3, False),
                                              (1.0, False)])
def test_a_kernel_keeps_the_runtime_on_only_while_it_pays_for_the_interception_around_it(
        pausing, saving_s, pauses):
    """Each iteration: a kernel, and a per-op segment that is never fused (a new scalar each
    time) whose interception costs 200 us (its wall time beyond its ops'). A kernel that
    saves less than that a run (or costs: plain eager ran its segment in no time) does not
    pay for it: the runtime pauses, and everything runs plain eager. A kernel that saves
    more keeps the runtime on."""
    x, y = torch.randn(64), torch.randn(64)
    with use_compiler(TimedKernels(pausing, FUSED_S)), \
            config.patch(MIN_SEGMENT_US=0, HOT_THRESHOLD=2, KEEP_UNPROFITABLE=True), \
            ae.enabled():
        _kernel_judged_against(x, FUSED_S + saving_s)
        for step in range(60):
            chain = ((x * 2 + 1).sin() * 3).cos().sum()
            chain.item()
            shifted = y + step                                # a new key each iteration
            pausing.advance(200e-6)                           # intercepting costs this
            (shifted * 2).exp().sum().item()
    assert (ae.stats().pauses > 0) is pauses
    assert ae.stats().fused_executions >= (3 if pauses else 60)
    assert_equal(chain, ((x * 2 + 1).sin() * 3).cos().sum())


@pytest.mark.parametrize("between_ops_s", [0.01, 1.0])
def test_the_programs_own_time_between_ops_is_not_taken_for_interception(pausing,
                                                                        between_ops_s):
    """A per-op segment that spans the program's own work (10 ms, or a second) costs little
    interception: at most MOST_INTERCEPTION_S_PER_OP an op. A kernel saving 5 ms a run pays
    for it and keeps the runtime on."""
    x, y = torch.randn(64), torch.randn(64)
    with use_compiler(TimedKernels(pausing, FUSED_S)), \
            config.patch(MIN_SEGMENT_US=0, HOT_THRESHOLD=2, KEEP_UNPROFITABLE=True), \
            ae.enabled():
        _kernel_judged_against(x, FUSED_S + 0.005)
        for step in range(40):
            ((x * 2 + 1).sin() * 3).cos().sum().item()
            scaled = y * step                                    # a new key each iteration,
            pausing.advance(between_ops_s)                       # then the program's own
            (scaled + 1).exp().sum().item()                      # time
    assert ae.stats().pauses == 0 and ae.stats().fused_executions >= 40


def test_paused_block_is_plain_eager_and_keeps_the_kernels(compiler):
    x = torch.randn(64)

    def chain():
        return ((x * 2 + 1).sin() * 3).cos()
    with ae.enabled():
        outs = [chain() for _ in range(4)]                   # hot, fused, the last deferred
        with ae.paused():
            assert _get_current_dispatch_mode() is None
            seen = ae.stats().ops_seen
            plain = chain()
            assert ae.stats().ops_seen == seen
            assert_equal(outs[-1], chain())                  # deferred work was finished
        assert _get_current_dispatch_mode() is not None
        outs.append(chain())
    assert ae.stats().compiles == 1 and compiler.loads == 0  # nothing given back meanwhile
    assert ae.stats().fused_executions >= 3
    for out in outs + [plain]:
        assert_equal(out, chain())


def _unchanging_training_loop():
    """``train(steps)`` -> each step's output, and the output every step must give (lr 0)."""
    model = _tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(1, 8)
    expected = model(x).detach()

    def train(steps):
        outs = []
        for _ in range(steps):
            opt.zero_grad()
            out = model(x)
            out.sum().backward()
            opt.step()
            outs.append(out.detach())
        return outs
    return train, expected


def test_a_training_loop_intercepts_while_its_compile_waits_then_pauses_for_it(
        pausing, monkeypatch):
    """Note [When to compile]: a waiting key banks savings only while its runs are watched,
    so the runtime does not pause then; once the compile is in flight it pauses, and resumes
    when the kernel lands."""
    monkeypatch.setattr(scheduling, "predicted_saving_s", lambda entry: 0.1)   # per run
    train, expected = _unchanging_training_loop()
    table = engine.shared_table()
    with config.patch(MIN_SEGMENT_US=0, MIN_US_PER_OP=0, HOT_THRESHOLD=2, ASYNC=True,
                      COMPILE_TIMEOUT_S=120, COMPILE_COST_MS=800), ae.enabled():
        outs = train(6)          # hot at step 2, 0.6 s banked by step 6: still waiting
        assert table.compiles_waiting and not table.compiles_in_flight
        assert not ae.is_paused()
        with results_held(table):            # however fast the worker
            outs += train(4)     # due: the compiles start, one at a time, and it pauses
            assert table.compiles_in_flight and ae.is_paused()
        deadline = time.monotonic() + 120
        while (ae.is_paused() or table.compiles_waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
            outs += train(1)
        assert not ae.is_paused()
        outs += train(4)
    stats = ae.stats()
    assert stats.compiles >= 1 and stats.fused_executions >= 1
    for out in outs:
        assert_equal(out, expected)


def test_a_key_saving_less_than_watching_costs_banks_while_paused(pausing, monkeypatch,
                                                                  fake_clock):
    """Note [When to compile]: a waiting key whose runs save less than watching them costs
    pauses the runtime at once; at each later control point it banks what its runs would
    have saved at the rate it ran, and its compile starts when due."""
    monkeypatch.setattr(scheduling, "predicted_saving_s", lambda entry: 1e-6)   # per run
    train, expected = _unchanging_training_loop()
    table = engine.shared_table()

    def step_of(seconds):
        fake_clock.advance(seconds)
        return train(1)
    with config.patch(MIN_SEGMENT_US=0, MIN_US_PER_OP=0, HOT_THRESHOLD=2, ASYNC=True,
                      COMPILE_TIMEOUT_S=120, COMPILE_COST_MS=1), ae.enabled():
        outs = [out for _ in range(3) for out in step_of(0.1)]   # hot at step 2, seen again
        assert ae.is_paused() and table.compiles_waiting and not table.compiles_in_flight
        seen = ae.stats().ops_seen
        with results_held(table):
            outs += step_of(0.01)       # 10 runs/s x 1 us, banked over 0.01 s: not due
            assert not table.compiles_in_flight
            assert ae.stats().ops_seen == seen                   # unwatched
            outs += step_of(200.0)      # 200 s unwatched at ~10 runs/s: ~2 ms banked, due
            assert table.compiles_in_flight
            outs += step_of(0.1)        # (a resumed runtime watches POINTS_BEFORE_PAUSE first)
            assert ae.is_paused()
        deadline = time.monotonic() + 120
        while not ae.stats().compiles and time.monotonic() < deadline:
            time.sleep(0.05)
            outs += train(1)
        outs += [out for _ in range(8) for out in step_of(1.0)]
    assert ae.stats().compiles >= 1
    for out in outs:
        assert_equal(out, expected)


def test_a_training_loop_waits_paused_for_its_kernels_and_resumes_when_one_lands(pausing):
    train, expected = _unchanging_training_loop()
    with config.patch(MIN_SEGMENT_US=0, MIN_US_PER_OP=0, HOT_THRESHOLD=2, ASYNC=True,
                      COMPILE_TIMEOUT_S=120), ae.enabled():
        with results_held(engine.shared_table()):               # however fast the worker
            outs = train(8)               # keys turn hot at step 2, then only wait: pause
            assert ae.is_paused() and engine.shared_table().compiles_in_flight
            seen = ae.stats().ops_seen
            outs += train(2)
            assert ae.stats().ops_seen == seen                   # nothing intercepted
        deadline = time.monotonic() + 120
        while ae.is_paused() and time.monotonic() < deadline:   # the worker starts, compiles
            time.sleep(0.05)
            outs += train(1)                # a control point notices a kernel landed: resumes
        assert not ae.is_paused()
        outs += train(4)
    stats = ae.stats()
    assert stats.pauses >= 1 and stats.compiles >= 1 and stats.fused_executions >= 1
    for out in outs:
        assert_equal(out, expected)


def _wait_for_an_answer(table, timeout_s=120):
    """Until the compile worker has answered, uncollected: the step that follows collects it
    at its first control point, whatever the machine's speed."""
    deadline = time.monotonic() + timeout_s
    while table.compiles.worker._results.empty() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_kernel_that_ends_a_pause_runs_before_the_next_compile_pauses_again(pausing):
    """A pause ends at a control point, here the optimizer step, when a kernel lands; the
    next key then compiles, which would pause at once, before the step's forward ran the
    kernel that landed (no fused run for as long as compiles followed one another). The
    first kernel's result comes; later ones are held."""
    train, expected = _unchanging_training_loop()
    table = engine.shared_table()
    collect = table.compiles._collect

    def first_result_only(wait_s=0.0):
        if not ae.stats().compiles:
            collect(wait_s)
    with config.patch(MIN_SEGMENT_US=0, MIN_US_PER_OP=0, HOT_THRESHOLD=2, ASYNC=True,
                      COMPILE_TIMEOUT_S=120), ae.enabled():
        with results_held(table):
            outs = train(8)               # keys turn hot at step 2, then only wait: pause
            assert ae.is_paused() and table.compiles_in_flight
        table.compiles._collect = first_result_only
        try:
            _wait_for_an_answer(table)
            outs += train(1)              # resumes at the control point that collects it
            assert ae.stats().compiles == 1
            outs += train(1)              # the keys seen before the pause turn hot: one compiles
            assert table.compiles_in_flight
            outs += train(2)
            assert ae.stats().fused_executions >= 1
        finally:
            del table.compiles._collect
    for out in outs:
        assert_equal(out, expected)
