"""The real-model coverage suite (adaptive_eager/benchmarks/coverage.py) in CI: every
architecture of the suite trains (AdamW) and generates greedily (dynamic and static cache)
under the runtime with every hot segment fused by the counting stand-in compiler, which runs
the recorded ops as they are, so losses, gradients, parameters and tokens equal eager's bits.
The real-Inductor table is ``adaptive-eager bench --coverage`` (docs/coverage.md)."""
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
