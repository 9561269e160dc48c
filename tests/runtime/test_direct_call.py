"""Note [Calling the generated code]: a kernel called without AOTAutograd's runtime wrapper
computes what the artifact computes, and anything else is called as it is. Kernels reach the
runtime loaded (the worker ships them as saved artifacts), so the tests load theirs too."""
import pytest
import torch
import torch.fx as fx

from adaptive_eager.runtime.compiler import InductorCompiler
from adaptive_eager.runtime.direct_call import direct_kernel, fast_call

aten = torch.ops.aten
pytestmark = pytest.mark.inductor


def _into_buffer(x, out):
    y = aten.mul.Tensor(aten.sin.default(aten.add.Tensor(x, 1.0)), 3.0)
    aten.copy_.default(out, aten.cos.default(y))
    return ()


def _writing_its_input(x, out):
    aten.add_.Tensor(x, 2.0)                       # an in-place write into an input
    aten.copy_.default(out, aten.tanh.default(x))
    return ()


def _loaded(program, example_inputs: list, directory):
    compiler = InductorCompiler()
    path = str(directory / "kernel.bin")
    assert compiler.save(compiler.compile(fx.symbolic_trace(program), example_inputs), path)
    return compiler.load(path)


@pytest.mark.parametrize("program", [_into_buffer, _writing_its_input])
def test_the_direct_call_computes_what_the_artifact_computes(program, tmp_path):
    torch.manual_seed(0)
    x = torch.randn(4096)
    artifact = _loaded(program, [x.clone(), torch.empty(4096)], tmp_path)
    call = fast_call(artifact)
    assert call is not artifact and call.artifact is artifact   # the plain wrapper, found
    by_artifact, by_call = (x.clone(), torch.empty(4096)), (x.clone(), torch.empty(4096))
    with torch.no_grad():
        artifact(*by_artifact)
    call(*by_call)
    for got, expected in zip(by_call, by_artifact):
        assert torch.equal(got, expected)


def test_a_parameter_input_under_grad_mode_is_called_as_a_kernel(tmp_path):
    x = torch.nn.Parameter(torch.randn(64))
    artifact = _loaded(_into_buffer, [x.detach().clone(), torch.empty(64)], tmp_path)
    call = fast_call(artifact)
    assert call is not artifact
    out = torch.empty(64)
    with torch.enable_grad():
        call(x, out)
        assert torch.is_grad_enabled()
    expected = torch.empty(64)
    with torch.no_grad():
        artifact(x, expected)
    assert torch.equal(out, expected) and out.grad_fn is None


def test_anything_else_is_called_as_it_is():
    def kernel(*tensors):
        return None
    assert fast_call(kernel) is kernel
    assert fast_call(object) is object


def _with_matmul(a, b, out):
    aten.copy_.default(out, aten.relu.default(aten.mm.default(a, b)))
    return ()


def test_a_graph_of_one_generated_kernel_can_be_called_from_cpp(tmp_path):
    """Note [Launching from C++]: the kernel's library and which graph argument each of its
    pointers is (here the input, then the buffer it writes)."""
    x = torch.randn(4096)
    direct = direct_kernel(fast_call(_loaded(_into_buffer, [x, torch.empty(4096)], tmp_path)))
    assert direct is not None and direct.library.endswith(".so")
    assert direct.arguments == [0, 1]


def test_a_graph_calling_an_extern_kernel_keeps_its_python_call(tmp_path):
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    artifact = _loaded(_with_matmul, [a, b, torch.empty(16, 16)], tmp_path)
    assert direct_kernel(fast_call(artifact)) is None
    assert direct_kernel(artifact) is None          # no plain wrapper found: nothing to call
