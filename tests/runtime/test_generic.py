"""Shape-generic segments: varying dims, generalized sizes, output metas, one kernel for all
sizes. Eager PyTorch is the oracle: every meta is compared with what the ops really produced."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from adaptive_eager.dispatch.ops import OpKind, classify
from adaptive_eager.dispatch.signature import TensorMeta, key_context
from adaptive_eager.runtime.generic import (NotGeneric, SizeExpr, build_generic_graph,
                                            compile_generic, generalize, output_metas,
                                            varying_dims)
from adaptive_eager.runtime.segment import SegmentBuilder
from helpers import assert_equal

CPU = torch.device("cpu")


class _Recorder(TorchDispatchMode):
    """Records every op into one segment, as the runtime's cold path does."""

    def __init__(self) -> None:
        super().__init__()
        self.builder = SegmentBuilder(key_context())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op_class = classify(func)
        assert op_class.kind is not OpKind.BOUNDARY, func
        encoded_args, encoded_kwargs = self.builder.encode(args, kwargs)
        self.builder.add(func, op_class, encoded_args, encoded_kwargs, out)
        return out


def record(fn, *inputs):
    """(segment, eager result, external inputs) of one call of ``fn``."""
    with torch.no_grad():
        recorder = _Recorder()
        with recorder:
            result = fn(*inputs)
        builder = recorder.builder
        return builder.finish(builder.live_refs()), result, builder.inputs


def recorded_metas(segment):
    return tuple(op.out_metas for op in segment.ops)


def meta(*shape, stride=None, dtype=torch.float32):
    stride = stride or torch.empty(shape).stride()
    return TensorMeta(torch.Size(shape), tuple(stride), dtype, CPU)


LINEAR, NORM = torch.nn.Linear(16, 32), torch.nn.LayerNorm(32)


def block(x):
    return NORM(F.gelu(LINEAR(x)))


def block_at(length, batch=2):
    return record(block, torch.randn(batch, length, 16))


# ------------------------------------------------------------------ varying_dims

def test_varying_dims_names_the_dims_that_change():
    weight = meta(32, 16)
    assert varying_dims([[meta(2, 8, 16), weight], [meta(2, 13, 16), weight]]) == ((0, 1),)
    assert varying_dims([[meta(2, 8), meta(8, 8)], [meta(3, 5), meta(5, 5)]]) == \
        ((0, 0), (0, 1), (1, 0), (1, 1))
    assert varying_dims([[weight], [weight]]) == ()


def test_varying_dims_accepts_one_shared_non_contiguous_dense_order():
    channels_last = [torch.empty(2, 3, h, 4).to(memory_format=torch.channels_last)
                     for h in (5, 9)]
    assert varying_dims([[TensorMeta.of(t)] for t in channels_last]) == ((0, 2),)


@pytest.mark.parametrize("other, why", [
    ([meta(2, 13, 16)], "input count"),
    ([meta(2, 13), meta(32, 16)], "rank"),
    ([meta(2, 13, 16, dtype=torch.float64), meta(32, 16)], "dtype"),
    ([meta(2, 13, 16, stride=(16, 32, 1)), meta(32, 16)], "another dim order"),
    ([meta(2, 13, 16, stride=(13 * 32, 32, 1)), meta(32, 16)], "not dense (a slice)"),
    ([meta(2, 13, 16), meta(32, 16, stride=(1, 32))], "fixed size, other strides"),
])
def test_varying_dims_refuses_what_one_kernel_cannot_serve(other, why):
    assert varying_dims([[meta(2, 8, 16), meta(32, 16)], other]) is None, why


# ------------------------------------------------------------------ generalize, output_metas

def test_sizes_that_follow_the_sequence_length_become_expressions():
    generic = generalize([block_at(8)[0], block_at(13)[0]])
    assert generic.symbols == (((0, 1),),) and generic.hints == (8,)
    flatten, unflatten = generic.calls[0][0][1], generic.calls[3][0][1]
    assert flatten[0] == SizeExpr(2, (0,))                  # view [2 * 8, 16]
    assert unflatten[1] == SizeExpr(1, (0,))                # view [2, 8, 32]


@pytest.mark.parametrize("symbolic", [True, False], ids=["shape_fn", "meta_replay"])
def test_output_metas_match_eager_at_new_lengths(symbolic):
    generic = generalize([block_at(8)[0], block_at(13)[0]], symbolic=symbolic)
    assert (generic.shape_fn is not None) is symbolic
    for length in (8, 13, 100, 2):
        segment = block_at(length)[0]
        assert output_metas(generic, segment.input_metas) == recorded_metas(segment), length
        assert output_metas(generic, segment.input_metas) == recorded_metas(segment)  # cached


def test_output_metas_refuse_inputs_outside_the_generic_structure():
    generic = generalize([block_at(8)[0], block_at(13)[0]])
    inputs = list(block_at(8)[0].input_metas)
    assert output_metas(generic, inputs) is not None
    for bad in (meta(2, 1, 16),                          # sizes 0 and 1 are specialized
                meta(3, 8, 16),                          # a fixed dim changed
                meta(2, 8, 16, dtype=torch.float64),
                meta(2, 8, 16, stride=(8 * 16 + 16, 16, 1))):  # not dense
        assert output_metas(generic, [bad] + inputs[1:]) is None, bad


def test_independent_batch_and_length_are_two_symbols():
    generic = generalize([block_at(8, batch=2)[0], block_at(13, batch=3)[0]])
    assert generic.symbols == (((0, 0),), ((0, 1),))
    assert generic.calls[0][0][1][0] == SizeExpr(1, (0, 1))   # view [batch * length, 16]
    segment = block_at(7, batch=5)[0]
    assert output_metas(generic, segment.input_metas) == recorded_metas(segment)


def attention(x, mask):
    scores = x @ x.transpose(-1, -2) / 4.0 + mask
    return scores.softmax(-1) @ x


def test_dims_that_always_share_a_size_are_one_symbol():
    variants = [record(attention, torch.randn(2, n, 16), torch.zeros(n, n))[0] for n in (8, 13)]
    generic = generalize(variants)
    assert generic.symbols == (((0, 1), (1, 0), (1, 1)),)
    segment = record(attention, torch.randn(2, 40, 16), torch.zeros(40, 40))[0]
    assert output_metas(generic, segment.input_metas) == recorded_metas(segment)
    ragged = list(segment.input_metas[:1]) + [meta(40, 41)]
    assert output_metas(generic, ragged) is None


def truncate(x):
    return x[:, : x.shape[1] - 1].exp()


def test_generalize_refuses_what_is_not_a_product_of_varying_sizes():
    with pytest.raises(NotGeneric, match="follow no products"):
        generalize([record(truncate, torch.randn(2, n))[0] for n in (8, 13)])
    with pytest.raises(NotGeneric, match="float arguments differ"):
        generalize([record(lambda x: x * x.shape[1] ** 0.5, torch.randn(2, n))[0]
                    for n in (4, 9)])
    with pytest.raises(NotGeneric, match="ops differ"):
        generalize([record(torch.sin, torch.randn(8))[0], record(torch.cos, torch.randn(9))[0]])
    with pytest.raises(NotGeneric, match="no input size varies"):
        generalize([block_at(8)[0], block_at(8)[0]])


def grow_cache(past, new):
    """A decode step with a growing cache: past keys of length s, one new token, s + 1 out."""
    keys = torch.cat([past, new.sin()], dim=-2)
    flat = (keys * 2).view(keys.shape[0], keys.shape[1] * keys.shape[2], -1)
    return flat[:, : keys.shape[1] * keys.shape[2] - 1].exp()


def cache_at(length):
    return torch.randn(2, length, 8), torch.randn(2, 1, 8)


def _size_exprs(value):
    if isinstance(value, SizeExpr):
        yield value
    elif isinstance(value, tuple):
        for item in value:
            yield from _size_exprs(item)


def test_sizes_offset_from_the_varying_sizes_need_a_third_variant():
    # Note [Affine sizes]: two variants fit any line; the third confirms s + 1 and s - 1.
    with pytest.raises(NotGeneric, match="follow no products"):
        generalize([record(grow_cache, *cache_at(n))[0] for n in (5, 9)])
    generic = generalize([record(grow_cache, *cache_at(n))[0] for n in (5, 6, 9)])
    sizes = set(_size_exprs(generic.calls))
    assert {SizeExpr(8, (0,), 8), SizeExpr(8, (0,), 7)} <= sizes, sizes   # view, slice end
    for length in (2, 5, 17, 40):
        segment, expected, externals = record(grow_cache, *cache_at(length))
        assert output_metas(generic, segment.input_metas) == recorded_metas(segment), length
        graph = build_generic_graph(generic)
        metas = output_metas(generic, segment.input_metas)
        buffers = [metas[op][out].empty() for _, op, out in generic.example.live_refs]
        with torch.no_grad():
            graph(*externals, *buffers)
        assert_equal(buffers[-1], expected, bitwise=True)


def test_offsets_that_three_variants_refute_are_not_generic():
    with pytest.raises(NotGeneric, match="follow no products"):
        generalize([record(lambda x: x[:, : min(x.shape[1] - 1, 7)].exp(), torch.randn(2, n))[0]
                    for n in (5, 6, 12)])


# ------------------------------------------------------------------ the generic graph, eagerly

def run_generic(kernel, generic, fn, inputs):
    """Run ``fn`` eagerly on ``inputs`` and ``kernel`` on copies of them, writing buffers
    shaped by output_metas; returns (buffers, eager result, kernel's inputs, eager's inputs)."""
    copies = [t.clone() for t in inputs]
    segment, expected, externals = record(fn, *inputs)
    swap = {id(t): copy for t, copy in zip(inputs, copies)}
    metas = output_metas(generic, segment.input_metas)
    assert metas == recorded_metas(segment)
    buffers = [metas[op][out].empty() for _, op, out in generic.example.live_refs]
    with torch.no_grad():
        kernel(*[swap.get(id(t), t) for t in externals], *buffers)
    return buffers, expected, copies, inputs


@pytest.mark.parametrize("length", [8, 13, 100])
def test_generic_graph_runs_eagerly_at_any_length(length):
    generic = generalize([block_at(8)[0], block_at(13)[0]])
    graph = build_generic_graph(generic)
    (buffer,), expected, _, _ = run_generic(graph, generic, block, [torch.randn(2, length, 16)])
    assert_equal(buffer, expected)


def accumulate(x, acc):
    acc.add_(x.sin())                          # in-place update of an external input
    return (acc * 2).reshape(-1, 4).cos()      # a flattening view of a varying tensor


def accumulate_inputs(length):
    return torch.randn(3, length, 4), torch.randn(3, length, 4)


def test_generic_graph_updates_inputs_in_place():
    generic = generalize([record(accumulate, *accumulate_inputs(n))[0] for n in (8, 13)])
    graph = build_generic_graph(generic)
    buffers, expected, inputs, eager_inputs = run_generic(
        graph, generic, accumulate, accumulate_inputs(21))
    assert_equal(buffers[-1], expected)
    assert_equal(inputs, eager_inputs)


# ------------------------------------------------------------------ one Inductor kernel

@pytest.mark.inductor
def test_one_inductor_kernel_serves_every_length(tmp_path):
    generic = generalize([block_at(8)[0], block_at(13)[0]])
    kernel, generic = compile_generic(generic)
    for length in (8, 13, 100):
        (buffer,), expected, _, _ = run_generic(kernel, generic, block,
                                                [torch.randn(2, length, 16)])
        assert_equal(buffer, expected)
    assert kernel.is_saveable()
    kernel.save(path=str(tmp_path / "kernel.bin"), format="binary")
    from torch._inductor.standalone_compile import CompiledArtifact
    loaded = CompiledArtifact.load(path=str(tmp_path / "kernel.bin"), format="binary")
    (buffer,), expected, _, _ = run_generic(loaded, generic, block, [torch.randn(2, 37, 16)])
    assert_equal(buffer, expected)


@pytest.mark.inductor
def test_one_inductor_kernel_updates_inputs_in_place_at_every_length():
    generic = generalize([record(accumulate, *accumulate_inputs(n))[0] for n in (8, 13)])
    kernel, generic = compile_generic(generic)
    for length in (8, 13, 100):
        buffers, expected, inputs, eager_inputs = run_generic(
            kernel, generic, accumulate, accumulate_inputs(length))
        assert_equal(buffers[-1], expected)
        assert_equal(inputs, eager_inputs)


@pytest.mark.inductor
def test_one_inductor_kernel_serves_a_growing_cache_at_every_length():
    generic = generalize([record(grow_cache, *cache_at(n))[0] for n in (5, 6, 9)])
    kernel, generic = compile_generic(generic)
    for length in (5, 17, 40):
        segment, expected, externals = record(grow_cache, *cache_at(length))
        if generic.bind(segment.input_metas) is None:
            continue                     # outside what the compile assumed: not served
        metas = output_metas(generic, segment.input_metas)
        buffers = [metas[op][out].empty() for _, op, out in generic.example.live_refs]
        with torch.no_grad():
            kernel(*externals, *buffers)
        assert_equal(buffers[-1], expected)
    assert generic.bind(record(grow_cache, *cache_at(40))[0].input_metas) is not None


def prefix(x):
    return x[:, :4].exp()


def test_sizes_that_hold_only_for_some_lengths_fall_back_to_meta_replay_or_refuse():
    # slicing [:4] is only [.., 4] for lengths >= 4: the symbolic trace guards on that
    generic = generalize([record(prefix, torch.randn(2, n))[0] for n in (8, 13)])
    assert generic.shape_fn is None
    for length in (5, 100):
        segment = record(prefix, torch.randn(2, length))[0]
        assert output_metas(generic, segment.input_metas) == recorded_metas(segment)
    assert output_metas(generic, record(prefix, torch.randn(2, 3))[0].input_metas) is None


def test_what_a_compile_learned_about_a_size_limits_the_kernel_to_where_it_holds():
    from adaptive_eager.runtime.generic import learned_conditions
    from adaptive_eager.runtime.generic.shapes import symbolic_mode
    fake_mode, symbols, symints = symbolic_mode((8,))
    assert learned_conditions(fake_mode.shape_env, symbols) == ()
    assert symints[0] >= 4                     # what compiling x[:, :4] makes Inductor assume
    conditions = learned_conditions(fake_mode.shape_env, symbols)
    assert conditions
    generic = generalize([record(torch.sin, torch.randn(2, n))[0] for n in (8, 13)])
    limited = dataclasses.replace(generic, conditions=conditions, _metas={})
    assert limited.bind(record(torch.sin, torch.randn(2, 5))[0].input_metas) == (5,)
    assert limited.bind(record(torch.sin, torch.randn(2, 3))[0].input_metas) is None
    assert generic.bind(record(torch.sin, torch.randn(2, 3))[0].input_metas) == (3,)


# ------------------------------------------------------------------ serving recorded keys

def test_a_recorded_shape_fits_when_sizes_follow_the_symbols():
    from adaptive_eager.runtime.generic import fits
    generic = generalize([block_at(n)[0] for n in (8, 13, 21)])
    assert fits(generic, block_at(40)[0])
    assert fits(generic, block_at(8)[0])
    assert not fits(generic, block_at(40, batch=3)[0])         # a static dim changed
    assert not fits(generic, block_at(1)[0])                   # Inductor specializes size 1
    assert not fits(generic, record(torch.sin, torch.randn(2, 40))[0])   # another structure


def test_an_integer_argument_that_does_not_follow_the_sizes_does_not_fit():
    from adaptive_eager.runtime.generic import fits
    narrow = lambda x, n: x.narrow(1, 0, n).exp()             # noqa: E731
    generic = generalize([record(narrow, torch.randn(2, n), n)[0] for n in (8, 12, 20)])
    assert fits(generic, record(narrow, torch.randn(2, 30), 30)[0])
    assert not fits(generic, record(narrow, torch.randn(2, 30), 15)[0])
