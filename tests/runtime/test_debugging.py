"""Debugging aids: verify mode, the decision log, the exit report, profiler ranges, bisecting."""
import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.cache import api as cache_api
from adaptive_eager.cli import main
from adaptive_eager.config import config
from adaptive_eager.runtime import decisions, engine
from adaptive_eager.runtime.compiler import use_compiler
from adaptive_eager.runtime.entries import KeyState
from adaptive_eager.runtime.verify import VerificationError
from adaptive_eager.testing import CountingCompiler
from helpers import MECHANICS_ENV, assert_equal, chain, other


class OffByALittle(CountingCompiler):
    """A compiler whose kernels write slightly wrong outputs: what verify mode must catch."""

    def compile(self, graph, example_inputs):
        module = super().compile(graph, example_inputs)

        def kernel(*tensors):
            module(*tensors)
            tensors[-1].add_(0.01)                 # the last argument is an output buffer
        return kernel


@pytest.fixture(autouse=True)
def fresh_decisions():
    decisions.reset()
    yield
    decisions.reset()


def test_verify_catches_a_wrong_kernel_demotes_it_and_keeps_eager_values(caplog):
    x = torch.randn(32)
    with use_compiler(OffByALittle()), config.patch(VERIFY="on"), \
            caplog.at_level(logging.WARNING, logger="adaptive_eager"), ae.enabled():
        outs = [chain(x) for _ in range(6)]
    for out in outs:
        assert_equal(out, chain(x))                # the per-op result was kept
    [entry] = engine.shared_table().entries()
    assert entry.state is KeyState.FAILED and entry.reason.startswith("verify_mismatch")
    [line] = [m for m in caplog.messages if m.startswith("decision=verify_mismatch")]
    assert re.match(r"decision=verify_mismatch key=[0-9a-f]{16} max_error=0\.01 "
                    r"ops=aten\.mul\.Tensor_aten\.add\.Tensor", line), line
    assert ae.stats().fallbacks["verify_mismatch"] == 1


def test_verify_strict_raises():
    x = torch.randn(32)
    with use_compiler(OffByALittle()), config.patch(VERIFY="strict"), ae.enabled():
        with pytest.raises(VerificationError, match="differs from per-op execution"):
            for _ in range(6):
                chain(x)
        got = chain(x)                            # the runtime goes on, per-op
    assert_equal(got, chain(x))
    assert engine.shared_table().entries()[0].state is KeyState.FAILED


def test_verify_passes_a_correct_kernel(compiler):
    x = torch.randn(32)
    acc = torch.zeros(32)
    with config.patch(VERIFY="on"), ae.enabled():
        for _ in range(6):
            acc.add_(chain(x))                    # an in-place update of an input, too
    assert ae.stats().fused_executions >= 3 and "verify_mismatch" not in ae.stats().fallbacks
    assert_equal(acc, chain(x) * 6)


DECISION_LINE = re.compile(r"^decision=(?P<decision>[a-z_]+)( [a-z_]+=\S+)+$")


def test_decision_log_has_one_fixed_format_line_per_decision(caplog, monkeypatch):
    monkeypatch.setattr(decisions, "REPEAT_INTERVAL_S", 3600.0)   # however long the loop takes
    x = torch.randn(32)
    with caplog.at_level(logging.DEBUG, logger="adaptive_eager"), ae.enabled():
        for _ in range(5):
            chain(x).sum().item()
            x.sum().item()                        # a lone op: unfusible
    lines = [m for m in caplog.messages if m.startswith("decision=")]
    assert lines and all(DECISION_LINE.match(line) for line in lines), lines
    kinds = [DECISION_LINE.match(line)["decision"] for line in lines]
    assert kinds.count("hot") == 2 and kinds.count("compiled") == 1   # chain; lone sum
    assert kinds.count("unfusible") == 1
    compiled = next(line for line in lines if line.startswith("decision=compiled"))
    assert re.match(r"decision=compiled key=[0-9a-f]{16} ops=6 seconds=\S+ compiler=counting$",
                    compiled)
    assert kinds.count("fallback") == 1           # 10 host syncs, repeats rate-limited


def test_the_readme_lists_every_decision():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    listed = re.search(r"`decision=<([a-z_|\s]+)>", readme)[1]
    assert set(re.split(r"[|\s]+", listed.strip())) == set(decisions.DECISIONS)


def test_repeats_are_counted_when_the_next_line_comes(caplog, monkeypatch):
    monkeypatch.setattr(decisions, "REPEAT_INTERVAL_S", 0.0)
    with caplog.at_level(logging.DEBUG, logger="adaptive_eager"):
        decisions.decide("fallback", reason="host_sync", op="x")
        monkeypatch.setattr(decisions, "REPEAT_INTERVAL_S", 3600.0)
        decisions.decide("fallback", reason="host_sync", op="x")
        decisions.decide("fallback", reason="host_sync", op="x")
        monkeypatch.setattr(decisions, "REPEAT_INTERVAL_S", 0.0)
        decisions.decide("fallback", reason="host_sync", op="x")
    assert caplog.messages == ["decision=fallback reason=host_sync op=x",
                               "decision=fallback reason=host_sync op=x repeats_suppressed=2"]


def test_fused_runs_show_in_the_profiler():
    x = torch.randn(32)
    with ae.enabled():
        for _ in range(4):
            chain(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            chain(x)
            ae.sync()
    names = {event.name for event in prof.events() if event.name.startswith("adaptive_eager")}
    assert len(names) == 1, names
    assert re.fullmatch(r"adaptive_eager\.fused\[[0-9a-f]{16}\] ops=5", names.pop())


def test_disable_keys_setting_bisects_without_clearing(compiler):
    x = torch.randn(32)

    def run():
        with ae.enabled():
            for _ in range(4):
                a = chain(x)
                a.sum().item()
                b = other(x)
                b.sum().item()
            ready = {e.segment.ops[0].func.__name__: e.digest
                     for e in engine.shared_table().entries() if e.state is KeyState.READY}
        return a, b, ready
    digests = run()[2]
    ae.reset()
    with config.patch(DISABLE_KEYS=(digests["mul.Tensor"][:6],)):
        a, b, ready = run()
    states = {e.digest: e.state for e in engine.shared_table().entries()}
    assert states[digests["mul.Tensor"]] is KeyState.DISABLED
    assert digests["sub.Tensor"] in ready.values()
    assert ae.stats().fallbacks["disabled_key"] == 1
    assert_equal(a, chain(x))
    assert_equal(b, other(x))


def test_cache_disable_and_enable_commands(compiler, capsys):
    x = torch.randn(32)
    with ae.enabled():
        for _ in range(4):
            chain(x)
    ae.reset()
    [record] = cache_api.open_store(config.CACHE_DIR).records()
    assert main(["cache", "disable", record.digest[:8], "--dir", config.CACHE_DIR]) == 0
    assert "fusion disabled" in capsys.readouterr().out
    with ae.enabled():
        for _ in range(4):
            chain(x)
    assert ae.stats().fused_executions == 0
    assert "disabled" in cache_api.explain(cache_api.open_store(config.CACHE_DIR), record.digest)
    ae.reset()
    assert main(["cache", "enable", record.digest[:8], "--dir", config.CACHE_DIR]) == 0
    with ae.enabled():
        for _ in range(4):
            chain(x)
    assert ae.stats().fused_executions >= 3 and ae.stats().cache_hits_disk == 1


def test_compile_off_still_shows_what_would_be_fused(compiler, capsys):
    x = torch.randn(32)
    with config.patch(COMPILE=False), ae.enabled():
        for _ in range(4):
            chain(x)
    ae.reset()
    assert main(["cache", "ls", "--state", "hot", "--dir", config.CACHE_DIR, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    sentence = cache_api.explain(cache_api.open_store(config.CACHE_DIR), row["digest"])
    assert "would be fused but compilation is off" in sentence and compiler.count == 0


REPORT_SCRIPT = textwrap.dedent("""
    import torch
    import adaptive_eager as ae
    from adaptive_eager.runtime.compiler import use_compiler
    from adaptive_eager.testing import CountingCompiler
    x = torch.randn(64)
    with use_compiler(CountingCompiler()), ae.enabled():
        for _ in range(6):
            ((x * 2 + 1).sin() * 3).cos().sum().item()
""")


@pytest.mark.parametrize("target", ["1", "report.json"])
def test_exit_report(tmp_path, target):
    script = tmp_path / "job.py"
    script.write_text(REPORT_SCRIPT)
    path = tmp_path / target
    env = {**os.environ, **MECHANICS_ENV,
           "NEURON_ADAPTIVE_EAGER_REPORT": target if target == "1" else str(path),
           "NEURON_ADAPTIVE_EAGER_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    if target == "1":
        assert "adaptive_eager report" in result.stderr
        assert "top segments by time saved:" in result.stderr
        assert re.search(r"fallbacks by reason: host_sync=6", result.stderr), result.stderr
    else:
        report = json.loads(path.read_text())
        assert set(report) == {"counters", "top_segments", "fallbacks", "compiles",
                               "compile_seconds"}
        assert report["compiles"] == 1 and report["fallbacks"]["host_sync"] == 6
        [top] = [row for row in report["top_segments"] if row["fused_runs"]]
        assert top["fused_runs"] >= 3 and top["eager_ms"] > 0 and top["fused_ms"] > 0
