"""`adaptive-eager cache ...`: text and --json output, errors as one line and a non-zero exit."""
import json
import os

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.cache.inductor_dir import claim
from adaptive_eager.cache.store import Store
from adaptive_eager.cli import main
from adaptive_eager.config import config
from helpers import chain


@pytest.fixture
def cache_dir():
    with ae.enabled():
        for _ in range(5):
            chain(torch.randn(16))
            chain(torch.randn(8))              # a second key: other shapes
            torch.randn(4).sum().item()        # a boundary, and a single-op segment
    ae.reset()                                 # writes everything to the store
    return config.CACHE_DIR


def _cli(capsys, *argv):
    code = main(["cache", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys, *argv):
    code, out, err = _cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_ls_text_and_json(cache_dir, capsys):
    code, out, _ = _cli(capsys, "ls", "--dir", cache_dir)
    assert code == 0
    assert "mul.Tensor add.Tensor sin.default" in out and "ready" in out
    assert out.strip().endswith("segment(s)")
    rows = _json(capsys, "ls", "--dir", cache_dir, "--state", "ready", "--sort", "fused")
    assert len(rows) == 2
    for row in rows:
        assert set(row) >= {"digest", "state", "ops", "parts", "seen", "fused_runs",
                            "compile_seconds", "eager_ms", "fused_ms", "reason",
                            "torch_version", "created", "last_used", "artifact"}
        assert row["state"] == "ready" and row["fused_runs"] >= 1 and len(row["digest"]) == 16


def test_show_and_explain_by_prefix(cache_dir, capsys):
    digest = _json(capsys, "ls", "--dir", cache_dir, "--state", "ready")[0]["digest"]
    code, out, _ = _cli(capsys, "show", digest[:6], "--dir", cache_dir)
    assert code == 0 and digest in out and "%0 = aten.mul.Tensor(in0:f32[" in out
    info = _json(capsys, "show", digest[:6], "--dir", cache_dir)
    assert info["artifact_present"] is True and info["artifact_bytes"] > 0
    code, out, _ = _cli(capsys, "explain", digest[:8], "--dir", cache_dir)
    assert out.startswith(f"Segment {digest} (5 ops) is fused: compiled in")


def test_explain_two_keys_names_the_differing_parts(cache_dir, capsys):
    first, second = (row["digest"] for row in _json(capsys, "ls", "--dir", cache_dir,
                                                    "--state", "ready"))
    lines = _json(capsys, "explain", first, second, "--dir", cache_dir)["differences"]
    assert any(line.startswith("inputs[0]:") for line in lines)
    assert any(line.startswith("arguments[0]:") for line in lines)
    assert not any(line.startswith("ops") for line in lines)        # same ops


def test_explain_a_segment_that_is_not_fused(cache_dir, capsys):
    rows = _json(capsys, "ls", "--dir", cache_dir, "--state", "unfusible")
    assert rows, "the single-op segment should be recorded as unfusible"
    sentence = _json(capsys, "explain", rows[0]["digest"], "--dir", cache_dir)["explanation"]
    assert "is not fused: it has fewer than two compute ops" in sentence


def test_explain_a_segment_inductor_cannot_run(capsys):
    lstm = torch.nn.LSTM(8, 16, batch_first=True)
    with ae.enabled():
        for _ in range(4):
            lstm(torch.randn(2, 5, 8))
    ae.reset()                                 # writes everything to the store
    rows = _json(capsys, "ls", "--dir", config.CACHE_DIR, "--state", "unfusible")
    [row] = [r for r in rows if r["reason"] == "compiler_unsupported"]
    sentence = _json(capsys, "explain", row["digest"], "--dir", config.CACHE_DIR)["explanation"]
    assert "is not fused: it holds an op whose compiled kernel fails when run" in sentence


def test_stats_verify_clear(cache_dir, capsys):
    stats = _json(capsys, "stats", "--dir", cache_dir)
    assert stats["entries"] >= 3 and stats["by_state"]["ready"] == 2
    assert stats["disk_bytes"] > 0 and 0 < stats["fused_fraction"] < 1
    assert _json(capsys, "verify", "--dir", cache_dir)["ok"] is True
    code, _, err = _cli(capsys, "clear", "--dir", cache_dir)       # no tty, no --yes
    assert code == 2 and "--yes" in err
    claim(os.path.join(cache_dir, "inductor"))        # as our first compile does
    inductor = os.path.join(cache_dir, "inductor", "fxgraph")      # Inductor's, beside ours
    os.makedirs(inductor)
    with open(os.path.join(inductor, "entry"), "wb") as handle:
        handle.write(bytes(1 << 20))
    assert _json(capsys, "clear", "--yes", "--dir", cache_dir)["removed"] >= 3
    assert _json(capsys, "ls", "--dir", cache_dir) == []
    assert not os.path.exists(os.path.join(cache_dir, "inductor"))


@pytest.mark.parametrize("argv, message", [
    (["show", "ffffffffff"], "no segment key starts with"),
    (["explain", "not-hex"], "is not a key"),
    (["prune"], "prune needs"),
    (["prune", "--older-than", "soon"], "not a duration"),
])
def test_bad_requests_are_one_line_and_exit_2(cache_dir, capsys, argv, message):
    code, out, err = _cli(capsys, *argv, "--dir", cache_dir)
    assert code == 2 and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_an_ambiguous_prefix_lists_candidates(cache_dir, capsys):
    store = Store(cache_dir)
    record = store.records()[0]
    for digest in ("abc1000000000000", "abc2000000000000"):
        store.write([{"digest": digest, "ops": record.ops, "parts": record.parts,
                      "state": "cold", "torch_version": "t", "fingerprint": "f"}])
    store.close()
    code, _, err = _cli(capsys, "show", "abc", "--dir", cache_dir)
    assert code == 2 and "'abc' is ambiguous: it starts abc1000000000000, abc2000000000000" in err


def test_missing_cache_directory(tmp_path, capsys):
    code, _, err = _cli(capsys, "ls", "--dir", str(tmp_path / "nothing"))
    assert code == 2 and "no kernel cache at" in err
