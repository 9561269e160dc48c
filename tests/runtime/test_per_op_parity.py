"""Programs under the runtime compute what eager computes: forward and backward, per-op
(compilation off: bitwise) and fused with the stand-in compiler (every segment replayed)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager as ae
from adaptive_eager.config import config
from helpers import assert_equal

# Both interception backends (tests/conftest.py: backend).
pytestmark = pytest.mark.usefixtures("backend")

# A broad set of ops, each a function of a few float tensors (x: 4x6, y: 4x6, m: 6x5).
OPS = {
    "pointwise": lambda x, y, m: (x.sin() * y.exp() - x.abs().sqrt()).clamp(-1, 1),
    "comparison_where": lambda x, y, m: torch.where(x > y, x, y * 2),
    "reductions": lambda x, y, m: x.sum(1) + x.mean(0).sum() + x.amax(1) + x.logsumexp(1),
    "var_std_norm": lambda x, y, m: x.var(1) + y.std(0).sum() + x.norm(dim=1),
    "matmul": lambda x, y, m: (x @ m).relu() @ m.t(),
    "views": lambda x, y, m: x.t().reshape(3, 8)[1:].unsqueeze(0).expand(2, 2, 8).sum(0),
    "cat_stack_split": lambda x, y, m: torch.cat(torch.split(torch.stack([x, y]).sum(0), 2)),
    "indexing": lambda x, y, m: (x[:, [0, 2, 4]].sum(1) * y[1:3].sum()
                                 + x.gather(1, (y > 0).long()).sum(1)),
    "softmax": lambda x, y, m: F.softmax(x, -1) + F.log_softmax(y, 0),
    "activations": lambda x, y, m: F.gelu(x) + F.silu(y) + F.elu(x) + F.leaky_relu(y),
    "normalization": lambda x, y, m: (F.layer_norm(x, (6,))
                                      + F.group_norm(x.view(2, 2, 6), 2).view(4, 6)),
    "losses": lambda x, y, m: (F.mse_loss(x, y) + F.smooth_l1_loss(x, y)
                               + F.binary_cross_entropy_with_logits(x, y.sigmoid())),
    "cumulative": lambda x, y, m: x.cumsum(1) * y.cumprod(0),
    "sort_topk": lambda x, y, m: x.sort(1).values + x.topk(6, 1).values,
    "dtype_casts": lambda x, y, m: (x.to(torch.float64) * 2).to(torch.float32) + x.half().float(),
    "inplace_chain": lambda x, y, m: x.clone().mul_(2).add_(y).clamp_(min=0),
    "masked_fill_scatter": lambda x, y, m: x.masked_fill(y > 0, 0.5).scatter_add(
        1, torch.zeros(4, 6, dtype=torch.long), y),
    "einsum_bmm": lambda x, y, m: (torch.einsum("ij,jk->ik", x, m)
                                   + torch.bmm(x.unsqueeze(0), m.unsqueeze(0))[0]),
    "conv1d": lambda x, y, m: F.conv1d(x.unsqueeze(0), y[:, :3].unsqueeze(1).repeat(1, 4, 1))[0],
    "data_dependent": lambda x, y, m: x[x > 0].sum() + x.nonzero().float().sum(),
}


def _inputs(requires_grad):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g, requires_grad=requires_grad)
            for shape in ((4, 6), (4, 6), (6, 5))]


def _forward_backward(fn, inputs):
    out = fn(*inputs)
    out.sum().backward()
    return [out.detach()] + [t.grad for t in inputs]


def _eager(fn):
    return _forward_backward(fn, _inputs(True))


@pytest.mark.parametrize("name", OPS)
def test_compile_off_is_bitwise_eager(name):
    fn = OPS[name]
    expected = _eager(fn)
    with config.patch(COMPILE=False), ae.enabled():
        runs = [_forward_backward(fn, _inputs(True)) for _ in range(3)]
    for got in runs:
        assert_equal(got, expected, bitwise=True)
    assert ae.stats().compiles == 0


@pytest.mark.parametrize("name", OPS)
def test_fused_with_stand_in_compiler_equals_eager(name, compiler):
    fn = OPS[name]
    expected = _eager(fn)
    with config.patch(HOT_THRESHOLD=1), ae.enabled():
        runs = [_forward_backward(fn, _inputs(True)) for _ in range(4)]
    for got in runs:
        assert_equal(got, expected)
    if name != "data_dependent":            # every op there is a boundary or stands alone
        assert ae.stats().fused_executions >= 1, ae.stats()


class SmallConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 8 * 8, 5)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 16)
        self.layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, 20)

    def forward(self, tokens):
        return self.head(self.layer(self.embed(tokens)))


MODELS = {
    "mlp": (lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                        torch.nn.Linear(16, 2)), lambda: torch.randn(4, 8)),
    "convnet_batchnorm": (SmallConvNet, lambda: torch.randn(2, 3, 8, 8)),
    "lstm": (lambda: torch.nn.LSTM(6, 8, batch_first=True), lambda: torch.randn(2, 5, 6)),
    "tiny_transformer": (TinyLM, lambda: torch.randint(0, 20, (2, 7))),
}


def _model_step(model, data):
    model.zero_grad(set_to_none=True)
    out = model(data)
    out = out[0] if isinstance(out, tuple) else out
    out.float().pow(2).mean().backward()
    return [out.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("compile_on", [False, True], ids=["compile_off", "stand_in_compiler"])
def test_small_models_forward_backward(name, compile_on):
    make_model, make_data = MODELS[name]
    torch.manual_seed(0)
    eager_model, data = make_model(), make_data()
    model = copy.deepcopy(eager_model)
    expected = [_model_step(eager_model, data) for _ in range(3)]
    with config.patch(COMPILE=compile_on, HOT_THRESHOLD=1), ae.enabled():
        got = [_model_step(model, data) for _ in range(3)]
    for g, e in zip(got, expected):
        assert_equal(g, e, bitwise=not compile_on)
    for buffer, eager_buffer in zip(model.buffers(), eager_model.buffers()):   # BN running stats
        assert_equal(buffer, eager_buffer, bitwise=not compile_on)
    stats = ae.stats()
    if compile_on and name == "lstm":      # Inductor cannot run its forward under autograd
        assert stats.fallbacks["compiler_unsupported"] == 1, stats   # (its backward is apart)
    else:
        assert (stats.fused_executions >= 1) == compile_on, stats
