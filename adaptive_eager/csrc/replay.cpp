// Running a plan's recorded ops per-op from C++, as runtime/graph.py's run_eagerly does: the
// per-op runs of a kernel on trial (Note [Side by side] in runtime/profit.py), which the C++
// hot path used to hand to Python's engine, at ~25 us an op, for segments whose ops take a
// few microseconds.
#include "plans.h"

#include <ATen/ScalarOps.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <chrono>

namespace adaptive_eager {
namespace {

using Values = std::vector<std::vector<at::Tensor>>;   // per op, its flat outputs

const at::Tensor& tensor_at(const TensorSpec& spec, const std::vector<at::Tensor>& inputs,
                            const Values& values) {
  return spec.ref.op < 0 ? inputs.at(spec.ref.index)
                         : values.at(spec.ref.op).at(spec.ref.index);
}

// What the Python arg parser makes of a number passed for a Tensor (x * 2.0).
at::Tensor wrapped_number(const c10::IValue& value) {
  at::Tensor t = at::scalar_to_tensor(value.toScalar());
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

// Note [Lifted scalars] (runtime/scalars.py): the floats are the run's inputs.
// Read in place (0-dim float64 CPU tensors): an item() op would come back to interception.
// One passed for a Tensor argument is passed on as eager passed it, a wrapped number.
c10::IValue lifted_value(const ArgSpec& spec, const std::vector<at::Tensor>& inputs) {
  auto value = [&](int32_t input) { return *inputs.at(input).const_data_ptr<double>(); };
  if (spec.lifted_wrapped) return wrapped_number(value(spec.lifted[0]));
  if (!spec.lifted_list) return value(spec.lifted[0]);
  c10::List<double> list;
  for (int32_t input : spec.lifted) list.push_back(value(input));
  return list;
}

bool optional_items(const c10::Argument& argument) {
  auto list = argument.real_type()->cast<c10::ListType>();
  return list && list->getElementType()->kind() == c10::OptionalType::Kind;
}

c10::IValue argument_value(const ArgSpec& spec, const c10::Argument& argument,
                           const std::vector<at::Tensor>& inputs, const Values& values) {
  switch (spec.type) {
    case ArgSpec::Value: return spec.value;
    case ArgSpec::WrappedNumber: return wrapped_number(spec.value);
    case ArgSpec::Tensor: return tensor_at(*spec.tensors[0], inputs, values);
    case ArgSpec::Lifted: return lifted_value(spec, inputs);
    case ArgSpec::TensorList: break;
  }
  if (optional_items(argument)) {
    c10::List<std::optional<at::Tensor>> list;
    for (const auto& item : spec.tensors)
      list.push_back(item ? std::optional<at::Tensor>(tensor_at(*item, inputs, values))
                          : std::nullopt);
    return list;
  }
  c10::List<at::Tensor> list;
  for (const auto& item : spec.tensors) list.push_back(tensor_at(*item, inputs, values));
  return list;
}

std::vector<at::Tensor> flat_outputs(const torch::jit::Stack& stack) {
  std::vector<at::Tensor> flat;
  for (const c10::IValue& value : stack) {
    if (value.isTensor()) {
      flat.push_back(value.toTensor());
    } else if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorVector()) flat.push_back(t);
    } else {
      flat.emplace_back();
    }
  }
  return flat;
}

}  // namespace

double replay_per_op(const Plan& plan, size_t depth, const std::vector<at::Tensor>& inputs,
                     const std::vector<std::pair<Ref, at::Tensor>>& targets) {
  c10::impl::ExcludeDispatchKeyGuard guard(kHidden);   // Note [Below ADInplaceOrView]
  Values values(depth);
  double seconds = 0.0;
  for (size_t i = 0; i < depth; ++i) {
    const OpSpec& spec = plan.ops[i];
    const auto& arguments = spec.op.schema().arguments();
    torch::jit::Stack stack;
    stack.reserve(spec.args.size());
    for (size_t a = 0; a < spec.args.size(); ++a)
      stack.push_back(argument_value(spec.args[a], arguments[a], inputs, values));
    auto started = std::chrono::steady_clock::now();
    spec.op.callBoxed(stack);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (spec.kind != Kind::Mutating) values[i] = flat_outputs(stack);
  }
  for (const auto& [ref, target] : targets) {
    at::Tensor value = tensor_at(TensorSpec{ref, Meta{}, true}, inputs, values);
    target.copy_(value);
  }
  return seconds;
}

}  // namespace adaptive_eager
