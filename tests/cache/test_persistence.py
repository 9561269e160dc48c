"""The runtime with its disk store: warm starts, concurrent processes, damage, eviction."""
import logging
import os
import subprocess
import sys
import textwrap

import torch

import adaptive_eager as ae
from adaptive_eager.cache.store import Store
from adaptive_eager.config import config
from adaptive_eager.runtime import engine
from adaptive_eager.runtime.compiler import use_compiler
from adaptive_eager.runtime.entries import KeyState
from adaptive_eager.testing import CountingCompiler
from helpers import MECHANICS_ENV, assert_equal, chain


def _run(x, times=6):
    with ae.enabled():
        outs = [chain(x) for _ in range(times)]
    for out in outs:
        assert_equal(out, chain(x))
    return ae.stats()


def _restart():
    """What a new process would see: nothing in memory, the same cache directory."""
    ae.reset()


def test_second_run_loads_instead_of_compiling(compiler):
    x = torch.randn(16)
    first = _run(x)
    assert first.compiles == 1 and first.cache_hits_disk == 0
    _restart()
    second = _run(x)
    assert second.compiles == 0 and second.cache_hits_disk == 1
    assert compiler.loads == 1
    assert second.fused_executions == 5        # fused from the second iteration on
    [record] = Store(config.CACHE_DIR).records()
    assert record.state == "ready" and record.seen >= 2 and record.fused_runs >= 9


def test_a_failed_key_stays_failed_across_runs():
    x = torch.randn(16)
    with use_compiler(CountingCompiler(fail_with=RuntimeError)):
        _run(x)
    _restart()
    with use_compiler(CountingCompiler()) as fresh:
        stats = _run(x)
    assert fresh.count == 0 and stats.compiles == 0 and stats.fused_executions == 0
    [entry] = engine.shared_table().entries()
    assert entry.state is KeyState.FAILED and "RuntimeError" in entry.reason


def test_a_truncated_artifact_is_compiled_again(compiler, caplog):
    x = torch.randn(16)
    _run(x)
    [record] = Store(config.CACHE_DIR).records()
    path = Store(config.CACHE_DIR).artifact_file(record.artifact)
    with open(path, "r+b") as handle:
        handle.truncate(10)
    _restart()
    with caplog.at_level(logging.WARNING, logger="adaptive_eager"):
        stats = _run(x)
    assert stats.compiles == 1 and stats.cache_hits_disk == 0 and compiler.loads == 0
    assert sum("damaged" in message for message in caplog.messages) == 1


def test_an_artifact_from_another_compiler_or_machine_is_not_loaded(compiler):
    x = torch.randn(16)
    _run(x)
    store = Store(config.CACHE_DIR)
    [record] = store.records()
    store.write([{"digest": record.digest, "ops": record.ops, "parts": record.parts,
                  "state": "ready", "torch_version": "1.0", "fingerprint": "elsewhere"}])
    _restart()
    stats = _run(x)
    assert stats.compiles == 1 and compiler.loads == 0


def test_a_garbled_database_is_reported_once_and_rebuilt(caplog):
    x = torch.randn(16)
    _run(x)
    _restart()
    db = os.path.join(config.CACHE_DIR, "segments.sqlite")
    with open(db, "wb") as handle:
        handle.write(b"not sqlite" * 1000)
    with caplog.at_level(logging.WARNING, logger="adaptive_eager"):
        stats = _run(x)
    assert stats.compiles == 1
    assert sum("set aside and rebuilt" in message for message in caplog.messages) == 1
    assert any(name.startswith("segments.sqlite.corrupt-") for name in os.listdir(config.CACHE_DIR))


def test_an_unusable_cache_directory_means_memory_only(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with config.patch(CACHE_DIR=str(blocker / "cache")), \
            caplog.at_level(logging.WARNING, logger="adaptive_eager"):
        _restart()
        stats = _run(torch.randn(16))
        ae.reset()
    assert stats.fused_executions >= 4
    assert sum("going on without persisting" in message for message in caplog.messages) == 1


def test_lru_evicts_and_reloads_from_disk(compiler):
    def other(x):
        return ((x - 1).exp() * 2).tanh()
    x = torch.randn(16)
    with config.patch(CACHE_SIZE=1):
        _restart()
        results = []
        with ae.enabled():
            for fn in (chain, other, chain):    # the second chain phase finds it evicted
                for _ in range(4):
                    out = fn(x)
                    out.sum().item()            # boundary: keys stay apart
                    results.append((fn, out))
            assert len(engine.shared_table().kernels) == 1
        stats = ae.stats()
        for fn, out in results:
            assert_equal(out, fn(x))
        assert len(engine.shared_table().kernels) == 0      # released by disable()
    assert stats.compiles == 2                  # each key compiled once...
    assert stats.cache_hits_disk == 1           # ...chain evicted by other, loaded back
    assert stats.fused_executions >= 6


WORKER = textwrap.dedent("""
    import sys, torch
    import adaptive_eager as ae
    from adaptive_eager.config import config
    from adaptive_eager.runtime.compiler import use_compiler
    from adaptive_eager.testing import CountingCompiler
    x = torch.full((64,), float(sys.argv[1]))
    with use_compiler(CountingCompiler()), ae.enabled():
        outs = [((x * 2 + 1).sin() * 3).cos() for _ in range(int(sys.argv[2]))]
        ae.sync()
    ok = all(torch.allclose(o, ((x * 2 + 1).sin() * 3).cos()) for o in outs)
    s = ae.stats()
    print("ok", ok, "compiles", s.compiles, "disk", s.cache_hits_disk, "fused", s.fused_executions)
""")


def _spawn(tmp_path, value, iterations, cache_dir):
    script = tmp_path / "worker.py"
    if not script.exists():     # rewriting it while another worker starts could run it empty
        script.write_text(WORKER)
    env = {**os.environ, **MECHANICS_ENV, "NEURON_ADAPTIVE_EAGER_CACHE_DIR": str(cache_dir),
           "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD": "2"}
    return subprocess.Popen([sys.executable, str(script), str(value), str(iterations)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_warm_start_across_two_processes(tmp_path):
    cache_dir = tmp_path / "shared"
    first = _spawn(tmp_path, 0.5, 6, cache_dir).communicate(timeout=300)
    second = _spawn(tmp_path, 0.5, 6, cache_dir).communicate(timeout=300)
    assert "ok True compiles 1 disk 0" in first[0], first
    assert "ok True compiles 0 disk 1 fused 5" in second[0], second


def test_four_processes_share_one_cache_directory(tmp_path):
    cache_dir = tmp_path / "shared"
    workers = [_spawn(tmp_path, 0.25, 40, cache_dir) for _ in range(4)]
    results = [worker.communicate(timeout=300) for worker in workers]
    for (out, err), worker in zip(results, workers):
        assert worker.returncode == 0, err
        assert "ok True" in out, (out, err)
        assert "Traceback" not in err and "not usable" not in err
    store = Store(str(cache_dir))
    [record] = store.records()
    assert record.state == "ready"
    fused = sum(int(out.split("fused ")[1]) for out, _ in results)
    assert record.fused_runs == fused            # every process's counts, none lost
    assert store.verify()["ok"]
