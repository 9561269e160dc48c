"""The real-model coverage suite (adaptive_eager/benchmarks/coverage.py) in CI: every
architecture of the suite trains (AdamW) and generates greedily (dynamic and static cache)
under the runtime with every hot segment fused by the counting stand-in compiler, which runs
the recorded ops as they are, so losses, gradients, parameters and tokens equal eager's bits.
The real-Inductor table is ``adaptive-eager bench --coverage`` (docs/coverage.md)."""
import dataclasses

import pytest

from adaptive_eager.benchmarks import coverage
from adaptive_eager.benchmarks.architectures import ARCHITECTURES, ENCODER

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def quiet_transformers():
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=[a.model_type for a in ARCHITECTURES])
def test_architecture_trains_and_generates_as_eager(arch, compiler):
    result = coverage.check_architecture(arch, bitwise=True)
    # Encoders do not generate (n/a); every other check must pass.
    expected = coverage.PASS if arch.generates else coverage.NOT_APPLICABLE
    failures = [f"{check.name}: {check.status} {check.reason}" for check in result.checks
                if check.status != (coverage.PASS if check.name == "train" else expected)]
    assert not failures, failures
    assert compiler.count > 0 and result.fused_ops > 0, result   # kernels ran, not per-op only


def test_suite_covers_the_issue_architectures():
    types = {arch.model_type for arch in ARCHITECTURES}
    assert len(ARCHITECTURES) >= 20
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2",
            "gpt_neox", "falcon", "opt", "bloom", "mixtral", "qwen2_moe", "t5", "bart", "bert",
            "roberta"} <= types
    assert all(not arch.generates for arch in ARCHITECTURES if arch.kind == ENCODER)


def test_a_difference_is_reported_not_hidden():
    import torch
    a = torch.zeros(3)
    assert coverage.difference([a], [a.clone()], bitwise=True) is None
    assert "max abs diff" in coverage.difference([a + 1e-3], [a], bitwise=False)
    assert "1 of 3 elements" in coverage.difference(torch.tensor([1, 2, 3]),
                                                   torch.tensor([1, 2, 4]), bitwise=True)


# ---------------------------------------------------------------------- the command and table

def test_unknown_architecture_is_one_line_and_exit_2(capsys):
    from adaptive_eager.cli import main
    assert main(["bench", "--coverage", "--arch", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llama" in err


def _result(name, *statuses, timing=None):
    names = ("train", "generate dynamic", "generate static")
    checks = tuple(coverage.Check(n, s, "" if s == coverage.PASS else f"why {n}")
                   for n, s in zip(names, statuses))
    return coverage.Coverage(name, name.lower(), "decoder", checks, 200, 50,
                             {"megamorphic": 7, "random": 3}, timing or {})


def test_the_table_counts_failures_and_says_why():
    from adaptive_eager.benchmarks import coverage_table
    timing = {"train step": {"eager_s": 0.02, "runtime_s": 0.01, "ratio": 0.5,
                             "fused_fraction": 0.25, "eager_spread": 0.1,
                             "settling_s": 0.03, "settling_calls": 40}}
    results = [_result("A", "pass", "pass", "pass", timing=timing),
               _result("B", "pass", "fail", "pass")]
    assert not results[1].passed and results[0].fused_fraction == 0.25
    page = coverage_table.markdown(results, "adaptive-eager bench --coverage")
    assert "1 of 2 architectures (50%)" in page
    assert "| B | decoder | pass | **FAIL** | pass | 25% | megamorphic 7, random 3 |" in page
    assert "0.50 (25%), settling 1.50" in page     # taking the kernels in: shown, not hidden
    assert "- B, generate dynamic: fail: why generate dynamic" in page
    assert coverage.Coverage.from_dict(results[1].as_dict()) == results[1]


def test_saved_results_are_shown_again_in_the_suite_order(tmp_path, capsys):
    from adaptive_eager.benchmarks import coverage_table
    from adaptive_eager.cli import main
    saved = [_result("Mistral", "pass", "pass", "pass"), _result("Llama", "pass", "pass", "fail")]
    saved = [dataclasses.replace(r, model_type=r.name.lower()) for r in saved]
    coverage_table.write_json(saved, str(tmp_path / "a.json"))
    page = tmp_path / "coverage.md"
    assert main(["bench", "--coverage", "--from-json", str(tmp_path / "a.json"),
                 "--markdown", str(page)]) == 1                    # one failure: exit 1
    text = page.read_text()
    assert text.index("| Llama |") < text.index("| Mistral |")       # the suite's order
    assert "1 of 2 architectures (50%)" in text


def test_the_parity_phases_share_one_kernel_cache(monkeypatch):
    """Note [One parity cache]: every child gets the same kernel cache directory."""
    import io
    import json
    import subprocess
    from adaptive_eager.benchmarks import coverage_table
    directories = []

    def child(command, env, **kwargs):
        directories.append(env["NEURON_ADAPTIVE_EAGER_CACHE_DIR"])
        arch = command[command.index("--arch") + 1]
        with open(command[command.index("--out") + 1], "w") as file:
            json.dump(_result(arch, "pass").as_dict(), file)
        return subprocess.CompletedProcess(command, 0, "", "")
    monkeypatch.setattr(coverage_table.subprocess, "run", child)
    results = coverage_table.run(ARCHITECTURES[:3], stream=io.StringIO())
    assert [result.name for result in results] == [a.model_type for a in ARCHITECTURES[:3]]
    assert len(directories) == 3 and len(set(directories)) == 1, directories


def test_one_json_holds_the_table_and_the_decode_results(tmp_path):
    from adaptive_eager.benchmarks import coverage_table
    saved = [_result("Llama", "pass", "pass", "pass")]
    saved = [dataclasses.replace(saved[0], model_type="llama")]
    decode = {"static": {"tokens_per_s": {"eager": 10.0, "runtime": 12.0},
                         "fused_fraction": 0.5, "mismatches": []}}
    path = str(tmp_path / "coverage.json")
    coverage_table.write_json(saved, path, decode)
    results, loaded = coverage_table.load([path], ARCHITECTURES)
    assert results == saved and loaded == decode
    page = coverage_table.markdown(results, "adaptive-eager bench --coverage", loaded)
    assert "| static | 10 | 12 | 1.20x | - | - | 50% | none |" in page
