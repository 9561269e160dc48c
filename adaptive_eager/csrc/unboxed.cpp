// Unboxed pass-through for the most common ops (Note [Unboxed pass-through]).
//
// Note [Unboxed pass-through]
// A boxed fallback costs every op it sees its boxing: the dispatcher packs the arguments into
// IValues, our fallback redispatches them boxed, the kernel below unpacks them, and the
// results travel back the same way (~0.2 us for a pointwise op, more for lists and tuples).
// Boxing copies each tensor argument, and in torch 2.13 a tensor that a Python object owns
// takes the GIL (which torch's Python bindings released around the op) to incref that
// object when its count goes from 1 to 2, and again to decref it on the way back: in a
// fused 8-op chain on 4096 floats, taking and dropping the GIL was ~6% of the time.
// A paused thread that keeps its kernels (Note [Kernels while paused] in hot_path.cpp) keeps
// the key in its dispatch set, so it pays that on every op of the program: GPT-2's tiny
// training step (362 ops) ran 8% slower passed through the fallback than plain, as much as
// its AdamW kernel saved. So the ops below, those that make up most of the transformer
// training and inference steps measured, get a kernel of their own on the key, unboxed. Where
// the fallback would only pass the op through (a paused thread, with nothing deferred and no
// kernel's path starting at this operator, its resume check not due) it redispatches the op
// as it came; else it boxes the arguments and calls the fallback, as the dispatcher would
// have. Any other op still reaches the fallback boxed. A kernel of our own on an op changes
// nothing for threads without the key in their dispatch set.
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <ATen/ops/_foreach_add_ops.h>
#include <ATen/ops/_foreach_addcdiv_ops.h>
#include <ATen/ops/_foreach_addcmul_ops.h>
#include <ATen/ops/_foreach_div_ops.h>
#include <ATen/ops/_foreach_lerp_ops.h>
#include <ATen/ops/_foreach_mul_ops.h>
#include <ATen/ops/_foreach_neg_ops.h>
#include <ATen/ops/_foreach_sqrt_ops.h>
#include <ATen/ops/_foreach_sub_ops.h>
#include <ATen/ops/_local_scalar_dense_ops.h>
#include <ATen/ops/_log_softmax_backward_data_ops.h>
#include <ATen/ops/_log_softmax_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward_ops.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_ops.h>
#include <ATen/ops/_softmax_backward_data_ops.h>
#include <ATen/ops/_softmax_ops.h>
#include <ATen/ops/_to_copy_ops.h>
#include <ATen/ops/_unsafe_view_ops.h>
#include <ATen/ops/abs_ops.h>
#include <ATen/ops/add_ops.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/alias_ops.h>
#include <ATen/ops/all_ops.h>
#include <ATen/ops/any_ops.h>
#include <ATen/ops/arange_ops.h>
#include <ATen/ops/argmax_ops.h>
#include <ATen/ops/as_strided_ops.h>
#include <ATen/ops/baddbmm_ops.h>
#include <ATen/ops/bitwise_and_ops.h>
#include <ATen/ops/bitwise_not_ops.h>
#include <ATen/ops/bitwise_or_ops.h>
#include <ATen/ops/bmm_ops.h>
#include <ATen/ops/cat_ops.h>
#include <ATen/ops/clone_ops.h>
#include <ATen/ops/constant_pad_nd_ops.h>
#include <ATen/ops/copy_ops.h>
#include <ATen/ops/cos_ops.h>
#include <ATen/ops/cumsum_ops.h>
#include <ATen/ops/detach_ops.h>
#include <ATen/ops/div_ops.h>
#include <ATen/ops/embedding_dense_backward_ops.h>
#include <ATen/ops/embedding_ops.h>
#include <ATen/ops/empty_like_ops.h>
#include <ATen/ops/empty_ops.h>
#include <ATen/ops/empty_strided_ops.h>
#include <ATen/ops/eq_ops.h>
#include <ATen/ops/exp_ops.h>
#include <ATen/ops/expand_ops.h>
#include <ATen/ops/fill_ops.h>
#include <ATen/ops/full_ops.h>
#include <ATen/ops/ge_ops.h>
#include <ATen/ops/gelu_backward_ops.h>
#include <ATen/ops/gelu_ops.h>
#include <ATen/ops/gt_ops.h>
#include <ATen/ops/index_copy_ops.h>
#include <ATen/ops/index_ops.h>
#include <ATen/ops/index_select_ops.h>
#include <ATen/ops/isin_ops.h>
#include <ATen/ops/le_ops.h>
#include <ATen/ops/lift_fresh_ops.h>
#include <ATen/ops/lt_ops.h>
#include <ATen/ops/masked_fill_ops.h>
#include <ATen/ops/max_ops.h>
#include <ATen/ops/mean_ops.h>
#include <ATen/ops/mm_ops.h>
#include <ATen/ops/mse_loss_backward_ops.h>
#include <ATen/ops/mse_loss_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/native_layer_norm_backward_ops.h>
#include <ATen/ops/native_layer_norm_ops.h>
#include <ATen/ops/ne_ops.h>
#include <ATen/ops/neg_ops.h>
#include <ATen/ops/nll_loss_backward_ops.h>
#include <ATen/ops/nll_loss_forward_ops.h>
#include <ATen/ops/ones_like_ops.h>
#include <ATen/ops/ones_ops.h>
#include <ATen/ops/permute_ops.h>
#include <ATen/ops/pow_ops.h>
#include <ATen/ops/relu_ops.h>
#include <ATen/ops/rsqrt_ops.h>
#include <ATen/ops/rsub_ops.h>
#include <ATen/ops/scalar_tensor_ops.h>
#include <ATen/ops/select_ops.h>
#include <ATen/ops/sigmoid_backward_ops.h>
#include <ATen/ops/sigmoid_ops.h>
#include <ATen/ops/silu_backward_ops.h>
#include <ATen/ops/silu_ops.h>
#include <ATen/ops/sin_ops.h>
#include <ATen/ops/slice_ops.h>
#include <ATen/ops/split_ops.h>
#include <ATen/ops/split_with_sizes_ops.h>
#include <ATen/ops/sqrt_ops.h>
#include <ATen/ops/squeeze_ops.h>
#include <ATen/ops/stack_ops.h>
#include <ATen/ops/sub_ops.h>
#include <ATen/ops/sum_ops.h>
#include <ATen/ops/t_ops.h>
#include <ATen/ops/tanh_backward_ops.h>
#include <ATen/ops/tanh_ops.h>
#include <ATen/ops/threshold_backward_ops.h>
#include <ATen/ops/transpose_ops.h>
#include <ATen/ops/unbind_ops.h>
#include <ATen/ops/unsqueeze_ops.h>
#include <ATen/ops/view_ops.h>
#include <ATen/ops/where_ops.h>
#include <ATen/ops/zero_ops.h>
#include <ATen/ops/zeros_like_ops.h>
#include <ATen/ops/zeros_ops.h>

#include "hot_path.h"

namespace adaptive_eager {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;
const c10::DispatchKeySet kBelow(c10::DispatchKeySet::FULL_AFTER, kKey);

template <class Op, class Signature = typename Op::schema>
struct Unboxed;

template <class Op, class Result, class... Args>
struct Unboxed<Op, Result(Args...)> {
  static Result call(c10::DispatchKeySet ks, Args... args) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
    if (passes_unboxed(op)) {
      c10::impl::ExcludeDispatchKeyGuard guard(kKey);
      return Op::redispatch(ks & kBelow, std::forward<Args>(args)...);
    }
    static const c10::BoxedKernel fallback =
        c10::BoxedKernel::makeFromFunction<&intercept_boxed>();
    return c10::impl::BoxedKernelWrapper<Result(Args...)>::call(fallback, op, ks,
                                                                std::forward<Args>(args)...);
  }
};

template <class Op>
void add_unboxed(torch::Library& library) {
  std::string name = std::string(Op::name).substr(sizeof("aten::") - 1);
  if (Op::overload_name[0] != '\0') name += std::string(".") + Op::overload_name;
  library.impl(name.c_str(), torch::CppFunction::makeFromUnboxedFunction(
                                 TORCH_FN((Unboxed<Op>::call))));
}

// The ops given a kernel: those seen most in GPT-2's training and inference steps, the
// bench's MLP, attention and transformer block, Llama's decode, and the optimizers' foreach
// ops (views and detach first: a third of a training step's ops).
#define AE_UNBOXED_OPS(X) \
   X(view) X(_unsafe_view) X(detach) X(_local_scalar_dense) X(t) X(transpose_int) X(permute) \
   X(expand) X(slice_Tensor) X(select_int) X(unsqueeze) X(squeeze_dim) X(alias) X(as_strided) \
   X(split_Tensor) X(split_with_sizes) X(unbind_int) X(add_Tensor) X(add__Tensor) \
   X(add_Scalar) X(sub_Tensor) X(rsub_Scalar) X(mul_Tensor) X(mul__Tensor) X(mul_Scalar) \
   X(div_Tensor) X(div_Scalar) X(neg) X(pow_Tensor_Scalar) X(rsqrt) X(sqrt) X(exp) X(tanh) \
   X(sigmoid) X(silu) X(relu) X(gelu) X(mean_dim) X(sum_dim_IntList) X(addmm) X(mm) X(bmm) \
   X(baddbmm) X(native_layer_norm) X(native_layer_norm_backward) X(embedding) \
   X(embedding_dense_backward) X(cat) X(_softmax) X(_softmax_backward_data) X(_log_softmax) \
   X(_log_softmax_backward_data) X(nll_loss_forward) X(nll_loss_backward) \
   X(_scaled_dot_product_flash_attention_for_cpu) \
   X(_scaled_dot_product_flash_attention_for_cpu_backward) X(tanh_backward) X(gelu_backward) \
   X(silu_backward) X(threshold_backward) X(sigmoid_backward) X(arange) X(arange_start) \
   X(ne_Scalar) X(eq_Scalar) X(gt_Scalar) X(lt_Scalar) X(all) X(cumsum) X(ones_like) \
   X(zeros_like) X(empty_like) X(empty_memory_format) X(empty_strided) X(clone) X(copy_) \
   X(fill__Scalar) X(zero_) X(_to_copy) X(lift_fresh) X(where_self) X(masked_fill_Scalar) \
   X(index_Tensor) X(index_select) X(argmax) X(constant_pad_nd) X(mse_loss) \
   X(mse_loss_backward) X(bitwise_not) X(_foreach_mul__Scalar) X(_foreach_mul__Tensor) \
   X(_foreach_mul__List) X(_foreach_add__Tensor) X(_foreach_add__Scalar) X(_foreach_add__List) \
   X(_foreach_sub__Scalar) X(_foreach_lerp__Scalar) X(_foreach_addcmul__Scalar) \
   X(_foreach_addcdiv__ScalarList) X(_foreach_addcdiv__Scalar) X(_foreach_sqrt) \
   X(_foreach_div__ScalarList) X(_foreach_div__List) X(_foreach_neg) X(scalar_tensor) \
   X(index_copy_) X(isin_Tensor_Tensor) X(full) X(bitwise_or_Tensor) X(cos) X(sin) X(any_dim) \
   X(bitwise_and_Tensor) X(max) X(le_Tensor) X(any) X(zeros) X(ones) X(ne_Tensor) \
   X(sub__Tensor) X(mul__Scalar) X(add__Scalar) X(div__Tensor) X(div__Scalar) X(sum) X(mean) \
   X(abs) X(le_Scalar) X(ge_Scalar) X(squeeze) X(squeeze_dims) X(masked_fill__Scalar) X(relu_) \
   X(exp_) X(stack)

}  // namespace

std::unique_ptr<torch::Library> register_unboxed() {
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", kKey,
                                                  __FILE__, __LINE__);
#define AE_ADD(op) add_unboxed<at::_ops::op>(*library);
  AE_UNBOXED_OPS(AE_ADD)
#undef AE_ADD
  return library;
}

int64_t unboxed_op_count() {
#define AE_ONE(op) +1
  return 0 AE_UNBOXED_OPS(AE_ONE);
#undef AE_ONE
}

}  // namespace adaptive_eager
