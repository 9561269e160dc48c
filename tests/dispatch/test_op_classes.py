import importlib

import pytest
import torch

from adaptive_eager.dispatch.ops import OpKind, Reason, classify

aten = torch.ops.aten

# Classification as data: (op, expected kind, expected reason).
CASES = [
    (aten.add.Tensor, OpKind.FUSIBLE, None),
    (aten.native_layer_norm.default, OpKind.FUSIBLE, None),
    (aten._foreach_mul.Scalar, OpKind.FUSIBLE, None),
    (aten.add_.Tensor, OpKind.MUTATING, None),
    (aten._foreach_add_.List, OpKind.MUTATING, None),
    (aten.add.out, OpKind.MUTATING, None),
    (aten.copy_.default, OpKind.MUTATING, None),
    (aten.t.default, OpKind.VIEW, None),
    (aten.expand.default, OpKind.VIEW, None),
    (aten.detach.default, OpKind.VIEW, None),
    (aten.split.Tensor, OpKind.VIEW, None),
    (aten._local_scalar_dense.default, OpKind.BOUNDARY, Reason.HOST_SYNC),
    (aten.is_nonzero.default, OpKind.BOUNDARY, Reason.HOST_SYNC),
    (aten.equal.default, OpKind.BOUNDARY, Reason.HOST_SYNC),
    (aten.nonzero.default, OpKind.BOUNDARY, Reason.DYNAMIC_SHAPE),
    (aten.masked_select.default, OpKind.BOUNDARY, Reason.DYNAMIC_SHAPE),
    (aten._unique2.default, OpKind.BOUNDARY, Reason.DYNAMIC_SHAPE),
    (aten.native_dropout.default, OpKind.BOUNDARY, Reason.RANDOM),
    (aten.bernoulli_.float, OpKind.BOUNDARY, Reason.RANDOM),
    (aten.randn.default, OpKind.BOUNDARY, Reason.RANDOM),
    (aten.resize_.default, OpKind.BOUNDARY, Reason.METADATA_MUTATION),
    (aten.t_.default, OpKind.BOUNDARY, Reason.METADATA_MUTATION),
    (aten.sym_size.int, OpKind.BOUNDARY, Reason.NON_TENSOR_OUTPUT),
    (torch.ops.profiler._record_function_enter_new.default, OpKind.BOUNDARY, Reason.PROFILER_RANGE),
    (torch.ops.prims.sum.default, OpKind.BOUNDARY, Reason.UNKNOWN_OP),
]


@pytest.mark.parametrize("op, kind, reason", CASES, ids=[str(case[0]) for case in CASES])
def test_classification(op, kind, reason):
    op_class = classify(op)
    assert op_class.kind is kind
    assert op_class.reason == reason


def test_mutating_ops_know_which_argument_they_return():
    assert classify(aten.add_.Tensor).returned_args == ((0, "self"),)
    assert classify(aten.add.out).returned_args[0][1] == "out"
    assert classify(aten._foreach_add_.List).returned_args == ()   # returns nothing


def test_collectives_are_boundaries():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not built")
    importlib.import_module("torch.distributed._functional_collectives")  # registers the ops
    op = torch.ops._c10d_functional.all_reduce.default
    assert classify(op).reason is Reason.COLLECTIVE


def test_attention_without_dropout_is_fusible_with_dropout_random():
    # Note [Random only through dropout]: the CPU kernel draws nothing without dropout.
    from adaptive_eager.dispatch.ops import classify_call
    from adaptive_eager.dispatch.signature import ScalarArg
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.randn(1, 2, 4, 8)
    assert classify(op).reason is Reason.RANDOM
    for args, kwargs in [((q, q, q), {}), ((q, q, q, 0.0, True), {}),
                         ((q, q, q), {"dropout_p": 0.0}), ((q, q, q, ScalarArg(float, 0.0)), {})]:
        assert classify_call(op, args, kwargs).kind is OpKind.FUSIBLE, (args[3:], kwargs)
        assert classify_call(op, args, kwargs).extern
    for args, kwargs in [((q, q, q, 0.1), {}), ((q, q, q), {"dropout_p": 0.1}),
                         ((q, q, q, ScalarArg(float, 0.5)), {})]:
        assert classify_call(op, args, kwargs).reason is Reason.RANDOM, (args[3:], kwargs)
    assert classify_call(aten.native_dropout.default, (q, 0.0, True), {}).reason is Reason.RANDOM
    assert classify_call(aten.add.Tensor, (q, q), {}) is classify(aten.add.Tensor)
