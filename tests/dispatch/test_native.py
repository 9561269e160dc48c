"""The C++ interception backend (csrc/intercept.cpp, dispatch/native.py, dispatch/interceptor.py).

The extension is built once per machine by the `cpp_extension` fixture (10-30 s, cached in the
default cache directory); parity of ops on this backend runs in tests/runtime (the `backend`
fixture). Fallbacks to the Python mode run in subprocesses: a process can register the
fallback only once.
"""
import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import _default_cache_dir, config
from adaptive_eager.dispatch import native
from adaptive_eager.runtime.compiler import use_compiler
from adaptive_eager.testing import CountingCompiler
from helpers import MECHANICS_ENV, assert_equal

pytestmark = pytest.mark.usefixtures("cpp_extension")


def test_ops_go_through_the_cpp_backend_and_equal_eager():
    x = torch.randn(32, requires_grad=True)
    expected = ((x * 2).sin() * x).sum()
    expected.backward()
    expected_grad, x.grad = x.grad.clone(), None
    with config.patch(BACKEND="cpp", COMPILE=False), ae.enabled():
        got = ((x * 2).sin() * x).sum()
        got.backward()
        stats = ae.stats()
    assert stats.backend == "cpp"
    assert stats.ops_seen >= 8                           # forward and backward ops
    assert_equal(got, expected, bitwise=True)
    assert_equal(x.grad, expected_grad, bitwise=True)


def test_errors_of_an_op_reach_the_program():
    with config.patch(BACKEND="cpp"), ae.enabled():
        with pytest.raises(RuntimeError, match="size"):
            torch.ones(3) + torch.ones(4)
        assert_equal(torch.ones(3) + 1, torch.full((3,), 2.0))   # still intercepting


def test_python_backend_when_asked():
    with config.patch(BACKEND="python"), ae.enabled():
        torch.ones(3) + 1
        assert ae.stats().backend == "python"


def _loop_until(done, timeout_s: float = 30.0) -> int:
    """Run a bare loop of tensor ops until ``done()`` (the waker runs on another thread: its
    wake comes within WAKE_EVERY_S; the deadline only bounds a broken one); iterations."""
    x, deadline, steps = torch.randn(8), time.monotonic() + timeout_s, 0
    while not done() and time.monotonic() < deadline:
        (x * 2).sin().sum()
        steps += 1
    return steps


def test_a_bare_loop_pauses_with_the_key_out_and_the_waker_resumes_it(monkeypatch):
    """Note [Waking a paused thread] (csrc/intercept.cpp): a loop that passes no control
    point pauses as plain eager (the key out of its dispatch set), and the waker ends the
    pause once it is over."""
    from adaptive_eager.runtime import clock, pausing
    monkeypatch.setattr(pausing, "PAUSE_FIRST_S", 3600.0)
    ext = native.loaded()
    # a new shape every step, each ended by a host sync: keys that never come back, which
    # Python's engine records every time (C++ runs only keys seen twice: Note [Cold plans]
    # in csrc/plans.cpp), what pausing is for
    xs = [torch.randn(8 + i) for i in range(60)]
    with config.patch(BACKEND="cpp", PAUSE=True, PAUSE_WINDOW=20, MIN_SEGMENT_US=1000,
                      HOT_THRESHOLD=5, KEEP_UNPROFITABLE=False), ae.enabled():
        outs = [(x * 2).sin().sum().item() for x in xs]
        assert ae.is_paused() and ae.stats().pauses == 1    # paused with no control point
        assert not ext.is_included()                       # as plain eager
        seen = ae.stats().ops_seen
        _loop_until(lambda: False, timeout_s=0.3)          # woken ~6 times: the pause goes on
        assert ae.is_paused() and ae.stats().ops_seen == seen and not ext.is_included()
        later = time.monotonic() + 7200                    # the pause is over
        monkeypatch.setattr(clock, "monotonic", lambda: later)
        _loop_until(lambda: not ae.is_paused())
        assert not ae.is_paused() and ext.is_included()
        _loop_until(lambda: ae.stats().ops_seen > seen)
        assert ae.stats().ops_seen > seen                  # intercepting again
    for x, out in zip(xs, outs):
        assert out == (x * 2).sin().sum().item()


def test_an_outer_enable_asleep_is_still_woken_after_an_inner_one_slept_and_ended(
        monkeypatch):
    """One wake a thread: an inner enable() that paused asleep and ended hands the wake back
    to the outer one, still asleep (else its pause would only end at a control point)."""
    from adaptive_eager.runtime import clock, pausing
    monkeypatch.setattr(pausing, "PAUSE_FIRST_S", 3600.0)

    def churn():                       # new shapes ended by host syncs: a pause soon
        for i in range(60):
            (torch.randn(8 + i) * 2).sin().sum().item()
            if ae.is_paused():
                return
    with config.patch(BACKEND="cpp", PAUSE=True, PAUSE_WINDOW=20, MIN_SEGMENT_US=1000,
                      HOT_THRESHOLD=5, KEEP_UNPROFITABLE=False), ae.enabled():
        churn()
        assert ae.is_paused()
        with ae.enabled():
            churn()
            inner_paused = ae.is_paused()
        assert inner_paused and ae.is_paused()
        later = time.monotonic() + 7200                    # the outer pause is over
        monkeypatch.setattr(clock, "monotonic", lambda: later)
        _loop_until(lambda: not ae.is_paused())
        assert not ae.is_paused()


class GatedCompiler(CountingCompiler):
    """Compiles (in the worker) once the file ADAPTIVE_EAGER_TEST_GATE names exists."""

    def compile(self, graph, example_inputs):
        gate, deadline = os.environ["ADAPTIVE_EAGER_TEST_GATE"], time.monotonic() + 120
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return super().compile(graph, example_inputs)


def test_a_bare_loop_pauses_while_its_kernel_compiles_and_fuses_once_it_lands(tmp_path,
                                                                             monkeypatch):
    """Note [No pause without a way back] (runtime/pausing.py): on the C++ backend a bare
    loop whose key compiles in the background pauses as plain eager meanwhile (the waker
    brings it back), instead of being watched until the kernel lands."""
    gate = tmp_path / "compile-now"
    monkeypatch.setenv("ADAPTIVE_EAGER_TEST_GATE", str(gate))    # (the worker inherits it)
    x = torch.randn(1 << 12)
    chain = lambda x: ((x * 2 + 1).sin() * 3).cos().sum().item()   # noqa: E731
    outs = []
    with use_compiler(GatedCompiler()), \
            config.patch(BACKEND="cpp", ASYNC=True, COMPILE_TIMEOUT_S=120, PAUSE=True,
                         KEEP_UNPROFITABLE=True), ae.enabled():
        ext = native.loaded()
        for _ in range(1000):           # C++ runs the key's cold plan, counted at its harvests
            outs.append(chain(x))
            if ae.is_paused():
                break
        compiling = ae.stats().compiles_in_flight
        assert ae.is_paused() and not ext.is_included() and compiling
        gate.touch()                                       # the compile may finish now
        deadline = time.monotonic() + 120
        while ae.stats().fused_executions == 0 and time.monotonic() < deadline:
            outs.append(chain(x))                          # woken, the kernel landed: on
        assert ae.stats().fused_executions > 0 and ae.stats().compiles == 1
    for out in outs:
        assert out == chain(x)


def test_a_pause_under_the_programs_own_profiler_keeps_the_key_in(monkeypatch):
    """The waker would replace a profiler the thread runs (cProfile): there the pause keeps
    the key in, and the fallback asks every RESUME_EVERY ops whether it is over."""
    from adaptive_eager.dispatch.interceptor import RESUME_EVERY
    from adaptive_eager.runtime import pausing
    monkeypatch.setattr(pausing, "PAUSE_FIRST_S", 0.0)     # over at once: noticed by ops
    ext = native.loaded()
    calls = []
    xs = [torch.randn(8 + i) for i in range(60)]
    sys.setprofile(lambda *args: calls.append(1))
    try:
        with config.patch(BACKEND="cpp", PAUSE=True, PAUSE_WINDOW=20, MIN_SEGMENT_US=1000,
                          HOT_THRESHOLD=5, KEEP_UNPROFITABLE=False), ae.enabled():
            outs = [(x * 2).sin().sum().item() for x in xs]
            paused_with_key = ae.is_paused() and ext.is_included()
            seen = ae.stats().ops_seen
            x = xs[0]
            for _ in range(RESUME_EVERY + 8):
                (x * 2).sin().sum()
            resumed = ae.stats().ops_seen > seen
            profiler = sys.getprofile()
    finally:
        sys.setprofile(None)
    assert paused_with_key and resumed and calls
    assert profiler is not None and profiler.__name__ == "<lambda>"     # still the program's
    for x, out in zip(xs, outs):
        assert out == (x * 2).sin().sum().item()


def test_a_training_loops_pause_takes_the_key_out_of_the_dispatch_set(monkeypatch):
    """A program that comes back to control points ends its pause at one: its paused ops
    need not reach the fallback at all (CppInterceptor.deactivate), also when it enables
    the runtime around each step; the key comes back with the pause's end."""
    from adaptive_eager.runtime import clock, pausing
    monkeypatch.setattr(pausing, "PAUSE_FIRST_S", 3600.0)
    ext = native.loaded()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)       # lr 0: the same values each step
    xs = [torch.randn(1 + i % 40, 8) for i in range(80)]    # new shapes: nothing to fuse

    def step(x):
        opt.zero_grad()
        out = model(x)
        out.sum().backward()
        opt.step()
        return out.detach()
    expected = [step(x) for x in xs]
    with config.patch(BACKEND="cpp", PAUSE=True, PAUSE_WINDOW=20, MIN_SEGMENT_US=1000,
                      KEEP_UNPROFITABLE=False):
        with ae.enabled():
            outs = [step(x) for x in xs[:60]]
            assert ae.is_paused() and not ext.is_included()
            seen = ae.stats().ops_seen
            outs.append(step(xs[60]))
            assert ae.stats().ops_seen == seen                 # nothing intercepted
        for x in xs[61:]:
            with ae.enabled():                                  # around each step
                assert ae.is_paused() and not ext.is_included()
                outs.append(step(x))
        later = time.monotonic() + 7200                         # the pause is over
        monkeypatch.setattr(clock, "monotonic", lambda: later)
        with ae.enabled():
            ae.sync()                                          # a control point: resumes
            assert not ae.is_paused() and ext.is_included()
    for out, reference in zip(outs, expected):
        assert_equal(out, reference, bitwise=True)


def test_boundaries_run_in_cpp_when_nothing_is_open(compiler, monkeypatch):
    """Note [Boundaries passed when idle] (csrc/intercept.cpp): once Python has seen an op
    that ends every segment (.item()), a thread with nothing open runs it in C++, counted as
    Python counts it; one with deferred work ends it first (the value read is the one it
    computed)."""
    from adaptive_eager.dispatch.interceptor import CppInterceptor
    seen_by_python = []
    on_op = CppInterceptor.on_op
    monkeypatch.setattr(CppInterceptor, "on_op", lambda self, func, args, kwargs: (
        seen_by_python.append(func), on_op(self, func, args, kwargs))[1])
    x = torch.randn(64)
    with config.patch(BACKEND="cpp"), ae.enabled():
        values = [((x * 2).sin() * 3).sum().item() for _ in range(12)]
        assert ae.stats().native_fused_executions > 0
        scalar = torch.tensor(3.5)          # (its lift_fresh opens a segment in Python)
        assert scalar.item() == 3.5         # a segment open: Python's engine ends it
        syncs = ae.stats().fallbacks["host_sync"]
        seen_by_python.clear()
        assert [scalar.item() for _ in range(5)] == [3.5] * 5
        assert not seen_by_python
        assert ae.stats().fallbacks["host_sync"] == syncs + 5
    assert values == [((x * 2).sin() * 3).sum().item()] * 12


def test_dynamo_does_not_recompile_because_of_the_key():
    from torch._dynamo.utils import counters as dynamo_counters

    @torch.compile(backend="eager")
    def user_compiled(x):
        return (x * 2 + 1).sin()

    x = torch.randn(64)
    expected = (x * 2 + 1).sin()
    dynamo_counters.clear()
    user_compiled(x)                                     # compiled with the runtime off
    with config.patch(BACKEND="cpp"), ae.enabled():
        got = [user_compiled(x) for _ in range(3)]
        assert ae.stats().ops_seen == 0                  # compiled code ran untouched
        (x * 3).cos()                                    # and the key is back after it
        assert ae.stats().ops_seen == 2
    for out in got:
        assert_equal(out, expected)
    user_compiled(x)
    assert dynamo_counters["stats"]["unique_graphs"] == 1
    assert not dynamo_counters["recompiles"]


def test_compiled_code_reads_deferred_outputs_filled():
    @torch.compile(backend="eager")
    def user_compiled(y):
        return y * 2

    x = torch.randn(64)
    expected = ((x * 1.5 + 0.25).sin() - 0.5) * 2
    user_compiled(x)
    with config.patch(BACKEND="cpp"), ae.enabled():
        got = []
        for _ in range(4):
            y = (x * 1.5 + 0.25).sin() - 0.5             # fused from its second run on
            got.append(user_compiled(y))                 # reads y without a dispatched op
        assert ae.stats().fused_executions >= 1
    for out in got:
        assert_equal(out, expected)


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; ``env`` values of None unset a variable."""
    full_env = {**os.environ, **MECHANICS_ENV, **env}
    full_env = {name: value for name, value in full_env.items() if value is not None}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=300)


def test_a_taken_key_falls_back_to_python_with_one_log_line():
    result = _run("""
        import torch
        lib = torch.library.Library("_", "IMPL")
        lib.fallback(lambda *a: None, "Fake", with_keyset=True)   # someone else took it
        import adaptive_eager as ae
        ae.enable()
        print("backend", ae.stats().backend, (torch.ones(2) + 1).sum().item())
        ae.disable()
    """, {"NEURON_ADAPTIVE_EAGER_BACKEND": "cpp",
})
    assert result.returncode == 0, result.stderr
    assert "backend python 4.0" in result.stdout
    lines = [line for line in result.stderr.splitlines() if "C++ interception" in line]
    assert len(lines) == 1 and "taken" in lines[0], result.stderr


def test_a_failed_build_falls_back_to_python_with_one_log_line(tmp_path):
    broken = tmp_path / "intercept.cpp"
    broken.write_text("#error a compiler error on purpose\n")
    result = _run(f"""
        import torch
        from adaptive_eager.dispatch import native
        native.SOURCES = ({str(broken)!r},)
        import adaptive_eager as ae
        ae.enable()                                    # starts the build, runs on python
        print("first", ae.stats().backend)
        native._building.join(120)
        torch.ones(2) + 1
        ae.sync()                                      # a control point: would switch
        print("then", ae.stats().backend, native.failure() is not None)
        ae.disable()
    """, {"NEURON_ADAPTIVE_EAGER_BACKEND": "cpp", "NEURON_ADAPTIVE_EAGER_CACHE_DIR": str(tmp_path),
          "NEURON_ADAPTIVE_EAGER_EXT_DIR": str(tmp_path / "ext")})
    assert result.returncode == 0, result.stderr
    assert "first python" in result.stdout and "then python True" in result.stdout
    lines = [line for line in result.stderr.splitlines() if "C++ interception" in line]
    assert len(lines) == 1, result.stderr


def test_the_build_directory_is_keyed_by_torch_version_and_source():
    directory = native.build_directory()
    assert torch.__version__ in os.path.basename(directory)
    assert os.path.dirname(directory) == config.EXT_DIR


def test_the_extension_is_built_once_per_user_whatever_the_cache_directory(tmp_path):
    with config.patch(CACHE_DIR=str(tmp_path)):
        assert os.path.dirname(native.build_directory()) == os.path.join(
            _default_cache_dir(), "ext")


def test_auto_on_a_fresh_machine_starts_on_python_and_switches_to_cpp(tmp_path):
    """No extension built yet (an empty EXT_DIR): the program starts at once on the
    Python mode while the extension builds in the background, switches to cpp at a control
    point once it lands, and trains as eager does throughout."""
    result = _run("""
        import torch
        import torch.nn.functional as F
        import adaptive_eager as ae
        from adaptive_eager.dispatch import native

        def train(model, opt, data, target, steps):
            losses = []
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                loss = F.mse_loss(model(data), target)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            return losses

        def make_model():                  # made alike (a deepcopy starts at version 0)
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                       torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))

        model, eager_model = make_model(), make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-2, foreach=True)
        data, target = torch.randn(8, 16), torch.randn(8, 4)
        expected = train(eager_model, eager_opt, data, target, 12)
        ae.enable()
        losses = train(model, opt, data, target, 4)
        print("first", ae.stats().backend)
        native._building.join(600)
        losses += train(model, opt, data, target, 8)
        print("then", ae.stats().backend, ae.stats().fused_executions > 0)
        ae.disable()
        torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
            assert p._version == q._version
        print("equal")
    """, {"NEURON_ADAPTIVE_EAGER_BACKEND": None,         # the default: auto
          "NEURON_ADAPTIVE_EAGER_CACHE_DIR": str(tmp_path / "cache"),
          "NEURON_ADAPTIVE_EAGER_EXT_DIR": str(tmp_path / "ext"),
          "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD": "2"})
    assert result.returncode == 0, result.stderr
    assert "first python" in result.stdout, result.stdout
    assert "then cpp True" in result.stdout and "equal" in result.stdout, result.stdout
    assert os.listdir(tmp_path / "ext")                 # built into EXT_DIR


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_sparse_outputs_and_no_state_left_for_the_next_runtime(backend):
    """A sparse output has no storage to watch (Note [Shallow copies]), and what a cpp runtime
    needs stays with it: a Python-mode runtime after it ran ops as before (opinfo's
    to_sparse raised NotImplementedError once a cpp runtime had existed)."""
    x = torch.randn(5, 5)
    with config.patch(BACKEND="cpp", COMPILE=False), ae.enabled():
        (x * 2).sin()
    with config.patch(BACKEND=backend, COMPILE=False), ae.enabled():
        got = (x * 2).to_sparse().to_dense() + 1
        assert ae.stats().backend == backend
    assert_equal(got, x * 2 + 1, bitwise=True)


def test_modules_and_tensor_subclasses_build_under_the_cpp_backend():
    """torch turns dispatch modes off around the detach in Tensor._make_subclass (every
    nn.Parameter) and as_subclass, whose result must have no Python object yet; the C++
    interception must stay off there too (building any module raised before)."""
    result = _run("""
        import torch
        from torch import nn
        import adaptive_eager as ae
        class Marked(torch.Tensor):
            pass
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        marked = (torch.ones(3) * 2).as_subclass(Marked)
        print(ae.stats().backend, type(model[0].weight).__name__, type(marked).__name__,
              marked.sum().item(), model(torch.ones(2, 4)).shape[0])
    """, {"NEURON_ADAPTIVE_EAGER": "1", "NEURON_ADAPTIVE_EAGER_BACKEND": "cpp",
})
    assert result.returncode == 0, result.stderr
    assert "cpp Parameter Marked 6.0 2" in result.stdout, result.stdout


def test_the_default_extension_directory_and_the_cache_above_it_are_private(tmp_path):
    """Made by the umask (group-writable under 002), the default cache directory above the
    default EXT_DIR would then be refused as a cache (Note [Trusted cache])."""
    result = _run("""
        import os
        os.umask(0o002)
        from adaptive_eager.dispatch import native
        native._make_private_dirs(native.build_directory())
    """, {"XDG_CACHE_HOME": str(tmp_path), "NEURON_ADAPTIVE_EAGER_EXT_DIR": None,
          "NEURON_ADAPTIVE_EAGER_CACHE_DIR": None})
    assert result.returncode == 0, result.stderr
    for directory in (tmp_path / "adaptive_eager", tmp_path / "adaptive_eager" / "ext"):
        assert directory.stat().st_mode & 0o777 == 0o700, oct(directory.stat().st_mode)


def test_a_training_loop_watches_on_while_its_keys_wait_and_finds_its_optimizer_step(
        compiler, fake_clock, monkeypatch):
    """Note [When to compile] (runtime/scheduling.py): on the C++ backend, watching a waiting
    key costs ~10 us an op, not Python's ~50, so a key saving 20 us an op
    keeps the runtime watching, and the optimizer step, whose key turns hot only steps later
    (its scalars lift first: Note [Lifted scalars]), is found. (Paused at once, as the Python
    mode is, it never was.)"""
    from adaptive_eager.runtime import engine, scheduling
    monkeypatch.setattr(scheduling, "predicted_saving_s",
                        lambda entry: len(entry.segment.ops) * 20e-6)     # per run
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(32, 8)

    def train(steps):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        for _ in range(steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    expected = train(12)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial[name])
    with config.patch(BACKEND="cpp", PAUSE=True, PAUSE_WINDOW=20, MIN_SEGMENT_US=0,
                      MIN_US_PER_OP=0, KEEP_UNPROFITABLE=False, ASYNC=True,
                      COMPILE_COST_MS=10**9), \
            ae.enabled():
        got = train(12)
        assert not ae.is_paused() and ae.stats().pauses == 0
        waiting = [entry for entry in engine.shared_table().entries()
                   if entry.state.name == "WAITING"]
        optimizer_keys = [entry for entry in waiting if any(
            "_foreach_" in str(op.func) for op in entry.segment.ops)]
    assert optimizer_keys, [entry.segment for entry in waiting]
    for out, reference in zip(got, expected):
        assert_equal(out, reference, bitwise=True)


def _train_paused_by_the_step_judge(train, model, steps, on_step, fused_while_paused):
    """``train(model, steps, on_step)`` on the C++ backend with pausing on; ``on_step``
    makes paused steps that keep the kernels look fastest to the step judge and notes, while
    so paused, the fused runs so far in ``fused_while_paused``: each such step fused at least
    once."""
    from unittest import mock

    from adaptive_eager.runtime import engine, paused_kernels
    # On the fake clock no kernel is measured saving anything: kernels that cost nothing to
    # keep are kept (Note [Kernels that do not pay while paused] is tested on its own).
    free = mock.patch.multiple(paused_kernels, PASS_THROUGH_S_PER_OP=0.0, DIVERGENCE_S=0.0)
    with free, config.patch(BACKEND="cpp", PAUSE=True), ae.enabled():
        losses = train(model, steps, on_step)
        [runtime] = engine.live_runtimes()
        assert runtime.judge.verdicts >= 1
    assert len(fused_while_paused) > 20
    assert fused_while_paused[-1] - fused_while_paused[0] >= len(fused_while_paused) - 1
    return losses


@contextlib.contextmanager
def _paused_with_a_kernel(x):
    """``ae.enabled()`` on the C++ backend, with the kernel of ``((x * 2 + 1).sin() * 3).cos()``
    and paused as pausing would pause it (kernels kept)."""
    from adaptive_eager import thread_state
    ext = native.loaded()
    with config.patch(BACKEND="cpp"), ae.enabled():
        for _ in range(4):
            ((x * 2 + 1).sin() * 3).cos()
        ae.sync()
        assert ae.stats().fused_executions >= 1 and ext.has_kernels()
        enabled = thread_state.top()
        thread_state._pause(enabled, enabled.runtime.paused_for())
        assert ext.is_paused() and ext.is_included()              # kernels kept: the key in
        yield


def test_a_paused_threads_common_ops_pass_unboxed_but_a_kernels_first_op_is_deferred(compiler):
    """Note [Unboxed pass-through] (csrc/unboxed.cpp): on a thread paused with its kernels,
    an op with a kernel of ours on the key passes straight through without being boxed; one
    without (atan) reaches the boxed fallback; and one whose operator starts a kernel's path
    (mul, the chain's first op) goes on to the fallback, which defers it: the chain still runs
    fused. Results equal eager's."""
    ext = native.loaded()
    assert ext.unboxed_ops() >= 100
    x, y = torch.randn(64), torch.randn(64)
    chain = lambda t: ((t * 2 + 1).sin() * 3).cos()        # noqa: E731
    with _paused_with_a_kernel(x):
        passes, fused = ext.unboxed_passes(), ae.stats().fused_executions
        covered = [torch.sub(x, y).exp() for _ in range(10)]       # sub.Tensor, exp
        assert ext.unboxed_passes() - passes == 20
        uncovered = [x.atan() for _ in range(10)]
        assert ext.unboxed_passes() - passes == 20
        chained = [chain(x) for _ in range(10)]
        ae.sync()
        assert ae.stats().fused_executions - fused == 10
    for got in covered:
        assert_equal(got, torch.sub(x, y).exp())
    for got in uncovered:
        assert_equal(got, x.atan())
    for got in chained:
        assert_equal(got, chain(x))


def test_cold_plan_runs_charge_their_interception_to_the_kernels_beside_them():
    """Note [Pausing] (runtime/pausing.py): on the C++ backend the per-op segments beside a
    kernel run on cold plans, which Python does not time; each of their ops is charged
    COLD_PLAN_S_PER_OP of interception, which the kernel's saving must pay. Beside a 40-op
    cold segment (40 us a run), a kernel saving 10 us a run lets the runtime pause; one
    saving 1 ms keeps it on."""
    from types import SimpleNamespace

    from adaptive_eager.runtime import engine
    from adaptive_eager.runtime.entries import KeyState
    from adaptive_eager.runtime.pausing import COLD_PLAN_S_PER_OP
    assert COLD_PLAN_S_PER_OP * 40 > 10e-6
    cold = SimpleNamespace(segment=SimpleNamespace(ops=[None] * 40), state=KeyState.UNFUSIBLE,
                           churning=False, hopeless=True, promising=lambda backend: False)
    outcomes = {}

    def loop(saving_s):          # (pausing state is the thread's: a thread of its own each)
        kernel = SimpleNamespace(entry=SimpleNamespace(saving_s=saving_s))
        with ae.enabled():
            [runtime] = engine.live_runtimes()
            for _ in range(8):
                runtime.ran_cold(cold, 1)
                runtime.ran_native_kernel(kernel)
            outcomes[saving_s] = runtime.pause_requested
    with config.patch(BACKEND="cpp", PAUSE=True, PAUSE_WINDOW=20):
        for saving_s in (10e-6, 1e-3):
            thread = threading.Thread(target=loop, args=(saving_s,))
            thread.start()
            thread.join()
    assert outcomes == {10e-6: True, 1e-3: False}


def test_a_pause_drops_kernels_whose_paths_only_part(compiler):
    """Note [Kernels that do not pay while paused] (runtime/paused_kernels.py): a paused loop
    whose ops start a kernel's path and part from it (its first calls are the kernel's) only
    pays for keeping the kernel: the key in, each run deferred and replayed. After a ledger's
    worth of ops the pause goes on without the kernel, the key out, as plain eager."""
    from adaptive_eager.runtime import paused_kernels
    ext = native.loaded()
    x = torch.randn(64)
    parting = lambda t: ((t * 2 + 1).tanh() * 3).exp()     # noqa: E731  (parts at tanh)
    with _paused_with_a_kernel(x):
        divergences = ae.stats().divergences
        runs = paused_kernels.LEDGER_OPS // 5 + 50                # 5 ops a run
        got = [parting(x) for _ in range(runs)]
        stats = ae.stats()
        assert stats.divergences - divergences >= 50              # the path started, parted
        assert stats.pauses_without_kernels == 1
        assert ae.is_paused() and not ext.is_included()           # plain eager now
        before = ae.stats().divergences
        more = [parting(x) for _ in range(20)]
        assert ae.stats().divergences == before
    for result in got + more:
        assert_equal(result, parting(x))


def test_kernels_dropped_in_the_middle_of_a_deferred_run_end_it_first(compiler,
                                                                        monkeypatch):
    """The verdict comes at an op (every RESUME_EVERY paused ops): a run deferred along the
    kernel's path up to it ends before the op runs plainly, which reads its results."""
    from adaptive_eager.dispatch import interceptor as interceptors
    from adaptive_eager.runtime import paused_kernels
    ext = native.loaded()
    x = torch.randn(64)
    with _paused_with_a_kernel(x):
        monkeypatch.setattr(paused_kernels, "LEDGER_OPS", 1)
        monkeypatch.setattr(paused_kernels, "PASS_THROUGH_S_PER_OP", 1.0)   # never pays
        y = x * 2
        assert ext.run_pending()                  # deferred: the kernel's path started
        excluded = ext.set_excluded(True)         # as the extension calls it at an op:
        try:                                      # what Python runs then is not seen
            interceptors._should_resume()
        finally:
            ext.set_excluded(excluded)
        assert not ext.run_pending() and not ext.is_included()
        got = (y + 1).tanh()
        assert ae.stats().pauses_without_kernels == 1
    assert_equal(got, (x * 2 + 1).tanh())


def _mlp_batch() -> tuple:
    """The same batch at every call."""
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1)), torch.zeros(16, 8)


def _small_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _train_small_mlp(model, steps, on_step=lambda step: None) -> list:
    """AdamW (foreach) steps on _mlp_batch(); ``on_step(step)`` runs between ``backward()``
    and the optimizer step. Returns the losses."""
    x, y = _mlp_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        on_step(step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def test_a_paused_training_loop_still_runs_its_kernels(compiler, fake_clock):
    """Note [Kernels while paused] (csrc/hot_path.cpp): once the step judge pauses a training
    loop (its paused steps are stated faster), the loop's kernels still run, from C++, with
    the key in the thread's dispatch set; ``ae.paused()`` inside the pause is plain eager, and
    the pause goes on after it. Results are eager's, bitwise (the stand-in compiler)."""
    ext = native.loaded()
    train, model, (x, y) = _train_small_mlp, _small_mlp, _mlp_batch()
    expected_model = model()
    expected = train(expected_model, 200)
    fused_while_paused, plain_in_block = [], []

    def on_step(step):
        kept = ae.is_paused() and ext.is_included()      # (else intercepting, or plain)
        fake_clock.advance(0.08 if kept else 0.1)
        if not kept:
            return
        assert ext.is_paused()
        fused_while_paused.append(ae.stats().fused_executions)
        if step % 10 == 0:
            with ae.paused():
                assert not ext.is_included()           # plain eager: the key is out
                before = ae.stats().fused_executions   # (a pending run ended on entry)
                torch.nn.functional.mse_loss(got_model(x), y)   # a segment the kernels had
                plain_in_block.append(ae.stats().fused_executions - before)
            assert ae.is_paused() and ext.is_included()   # the pause goes on after the block
    got_model = model()
    losses = _train_paused_by_the_step_judge(train, got_model, 200, on_step, fused_while_paused)
    assert plain_in_block and set(plain_in_block) == {0}
    for got, want in zip(losses, expected):
        assert_equal(got, want, bitwise=True)
    for got, want in zip(got_model.parameters(), expected_model.parameters()):
        assert_equal(got, want, bitwise=True)


def test_a_training_loop_faster_plain_than_with_its_kernels_pauses_plainly(compiler,
                                                                           fake_clock):
    """Note [Judged by the step]: where a pause would keep kernels, the step judge also
    times paused steps without them, the key out. Here steps are stated 100 ms intercepting,
    95 ms paused keeping the kernels, 80 ms plain: the runtime pauses plainly, runs no kernel
    while paused, and stays plain after ``ae.paused()`` blocks inside the pause. Results are
    eager's, bitwise (the stand-in compiler)."""
    from unittest import mock

    from adaptive_eager.runtime import engine, paused_kernels
    from adaptive_eager.runtime.step_judge import State
    ext = native.loaded()
    (x, y), model = _mlp_batch(), _small_mlp
    expected_model = model()
    expected = _train_small_mlp(expected_model, 200)
    plain_steps, kept_steps = [], []

    def on_step(step):
        if not ae.is_paused():
            fake_clock.advance(0.1)
        elif ext.is_included():                        # paused keeping the kernels
            fake_clock.advance(0.095)
            kept_steps.append(step)
        else:
            fake_clock.advance(0.08)
            [runtime] = engine.live_runtimes()
            if runtime.judge.verdicts and not runtime.judge.probing:   # the verdict's pause
                plain_steps.append(ae.stats().fused_executions)
            if step % 10 == 0:
                with ae.paused():
                    torch.nn.functional.mse_loss(got_model(x), y)
                assert ae.is_paused() and not ext.is_included()   # still plain after it
    got_model = model()
    # Kernels that cost nothing to keep would be kept by their ledger: only the judge drops.
    free = mock.patch.multiple(paused_kernels, PASS_THROUGH_S_PER_OP=0.0, DIVERGENCE_S=0.0)
    with free, config.patch(BACKEND="cpp", PAUSE=True), ae.enabled():
        losses = _train_small_mlp(got_model, 200, on_step)
        [runtime] = engine.live_runtimes()
        judge = runtime.judge
        assert ae.stats().pauses_without_kernels >= 1
    assert judge.verdicts >= 1 and kept_steps, judge     # its kernels were timed paused too
    assert set(judge.last_totals) == {State.INTERCEPTING, State.KERNELS, State.PLAIN}
    assert len(plain_steps) > 20                         # the verdict's pause was plain
    assert plain_steps[-1] == plain_steps[0]             # and no kernel ran in it
    for got, want in zip(losses, expected):
        assert_equal(got, want, bitwise=True)
    for got, want in zip(got_model.parameters(), expected_model.parameters()):
        assert_equal(got, want, bitwise=True)


def test_a_paused_gpt2_training_loop_runs_its_kernels_and_equals_eager(compiler, fake_clock):
    """Note [Kernels while paused] on a real model: GPT-2's training step (attention, layer
    norms, AdamW) paused by the step judge goes on fusing from C++, and where a run parts
    from a kernel's path it is replayed there; losses and parameters are eager's."""
    transformers = pytest.importorskip("transformers")
    ext = native.loaded()

    def model():
        torch.manual_seed(0)
        config_ = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                          n_positions=32, attn_pdrop=0.0, embd_pdrop=0.0,
                                          resid_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config_).train()
    ids = torch.randint(2, 100, (2, 12), generator=torch.Generator().manual_seed(1))

    def train(net, steps, on_step=lambda: None):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=True)
        losses = []
        for _ in range(steps):
            loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            on_step()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return losses
    expected_model = model()
    expected = train(expected_model, 120)
    fused_while_paused = []

    def on_step():
        kept = ae.is_paused() and ext.is_included()      # (else intercepting, or plain)
        fake_clock.advance(0.08 if kept else 0.1)
        if kept:
            fused_while_paused.append(ae.stats().fused_executions)
    got_model = model()
    losses = _train_paused_by_the_step_judge(train, got_model, 120, on_step, fused_while_paused)
    assert_equal(losses, expected)
    for got, want in zip(got_model.parameters(), expected_model.parameters()):
        assert_equal(got, want)


def test_ae_paused_takes_the_key_out_of_the_threads_dispatch_set(compiler):
    """``ae.paused()`` is plain eager: its ops do not even pass the extension's fallback
    (~0.2-1 us an op); the key is back after the block."""
    ext = native.loaded()
    x = torch.randn(64)
    with config.patch(BACKEND="cpp"), ae.enabled():
        (x * 2).sum().item()
        assert ext.is_included()
        with ae.paused():
            assert not ext.is_included()
            seen = ae.stats().ops_seen
            (x * 2).sum().item()
            assert ae.stats().ops_seen == seen
        assert ext.is_included()
    assert not ext.is_included()


def test_recording_leaves_no_storage_object_behind():
    """Note [Storages without Python objects]: a storage's Python object lives as long as the
    storage and holds a reference, which stops autograd adding a gradient into it in place.
    Python's recording on the cpp backend watches every output's storage without one."""
    x = torch.randn(8, 8)
    with config.patch(BACKEND="cpp", COMPILE=False), ae.enabled():
        y = (x * 2).sin()
        ae.sync()
        assert ae.stats().segments_recorded >= 1
    address = native.loaded().storage_address(y)
    assert torch._C._storage_Use_Count(address) == 1          # y's TensorImpl alone
    y.untyped_storage()                      # what the recording used to do: a Python object
    assert torch._C._storage_Use_Count(address) == 2
