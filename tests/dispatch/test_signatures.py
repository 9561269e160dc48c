import pytest
import torch

from adaptive_eager.dispatch.ops import Reason
from adaptive_eager.dispatch.signature import ScalarArg, TensorArg, Unkeyable, key_context
from adaptive_eager.runtime.segment import SegmentBuilder


def _encode(*args):
    builder = SegmentBuilder(key_context())
    return builder.encode(args, {})[0], builder


def test_scalars_carry_their_type():
    ints, _ = _encode(1)
    floats, _ = _encode(1.0)
    bools, _ = _encode(True)
    assert ints != floats != bools and ints != bools
    assert ints == (ScalarArg(int, 1),)


def test_tensor_arguments_key_shape_stride_dtype_device():
    base, _ = _encode(torch.zeros(4, 6))
    assert base != _encode(torch.zeros(6, 4))[0]
    assert base != _encode(torch.zeros(6, 4).t())[0]                 # same shape, other strides
    assert base != _encode(torch.zeros(4, 6, dtype=torch.float64))[0]
    assert base == _encode(torch.ones(4, 6))[0]                      # values are not in the key


def test_the_same_tensor_twice_is_one_input():
    x, y = torch.zeros(3), torch.zeros(3)
    (same_a, same_b), builder = _encode(x, x)
    assert same_a.ref == same_b.ref == ("in", 0) and len(builder.inputs) == 1
    (diff_a, diff_b), builder = _encode(x, y)
    assert diff_a.ref != diff_b.ref and len(builder.inputs) == 2


def test_misaligned_views_are_keyed_apart():
    storage = torch.zeros(16)
    assert _encode(storage[1:9])[0][0].aligned is False
    assert _encode(storage[4:12])[0][0].aligned is True


def test_lists_become_tuples_and_nest():
    encoded, _ = _encode([1, 2], [torch.zeros(2), None])
    assert encoded[0] == (ScalarArg(int, 1), ScalarArg(int, 2))
    assert isinstance(encoded[1][0], TensorArg) and encoded[1][1] is None


def test_unkeyable_arguments_are_typed_and_leave_no_inputs_behind():
    builder = SegmentBuilder(key_context())
    with pytest.raises(Unkeyable) as info:
        builder.encode((torch.zeros(2), object()), {})
    assert info.value.reason is Reason.UNKEYABLE_ARGUMENT
    assert builder.inputs == []
    with pytest.raises(Unkeyable) as info:
        builder.encode((torch.zeros(2).to_sparse(),), {})
    assert info.value.reason is Reason.UNSUPPORTED_TENSOR


def test_cpu_scalar_tensors_may_join_any_device_but_two_devices_may_not():
    builder = SegmentBuilder(key_context())
    builder.encode((torch.zeros(3), torch.tensor(2.0)), {})
    with pytest.raises(Unkeyable) as info:
        builder.encode((torch.zeros(3),), {"device": "meta"})
    assert info.value.reason is Reason.CROSS_DEVICE


def test_key_context_follows_ambient_state():
    plain = key_context()
    with torch.no_grad():
        assert key_context() != plain
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key_context() != plain
    assert key_context() == plain
