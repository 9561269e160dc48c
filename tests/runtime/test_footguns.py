"""Record/replay surprises, most dangerous first. Each case first proves the output really was
deferred (a fused run happened or work was pending), then checks eager's answer."""
import io
import os
import pickle
import subprocess
import sys
import sysconfig
import textwrap

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.runtime import engine
from helpers import assert_equal, chain


def _pending() -> bool:
    return any(runtime.has_deferred() for runtime in engine.live_runtimes())


def _warm(fn, *args, times=4):
    for _ in range(times):
        fn(*args)
    ae.sync()
    assert ae.stats().compiles >= 1


@pytest.mark.parametrize("read", [
    lambda t: t.numpy().copy(),
    lambda t: t.tolist(),
    lambda t: t.__array__().copy(),
    lambda t: bytes(t.untyped_storage()),
    lambda t: pickle.loads(pickle.dumps(t)),
    lambda t: torch.load(_saved(t)),
    lambda t: torch.from_dlpack(t).clone(),
], ids=["numpy", "tolist", "__array__", "storage", "pickle", "torch.save", "dlpack"])
def test_reads_that_bypass_the_dispatcher_see_computed_values(read):
    x = torch.randn(32)
    expected = read(chain(x))
    with ae.enabled():
        _warm(chain, x)
        y = chain(x)
        assert _pending(), "the output should be deferred here"
        got = read(y)
    if isinstance(expected, torch.Tensor):
        assert_equal(got, expected)
    elif isinstance(expected, bytes):
        assert got == expected
    else:
        assert_equal(torch.as_tensor(got), torch.as_tensor(expected))


def test_a_parameter_made_on_a_deferred_outputs_memory_gets_its_values():
    """Note [Storage aliases]: no op tells the mode of the parameter, and the output itself
    is dropped; its kernel wrote elsewhere and the parameter kept unfilled memory."""
    x = torch.randn(32)
    expected = chain(x)
    with ae.enabled():
        _warm(chain, x)
        y = chain(x)
        assert _pending(), "the output should be deferred here"
        kept = torch.nn.Parameter(y)
        del y
        ae.sync()
    assert_equal(kept.detach(), expected)


def test_a_model_deep_copied_under_the_runtime_trains_like_eager():
    """``copy.deepcopy`` makes each parameter with ``Parameter(p.data.clone())``: with the
    clones fused, the copy's weights were unfilled memory (NaN after one SGD step)."""
    import copy

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
    x = torch.randn(4, 8)
    expected = train(copy.deepcopy(base))
    with ae.enabled():
        got = train(copy.deepcopy(base))
        ae.sync()
        assert ae.stats().fused_executions >= 1
    for g, e in zip(got, expected):
        assert_equal(g, e)


def test_an_out_argument_the_op_resizes_runs_eagerly():
    """Note [Resized outputs]: deferred, ``out`` came back unresized, and the replay that
    followed could not write the result into it (the program raised)."""
    a, b = torch.randn(8, 16), torch.randn(16, 4)

    def step():
        product = torch.empty(0)
        torch.mm(a, b, out=product)
        shifted = torch.empty(0)
        torch.add(product, 1, out=shifted)
        return product.shape, (shifted * 2).sin()
    expected = step()
    with ae.enabled():
        got = [step() for _ in range(6)]
        ae.sync()
        stats = ae.stats()
    assert stats.fused_executions >= 1 and stats.fallbacks["metadata_mutation"] >= 12
    for shape, value in got:
        assert shape == expected[0]
        assert_equal(value, expected[1])


def test_an_out_argument_of_the_right_shape_is_fused():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    product = torch.empty(8, 4)

    def step():
        torch.mm(a, b, out=product)
        return (product + 1).sin()
    expected = step()
    with ae.enabled():
        got = [step() for _ in range(6)]
        ae.sync()
        assert ae.stats().fused_executions >= 3
    for value in got:
        assert_equal(value, expected)


def _saved(t):
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("access", [
    lambda t: t.data_ptr(),
    # CuPy and Numba read CUDA tensors through this property; on CPU it raises, after the flush
    lambda t: hasattr(t, "__cuda_array_interface__"),
], ids=["data_ptr", "__cuda_array_interface__"])
def test_raw_memory_access_flushes_first(access):
    x = torch.randn(16)
    with ae.enabled():
        _warm(chain, x)
        y = chain(x)
        assert _pending()
        access(y)
        assert not _pending()
        assert_equal(y, chain(x))


def _ema_steps(p, ema, steps=12):
    """An exponential moving average kept with ``.data =`` (Note [.data assignment])."""
    sums = []
    for _ in range(steps):
        p.mul_(1.01).add_(0.001)
        ema.data = ema.data * 0.9 + p * 0.1
        sums.append(ema.sum())
    return sums


def test_data_assignment_in_a_fused_loop_gives_eager_results():
    def fresh():
        torch.manual_seed(0)
        return torch.randn(4096), torch.zeros(4096)
    expected = _ema_steps(*fresh())
    with ae.enabled():
        got = _ema_steps(*fresh())
        ae.sync()
        assert ae.stats().fused_executions >= 5      # the loop really ran fused
    for g, e in zip(got, expected):
        assert_equal(g, e)


def test_data_assignment_mid_segment_splits_it():
    # ``y`` reads p before the swap and ``z`` after it; a deferred run must not read p's new
    # memory for y. Shapes differ too, so one key would hold two shapes for p.
    def step(p, other):
        y = p * 2 + 1
        p.data = other * 3
        z = (p + 1).sin()
        return y, z

    def inputs():
        torch.manual_seed(0)
        return torch.randn(8), torch.randn(16)
    expected = step(*inputs())
    with ae.enabled():
        for _ in range(4):
            got = step(*inputs())
        ae.sync()
        assert ae.stats().fused_executions >= 2
    assert_equal(got[0], expected[0])
    assert_equal(got[1], expected[1])
    assert "data" not in torch.Tensor.__dict__       # the setter is ours only while enabled


def _refill_and_run(make_input, steps=12):
    """A numpy buffer refilled every step, read through a tensor that shares it, outputs kept
    and not read until the end (Note [Outside memory])."""
    import numpy as np
    buffer = np.zeros(4096, dtype=np.float32)
    x = make_input(buffer)
    outs = []
    for step in range(steps):
        buffer[:] = step
        outs.append(chain(x))
    return outs


@pytest.mark.parametrize("make_input", [     # looked up when called, as programs do
    lambda array: torch.from_numpy(array),
    lambda array: torch.as_tensor(array),
    lambda array: torch.frombuffer(array, dtype=torch.float32),
], ids=["from_numpy", "as_tensor", "frombuffer"])
def test_memory_shared_with_numpy_is_read_when_eager_reads_it(make_input):
    expected = _refill_and_run(make_input)
    with ae.enabled():
        got = _refill_and_run(make_input)
        ae.sync()
        stats = ae.stats()
    assert stats.fallbacks["outside_memory"] >= 10   # the op reading x runs per-op
    assert stats.fused_executions >= 5                 # what follows it still fuses
    for g, e in zip(got, expected):
        assert_equal(g, e)


def test_a_numpy_array_copied_into_a_tensor_is_torch_memory():
    import numpy as np
    with ae.enabled():
        x = torch.as_tensor(np.zeros(64, dtype=np.float64), dtype=torch.float32)  # a copy
        _warm(chain, x)
        assert "outside_memory" not in ae.stats().fallbacks


def test_module_conversion_that_swaps_tensors_works_mid_segment():
    # With swap-on-conversion (PyTorch's future default) model.double() swaps each parameter
    # with torch.utils.swap_tensors, which refuses tensors a segment holds: it raised here.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():                        # no graph holding the weights
        expected = model.double()(x.double())
    model.float()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with ae.enabled():
            (model(x) * 2).sin()                 # the weights are inputs of an open segment
            model.double()
            got = model(x.double())
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert model.weight.dtype == torch.float64
    assert_equal(got, expected)


def test_in_place_update_of_an_input_is_visible_with_eager_versions():
    def step(x, acc):
        acc.add_(x * 2)
        acc.mul_(0.5)
        return acc
    x = torch.randn(8)
    eager_acc, acc = torch.zeros(8), torch.zeros(8)
    for _ in range(6):
        step(x, eager_acc)
    with ae.enabled():
        for _ in range(6):
            step(x, acc)
        fused = ae.stats().fused_executions
    assert fused >= 2
    assert_equal(acc, eager_acc)
    assert acc._version == eager_acc._version


def test_overlapping_inputs_of_an_in_place_segment_run_per_op():
    def step(a, b):
        a.mul_(2)                           # writes memory that b also sees
        return (b + 1).sin()
    base = torch.arange(16.0)
    independent = [(torch.arange(8.0), torch.arange(8.0)) for _ in range(4)]
    overlapping = (base[0:8], base[4:12])                   # same key: shapes, aligned views
    with ae.enabled():
        kept = [step(a, b) for a, b in independent]         # compiles, then runs fused
        fused = ae.stats().fused_executions
        got = step(*overlapping)
        ae.sync()
    assert len(kept) == 4                                   # alive until here: same live set
    expected_base = torch.arange(16.0)
    expected = step(expected_base[0:8], expected_base[4:12])
    assert fused >= 1 and ae.stats().fallbacks["aliased_inputs"] == 1
    assert_equal(got, expected)
    assert_equal(base, expected_base)


def test_inputs_that_share_memory_but_are_only_read_run_fused(backend):
    """Views of one tensor read beside an in-place write elsewhere (the query, key and value
    of one projection, a gradient accumulated in place) are no hazard: only memory the
    kernel writes must be no other input's."""
    def step(acc, a, b):
        acc.add_((a * b).sin())
        return acc
    base = torch.arange(16.0)
    independent = [(torch.arange(8.0), torch.arange(8.0)) for _ in range(8)]
    overlapping = [(base[0:8], base[4:12])] * 3               # same key: shapes, aligned views
    acc, eager_acc = torch.zeros(8), torch.zeros(8)
    with ae.enabled():
        for a, b in independent:
            step(acc, a, b)
        ae.sync()
        fused = ae.stats().fused_executions
        for a, b in overlapping:
            step(acc, a, b)
        ae.sync()
        stats = ae.stats()
    for a, b in independent + overlapping:
        step(eager_acc, a, b)
    assert fused >= 1 and stats.fused_executions == fused + 3, stats
    assert "aliased_inputs" not in stats.fallbacks, stats
    assert_equal(acc, eager_acc)


def test_outputs_kept_alive_in_a_list():
    def step(x):
        a = x + 1
        b = a * 2
        c = b.exp()
        return c - 1
    x = torch.randn(8)
    kept, eager_kept = [], []
    for _ in range(5):
        eager_kept.append(step(x))
    with ae.enabled():
        for _ in range(5):
            kept.append(step(x))
    assert ae.stats().fused_executions >= 2
    assert_equal(kept, eager_kept)


def test_intermediates_kept_alive_are_written_too():
    keep = []

    def step(x):
        a = x + 1
        keep.append(a)                      # an intermediate the user holds on to
        return (a * 2).exp()
    x = torch.randn(8)
    with ae.enabled():
        outs = [step(x) for _ in range(5)]
    assert ae.stats().fused_executions >= 2
    for a, out in zip(keep, outs):
        assert_equal(a, x + 1)
        assert_equal(out, ((x + 1) * 2).exp())


def test_divergence_mid_segment_replays_per_op():
    def first(x):
        return ((x + 1) * 2).sin().cos()

    def second(x):                         # same two first ops, then different
        return ((x + 1) * 2).tanh().exp()
    x = torch.randn(8)
    with ae.enabled():
        _warm(first, x)
        got = second(x)
        ae.sync()
    assert ae.stats().divergences >= 1
    assert_equal(got, second(x))


def test_view_of_a_deferred_output_and_of_a_dropped_base():
    def step(x):
        y = (x * 2 + 1).exp()
        return y.t()[0]                     # the user keeps only a view of y
    x = torch.randn(4, 6)
    expected = step(x)
    with ae.enabled():
        outs = [step(x) for _ in range(5)]
    assert ae.stats().fused_executions >= 2
    for out in outs:
        assert_equal(out, expected)
        assert out._base is not None


def test_item_inside_a_segment_is_a_boundary():
    def step(x):
        y = (x * 2).sin()
        scale = y.sum().item()             # host sync in the middle
        return (y * scale).cos()
    x = torch.randn(8)
    with ae.enabled():
        outs = [step(x) for _ in range(5)]
    assert ae.stats().fallbacks["host_sync"] >= 5
    for out in outs:
        assert_equal(out, step(x))


def test_dropout_keeps_the_generator_stream():
    def step(x):
        return torch.nn.functional.dropout((x * 2).sin(), p=0.5, training=True).cos()
    x = torch.randn(64)
    torch.manual_seed(1)
    expected = [step(x) for _ in range(5)]
    state = torch.get_rng_state()
    torch.manual_seed(1)
    with ae.enabled():
        got = [step(x) for _ in range(5)]
    assert ae.stats().fallbacks["random"] >= 5
    assert_equal(got, expected)
    assert torch.equal(torch.get_rng_state(), state)


def _autograd_nodes(tensor) -> list:
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack += [parent for parent, _ in node.next_functions]
    return sorted(type(node).__name__ for node in seen)


def test_a_segment_ending_where_autograd_saves_an_output_stays_out_of_the_graph(backend):
    """Note [Ops above autograd] (dispatch/mode.py): exp saves its output for backward, and
    the detach autograd makes of it reaches the runtime above autograd; the segment [mul, exp]
    ends there (MAX_SEGMENT_OPS=2) and its kernel must not be recorded into the graph."""
    x = torch.randn(64, requires_grad=True)

    def step():
        return ((x * 2).exp() * 3).sum()
    expected_nodes = _autograd_nodes(step())
    for _ in range(4):
        step().backward()
    expected_grad, x.grad = x.grad, None
    with config.patch(MAX_SEGMENT_OPS=2), ae.enabled():
        for _ in range(4):
            out = step()
            assert _autograd_nodes(out) == expected_nodes
            out.backward()
    assert ae.stats().fused_executions >= 2, ae.stats()
    assert_equal(x.grad, expected_grad, bitwise=True)


def test_outputs_are_plain_tensors_with_eager_autograd_metadata():
    w = torch.nn.Parameter(torch.randn(8))

    def step(x):
        return ((x * w).sin() + 1).sum()
    x = torch.randn(8)
    with ae.enabled():
        for _ in range(5):
            w.grad = None
            out = step(x)
            out.backward()
    assert ae.stats().fused_executions >= 2
    assert type(out) is torch.Tensor and out.requires_grad and out.grad_fn is not None
    assert type(w) is torch.nn.Parameter and type(w.grad) is torch.Tensor
    w.grad = None
    step(x).backward()
    expected = w.grad.clone()
    assert_equal(out, step(x))
    assert_equal(expected, torch.cos(x * w) * x)


def test_disable_flushes_deferred_work():
    x = torch.randn(8)
    ae.enable()
    _warm(chain, x)
    y = chain(x)
    assert _pending()
    ae.disable()
    assert not _pending()
    assert_equal(y, chain(x))


def _startup_hook_installed() -> bool:
    return os.path.exists(os.path.join(sysconfig.get_paths()["purelib"],
                                       "adaptive_eager_startup.pth"))


SCRIPT = textwrap.dedent("""
    import sys
    assert "torch" not in sys.modules
    import torch
    import adaptive_eager as ae
    x = torch.randn(16)
    outs = [((x * 2 + 1).sin() * 3).cos() for _ in range(6)]
    ok = all(torch.allclose(o, ((x * 2 + 1).sin() * 3).cos()) for o in outs)
    s = ae.stats()
    print("enabled", ae.is_enabled(), "ok", ok, "ops", s.ops_seen, "keys", s.keys_seen)
""")


def test_env_var_runs_an_unchanged_script_under_the_runtime(tmp_path):
    if not _startup_hook_installed():
        if os.environ.get("CI"):
            pytest.fail("adaptive_eager_startup.pth is not installed: `pip install .` should")
        pytest.skip("package not installed (run `pip install .`): the startup hook is absent")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "NEURON_ADAPTIVE_EAGER": "1", "NEURON_ADAPTIVE_EAGER_COMPILE": "0"}
    on = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                        timeout=300)
    assert on.returncode == 0, on.stderr
    assert "enabled True ok True" in on.stdout and "keys 1" in on.stdout, on.stdout
    env["NEURON_ADAPTIVE_EAGER"] = "0"
    off = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert off.returncode == 0, off.stderr
    assert "enabled False ok True ops 0" in off.stdout, off.stdout


def test_bad_env_value_is_one_clear_error(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    env = {**os.environ, "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD": "lots"}
    result = subprocess.run([sys.executable, "-m", "adaptive_eager", "run", str(script)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD='lots'" in result.stderr
    assert "Traceback" not in result.stderr and "ran" not in result.stdout


def test_a_bad_setting_under_the_startup_hook_is_one_line_and_the_program_runs(tmp_path):
    # What adaptive_eager_startup.pth does, without needing the package installed.
    script = tmp_path / "train.py"
    script.write_text("import adaptive_eager._bootstrap as hook\nhook.arm()\n" + SCRIPT)
    env = {**os.environ, "NEURON_ADAPTIVE_EAGER": "1",
           "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD": "lots", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "enabled False ok True" in result.stdout, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD='lots'" in lines[0], lines
