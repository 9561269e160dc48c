"""Background compilation: the program goes on per-op while a worker process compiles; crashes
and hangs of the worker fail one segment, never the program."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.runtime import engine, scheduling, thread_lending
from adaptive_eager.runtime.entries import KeyState
from adaptive_eager.runtime.worker import CompileWorker
from adaptive_eager.testing import CountingCompiler, faults
from helpers import MECHANICS_ENV, assert_equal, chain, other, results_held


class HangingCompiler(CountingCompiler):
    def compile(self, graph, example_inputs):
        marker = os.environ.get("ADAPTIVE_EAGER_TEST_HANGING")
        if marker:
            open(marker, "w").close()        # tell the test the compile is under way
        time.sleep(600)


def _ran(fn, x):
    """``fn(x)``, its segment ended (observed) at once."""
    out = fn(x)
    ae.sync()
    return out


def _entry():
    [entry] = engine.shared_table().entries()
    return entry


@pytest.fixture
def background():
    with config.patch(ASYNC=True, COMPILE_TIMEOUT_S=120):
        yield


@pytest.fixture
def two_threads_on_two_cores(monkeypatch):
    """The program's threads cover every core it may use (torch's default)."""
    monkeypatch.setattr(thread_lending, "_usable_cores", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def requested_threads(monkeypatch) -> list:
    """The intra-op threads of each compile request sent to the worker."""
    requested = []
    submit = CompileWorker.submit
    monkeypatch.setattr(CompileWorker, "submit",
                        lambda worker, request: (requested.append(request.threads),
                                                 submit(worker, request)))
    return requested


def test_segments_run_per_op_until_the_worker_delivers(background, compiler,
                                                       two_threads_on_two_cores,
                                                       requested_threads):
    x = torch.randn(2 * scheduling.SERIAL_BELOW_NUMEL)     # a kernel for the program's threads
    with ae.enabled():
        early = [chain(x) for _ in range(4)]
        assert _entry().state is KeyState.COMPILING
        assert torch.get_num_threads() == 1              # Note [Lending a thread]
        stats = ae.stats()
        assert stats.fused_executions == 0 and stats.compiles_in_flight == 1
        ae.sync(wait_compiles=120)
        assert ae.stats().compiles_in_flight == 0
        assert _entry().state is KeyState.READY
        assert torch.get_num_threads() == 2              # given back
        late = [chain(x) for _ in range(4)]
    assert requested_threads == [2]                      # compiled for the program's own
    for out in early + late:
        assert_equal(out, chain(x))
    stats = ae.stats()
    assert stats.compiles == 1 and stats.fused_executions >= 3
    assert compiler.count == 0 and compiler.loads == 1        # compiled there, loaded here
    assert os.path.exists(os.path.join(config.CACHE_DIR, "worker.log"))   # its stderr


def test_a_kernel_whose_fused_ops_touch_small_tensors_is_compiled_serial(
        background, two_threads_on_two_cores, requested_threads):
    """Note [Serial kernels]: a decode step's matmul reads a large weight, but the kernel's
    own (fused) ops touch one row: it is compiled for one thread; the matmul runs its
    library's threads either way."""
    weight = torch.randn(256, 2 * scheduling.SERIAL_BELOW_NUMEL // 256)
    row = torch.randn(1, 256)

    def project(row):
        return (torch.mm(row, weight) * 2.0).relu() + 1.0

    with ae.enabled():
        outs = [_ran(project, row) for _ in range(4)]
        ae.sync(wait_compiles=120)
        segment = _entry().segment
    assert requested_threads == [1]
    assert scheduling.fused_numel(segment) == weight.shape[1]          # one row's, not W's
    for out in outs:
        assert_equal(out, project(row))


def test_a_generic_kernel_over_large_shapes_is_compiled_for_the_programs_threads(
        background, compiler, two_threads_on_two_cores, requested_threads):
    """Note [Serial kernels]: a generic kernel is sized by the shapes it is derived from."""
    xs = [torch.randn(scheduling.SERIAL_BELOW_NUMEL * k) for k in (2, 3, 4)]
    with ae.enabled():
        outs = [_ran(chain, x) for _ in range(3) for x in xs]
        ae.sync(wait_compiles=120)
        stats = ae.stats()
    assert stats.generic_kernels == 1 and stats.compiles == 1
    assert requested_threads == [2]
    for out, x in zip(outs, xs * 3):
        assert_equal(out, chain(x))


def test_a_hot_key_compiles_once_its_runs_banked_the_compile_cost(background, monkeypatch):
    """Note [When to compile]: no worker until then; counted in runs, not wall time."""
    monkeypatch.setattr(scheduling, "predicted_saving_s", lambda entry: 0.1)   # per run
    x = torch.randn(64)
    with config.patch(COMPILE_COST_MS=400), ae.enabled():
        early = [_ran(chain, x) for _ in range(3)]
        assert _entry().state is KeyState.WAITING and _entry().seen == 3
        assert engine.shared_table().worker is None
        assert ae.stats().compiles_waiting == 1
        early.append(_ran(chain, x))             # 4 runs x 0.1 s: 400 ms banked
        assert _entry().state is KeyState.COMPILING
        ae.sync(wait_compiles=120)
        late = [chain(x) for _ in range(3)]
    assert ae.stats().compiles == 1 and ae.stats().fused_executions >= 2
    for out in early + late:
        assert_equal(out, chain(x))


def test_a_waiting_key_whose_later_runs_are_too_cheap_never_compiles(background, monkeypatch):
    """Its first runs (a program's warm-up) made it look worth a kernel; by the time its
    compile would start (here: sync(wait_compiles=...) starts every waiting one) its least
    per-op run is under MIN_SEGMENT_US: no compile, unfusible as too_cheap."""
    x = torch.randn(64)
    with config.patch(COMPILE_COST_MS=10**6, MIN_SEGMENT_US=0), ae.enabled():
        [_ran(chain, x) for _ in range(2)]
        entry = _entry()
        assert entry.state is KeyState.WAITING
        entry.compute_seconds = entry.fusible_seconds = 20e-6     # as its later runs measure
        with config.patch(MIN_SEGMENT_US=100):
            ae.sync(wait_compiles=120)
        assert entry.state is KeyState.UNFUSIBLE and entry.reason == "too_cheap"
        out = chain(x)
    stats = ae.stats()
    assert stats.compiles == 0 and stats.fallbacks.get("too_cheap") == 1
    assert engine.shared_table().worker is None
    assert_equal(out, chain(x))


def test_the_key_that_banked_most_compiles_first_one_at_a_time(background, monkeypatch):
    savings = {5: 0.01, 6: 0.5}                  # by the ops of the segment: chain 5, bigger 6
    monkeypatch.setattr(scheduling, "predicted_saving_s",
                        lambda entry: savings[len(entry.segment.ops)])
    x = torch.randn(64)

    def bigger(t):
        return (((t - 1).exp() * 2).tanh() + 1).abs()
    with config.patch(COMPILE_COST_MS=1200), ae.enabled():
        outs = [_ran(chain, x) for _ in range(2)] + [_ran(bigger, x) for _ in range(2)]
        table = engine.shared_table()
        assert table.compiles_in_flight == 0 and table.compiles_waiting == 2
        with results_held(table):                # however fast the worker
            outs.append(_ran(bigger, x))         # banks 1.5 s: due, and starts
            outs += [_ran(chain, x) for _ in range(120)]   # 1.22 s: due, but one is in flight
            states = {len(e.segment.ops): e.state for e in table.entries()}
            assert states == {6: KeyState.COMPILING, 5: KeyState.WAITING}
        ae.sync(wait_compiles=120)
        outs += [chain(x), bigger(x)]
    assert ae.stats().compiles == 2
    assert_equal(outs[-2], chain(x))
    assert_equal(outs[-1], bigger(x))


def test_sync_waiting_for_compiles_starts_the_waiting_ones_at_once(background):
    x = torch.randn(64)
    with config.patch(COMPILE_COST_MS=600_000), ae.enabled():
        early = [chain(x) for _ in range(4)]    # kept: the same live outputs as later runs
        assert _entry().state is KeyState.WAITING
        ae.sync(wait_compiles=120)
        assert _entry().state is KeyState.READY
        late = [chain(x) for _ in range(4)]
    assert ae.stats().fused_executions >= 2
    for out in early + late:
        assert_equal(out, chain(x))


def test_synchronous_compiles_never_wait(compiler):
    x = torch.randn(64)
    with config.patch(ASYNC=False, COMPILE_COST_MS=600_000), ae.enabled():
        for _ in range(3):
            result = chain(x)
        assert _entry().state is KeyState.READY
    assert compiler.count == 1
    assert_equal(result, chain(x))


def test_the_compile_cost_defaults_by_machine_size(monkeypatch):
    for cores, cost in ((2, 2000), (4, 2000), (8, 0), (None, 2000)):
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        config.reload()
        assert config.COMPILE_COST_MS == cost, cores


def test_a_worker_crash_fails_that_segment_and_the_worker_restarts(background):
    x = torch.randn(64)
    with ae.enabled():
        with faults.inject("worker_crash"):
            outs = [chain(x) for _ in range(4)]
            ae.sync(wait_compiles=120)
        assert _entry().state is KeyState.FAILED
        assert _entry().reason.startswith("worker_crashed")
        assert ae.stats().compile_failures == 1
        for _ in range(4):
            other(x)
        ae.sync(wait_compiles=120)
        result = other(x)
        assert engine.shared_table().worker.restarts == 1
    assert ae.stats().compiles == 1 and ae.stats().fallbacks["worker_crashed"] == 1
    for out in outs:
        assert_equal(out, chain(x))
    assert_equal(result, other(x))


def test_a_hanging_compile_times_out_and_the_worker_is_killed(background):
    x = torch.randn(64)
    with faults.inject("worker_hang"), config.patch(COMPILE_TIMEOUT_S=3), ae.enabled():
        outs = [chain(x) for _ in range(4)]
        process = engine.shared_table().worker._process
        ae.sync(wait_compiles=60)
        outs.append(chain(x))
    assert _entry().state is KeyState.FAILED and _entry().reason.startswith("compile_timeout")
    assert ae.stats().fallbacks["compile_timeout"] == 1
    assert process.poll() is not None                          # killed
    for out in outs:
        assert_equal(out, chain(x))


def test_the_worker_stops_when_the_last_runtime_is_disabled(background):
    x = torch.randn(64)
    with ae.enabled():
        for _ in range(4):
            result = chain(x)
        ae.sync(wait_compiles=120)
        process = engine.shared_table().worker._process
        assert process.poll() is None
    assert process.wait(timeout=10) is not None                # an idle worker's memory back
    assert engine.shared_table().worker is None
    with ae.enabled():                                         # the kernel stayed: no compile
        for _ in range(3):
            result = chain(x)
    assert ae.stats().compiles == 1 and ae.stats().fused_executions >= 1
    assert_equal(result, chain(x))


EXITING = textwrap.dedent("""
    import os, sys, time, torch
    sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]
    import adaptive_eager as ae
    from adaptive_eager.runtime import engine, scheduling, thread_lending
    from adaptive_eager.runtime.compiler import use_compiler
    from test_background import HangingCompiler
    x = torch.randn(64)
    with use_compiler(HangingCompiler()), ae.enabled():
        for _ in range(4):
            ((x * 2 + 1).sin() * 3).cos()
        deadline = time.monotonic() + 120       # the worker starts and takes the compile
        while not os.path.exists(os.environ["ADAPTIVE_EAGER_TEST_HANGING"]):
            assert time.monotonic() < deadline, "the worker never started compiling"
            time.sleep(0.01)
        print(engine.shared_table().worker._process.pid, flush=True)
""")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_program_exits_promptly_and_leaves_no_worker_behind(tmp_path):
    env = {**os.environ, **MECHANICS_ENV, "NEURON_ADAPTIVE_EAGER_ASYNC": "1",
           "NEURON_ADAPTIVE_EAGER_CACHE_DIR": str(tmp_path / "cache"),
           "ADAPTIVE_EAGER_TEST_HANGING": str(tmp_path / "hanging")}
    program = subprocess.Popen([sys.executable, "-c", EXITING, os.path.dirname(__file__)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        line = program.stdout.readline()         # once its worker hangs in a compile
        exiting = time.monotonic()
        _, stderr = program.communicate(timeout=120)
    finally:
        program.kill()
    assert program.returncode == 0, stderr
    worker_pid = int(line)
    assert time.monotonic() - exiting < 60                    # not the compile's 600 s
    deadline = time.monotonic() + 30
    while not _gone(worker_pid):                               # killed; its zombie reaped
        assert time.monotonic() < deadline, "the worker outlived the program"
        time.sleep(0.05)
