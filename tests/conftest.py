"""Shared fixtures: every test starts with an empty runtime and the counting stand-in compiler.

Tests marked ``inductor`` get the real compiler instead. Each test session compiles into its own
Inductor cache directory, so no run depends on what an earlier one left behind.
"""
from __future__ import annotations

import os
import shutil
import tempfile

# Before torch is imported anywhere: a private Inductor cache and no slow ISA probing.
_SESSION_DIR = tempfile.mkdtemp(prefix="adaptive-eager-tests-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_SESSION_DIR, "inductor")
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
os.environ["NEURON_ADAPTIVE_EAGER_CACHE_DIR"] = os.path.join(_SESSION_DIR, "cache")
for _name in list(os.environ):   # the developer's own settings must not change test results
    if _name.startswith("NEURON_ADAPTIVE_EAGER") and _name != "NEURON_ADAPTIVE_EAGER_CACHE_DIR":
        del os.environ[_name]

# Subprocesses run on the Python mode unless a test asks for another backend: with auto, each
# would start a C++ build into the session's cache directory and could switch backends mid-run.
os.environ["NEURON_ADAPTIVE_EAGER_BACKEND"] = "python"

import pytest  # noqa: E402
import torch  # noqa: E402

import adaptive_eager as ae  # noqa: E402
from adaptive_eager.config import config  # noqa: E402
from adaptive_eager.runtime.compiler import InductorCompiler, use_compiler  # noqa: E402
from adaptive_eager.testing import CountingCompiler  # noqa: E402
from adaptive_eager.runtime import clock  # noqa: E402
from helpers import MECHANICS, FakeClock, chain  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def warm_vectorized_math() -> None:
    """In about one fresh process in ten, torch 2.13's first ``((x * 2 + 1).sin() * 3).cos()``
    on the CPU computes up to 2.1e-4 away from every later call of it (plain torch, no
    runtime: 3-7 of 40 processes; none once another call came first). A test that ran first
    in its process compared its first output with eager computed later, and failed so. One
    call first, on other values."""
    chain(torch.randn(1 << 12))


@pytest.fixture(scope="session")
def default_backend() -> str:
    """What a user's program runs on here: cpp where the extension builds (as from a user's
    second run on; built once per user into EXT_DIR), python where it cannot be (no
    compiler)."""
    from adaptive_eager.dispatch import native
    ext = native.prepare(wait_s=native.BUILD_TIMEOUT_S)
    return "cpp" if ext is not None else "python"


@pytest.fixture(autouse=True)
def fresh_runtime(request, tmp_path, monkeypatch):
    """Empty key table, counters and cache directory; HOT_THRESHOLD=2; the counting compiler
    unless the test is marked inductor. Tiny test tensors would never pass the adaptive
    policy's cost gates, so tests of the mechanics switch them off (test_adaptive turns them
    back on), the extern-bound share included (helpers.MECHANICS)."""
    config.reload()
    ae.reset()
    compiler = InductorCompiler() if request.node.get_closest_marker("inductor") else \
        CountingCompiler()
    # What users run (never auto: a build landing mid-test would switch backends under it);
    # tests of the Python mode's own mechanisms are marked python_mode, and the `backend`
    # fixture runs a test on each.
    backend = "python" if request.node.get_closest_marker("python_mode") else \
        request.getfixturevalue("default_backend")
    with config.patch(HOT_THRESHOLD=2, CACHE_DIR=str(tmp_path / "ae-cache"), BACKEND=backend,
                      **MECHANICS), use_compiler(compiler):
        yield compiler
    leaked = ae.is_enabled()
    while ae.is_enabled():
        ae.disable()
    ae.reset()
    assert not leaked, "test left the runtime enabled"


@pytest.fixture
def compiler(fresh_runtime):
    return fresh_runtime


@pytest.fixture
def fake_clock(monkeypatch):
    """The runtime's policy reads a FakeClock (tests/helpers.py) instead of the machine's:
    timings are what the test states, not what a busy machine measures (Note [Clock])."""
    fake = FakeClock()
    monkeypatch.setattr(clock, "perf_counter", fake.perf_counter)
    monkeypatch.setattr(clock, "monotonic", fake.monotonic)
    call = torch._ops.OpOverload.__call__

    def timed_call(op, /, *args, **kwargs):
        out = call(op, *args, **kwargs)
        fake.ran(op, args)
        return out
    monkeypatch.setattr(torch._ops.OpOverload, "__call__", timed_call)
    return fake


@pytest.fixture(scope="session")
def cpp_extension():
    """The C++ interception extension, built once per user (10-30 s) into EXT_DIR (keyed by
    torch version and source hash, so a stale build never loads)."""
    from adaptive_eager.dispatch import native
    ext = native.prepare(wait_s=native.BUILD_TIMEOUT_S)
    if ext is None and not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("no C++ compiler: the cpp backend cannot be built here")
    assert ext is not None, native.failure()
    return ext


@pytest.fixture(params=["python", "cpp"])
def backend(request, fresh_runtime):
    """Run the test on each interception backend (modules opt in with
    ``pytestmark = pytest.mark.usefixtures("backend")``)."""
    if request.param == "cpp":
        request.getfixturevalue("cpp_extension")
    with config.patch(BACKEND=request.param):
        yield request.param
        stats = ae.stats()
        assert stats.backend in ("", request.param)   # it really ran on that backend
        if os.environ.get("AE_DEBUG_NATIVE"):
            with open(os.environ["AE_DEBUG_NATIVE"], "a") as log:
                log.write(f"{request.node.nodeid} {stats.native_fused_executions} "
                          f"{stats.fused_executions}\n")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
