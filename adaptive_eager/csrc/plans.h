// The segments C++ knows (Note [The C++ hot path] in hot_path.cpp, Note [Cold plans] in
// plans.cpp): what Python registers, as plain C++ data, and the tries the hot path walks.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace adaptive_eager {

constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;
inline const c10::DispatchKeySet kBelow(c10::DispatchKeySet::FULL_AFTER, kKey);
// Note [Below ADInplaceOrView] (intercept.cpp): what ops the runtime runs itself exclude.
inline const c10::DispatchKeySet kHidden =
    c10::autograd_dispatch_keyset_with_ADInplaceOrView | c10::DispatchKeySet(kKey);

enum class Kind : int8_t { Fusible = 0, View = 1, Mutating = 2 };

struct Ref {
  int32_t op;      // -1: the segment's external input `index`
  int32_t index;   // else output `index` of op `op`
  bool operator==(const Ref& other) const { return op == other.op && index == other.index; }
  bool operator<(const Ref& other) const {
    return op < other.op || (op == other.op && index < other.index);
  }
};

struct Meta {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
  c10::Device device{c10::kCPU};
  at::TensorOptions options() const { return at::TensorOptions().dtype(dtype).device(device); }
  bool operator==(const Meta& o) const {
    return sizes == o.sizes && strides == o.strides && dtype == o.dtype && device == o.device;
  }
};

struct TensorSpec {
  Ref ref;
  Meta meta;
  bool aligned;
  bool operator==(const TensorSpec& o) const {
    return ref == o.ref && meta == o.meta && aligned == o.aligned;
  }
};

struct ArgSpec {
  // WrappedNumber: a Python number passed for a Tensor argument (a 0-dim CPU tensor marked
  // as such, which Python's engine sees and keys as the number: 2.0 in x * 2.0).
  // Lifted: a float, or a list of them, that is no key part but the external inputs
  // `lifted` (0-dim float64 tensors; Note [Lifted scalars] in runtime/scalars.py).
  enum Type : int8_t { Value, Tensor, TensorList, WrappedNumber, Lifted } type;
  c10::IValue value;          // Value (the schema default where omitted), WrappedNumber
  std::vector<std::optional<TensorSpec>> tensors;  // Tensor: one; TensorList: each (None)
  std::vector<int32_t> lifted;                     // Lifted: the input of each float
  bool lifted_list = false;                        // Lifted: a list of floats
  bool lifted_wrapped = false;   // Lifted: a float passed for a Tensor (a wrapped number)
};

struct OpSpec {
  int64_t node_id;                 // Python's trie node: equal ids, equal calls (kernels)
  c10::OperatorHandle op;
  Kind kind;
  std::vector<ArgSpec> args;       // one per schema argument
  std::vector<Meta> outs;          // Fusible: its flat outputs
  bool list_return = false;        // Fusible: returns one Tensor[]
  std::vector<int> returned_args;  // Mutating: the schema argument each return is
  std::vector<int> written_lists;  // foreach in-place: lists whose versions eager bumps
  bool extern_op = false;          // a library kernel (matmul...): Note [Predicted saving]
};

// The same call (a cold plan's node is shared by every plan whose path has it)?
bool same_call(const OpSpec& a, const OpSpec& b);
// Does `actual` equal the recorded `spec` exactly (doubles bitwise)?
bool same_value(const c10::IValue& spec, const c10::IValue& actual);

struct Context {
  c10::ScalarType default_dtype;
  bool grad, inference, autocast_cpu, autocast_cuda, deterministic;
  c10::ScalarType autocast_cpu_dtype;
  bool operator==(const Context& o) const {
    return default_dtype == o.default_dtype && grad == o.grad && inference == o.inference &&
           autocast_cpu == o.autocast_cpu && autocast_cuda == o.autocast_cuda &&
           deterministic == o.deterministic && autocast_cpu_dtype == o.autocast_cpu_dtype;
  }
};

Context current_context();

// A Python object that may be released on any thread (the GIL taken), or leaked at exit.
struct PyRef {
  PyObject* obj = nullptr;
  explicit PyRef(pybind11::handle h) : obj(h.inc_ref().ptr()) {}
  PyRef(const PyRef&) = delete;
  ~PyRef();
};

// What a plan's runs measured since Python last took them (take_plan_counts): a cold
// plan's runs, a kernel's launches from C++ alone (Note [Launching from C++] in
// runtime/direct_call.py).
struct PlanCounts {
  int64_t runs = 0;          // cold: ended on this plan, its live outputs those of its key
  int64_t misses = 0;        // walked its path and ended elsewhere (Note [Cold plans])
  double wall_s = 0.0;       // of the runs, in all
  double last_s = 0.0;       // of the last one
  double compute_s = std::numeric_limits<double>::infinity();   // least of one run, in ops
  double fusible_s = std::numeric_limits<double>::infinity();   // of that, outside extern ops
};

// A kernel's generated C++ code, called with data pointers (Note [Launching from C++]).
constexpr size_t kMaxDirectArguments = 16;
struct DirectKernel {
  void* function;                  // extern "C" void kernel(T0*, T1*, ...)
  std::vector<int> arguments;      // per pointer, the index in [inputs..., buffers...]
};

// One registered segment: a kernel's (deferred, then launched) or a cold key's (run per-op
// and counted).
struct Plan {
  int64_t handle;
  bool cold;
  Context context;
  std::vector<OpSpec> ops;
  std::vector<Ref> live;            // kernel: the outputs it writes, in its buffers' order;
                                    // cold: the key's live outputs
  std::vector<Ref> final_results;   // Note [Results thrown away] (runtime/segment.py)
  bool mutates;
  std::vector<int32_t> written_inputs;   // inputs its in-place ops write (Segment.written_inputs)
  std::shared_ptr<PyRef> segment;   // Python's Segment, for takeover
  mutable std::mutex counts_mutex;
  mutable PlanCounts counts;
  // Set once, when Python found the kernel's code callable from here (plan_direct).
  mutable std::atomic<const DirectKernel*> direct{nullptr};
  mutable std::unique_ptr<DirectKernel> direct_owned;
};

struct Node {
  const OpSpec* spec = nullptr;     // the call that leads here (root: none)
  std::vector<std::unique_ptr<Node>> children;
  std::vector<const Plan*> plans;   // ending here
  const Plan* any_plan = nullptr;   // a plan through here (its path is this node's)
  int depth = 0;
  // A kernel path's first call: deferred runs started here, and how many were launched
  // (Note [Paths that lead nowhere] in hot_path.cpp).
  mutable std::atomic<int64_t> starts{0}, launches{0}, passed{0};
};

using Roots = std::vector<std::pair<Context, std::unique_ptr<Node>>>;

struct Trie {
  std::vector<std::shared_ptr<const Plan>> plans;
  Roots kernel_roots;    // kernels' paths, merged by Python's node ids
  Roots cold_roots;      // cold plans' paths, merged by equal calls
};

// This thread's snapshot of the registered plans (nullptr: none).
const std::shared_ptr<const Trie>& current_trie();
const Node* root_for(const Roots& roots, const Context& context);

// Run the first `depth` ops of `plan` per-op on `inputs` (replay.cpp), and copy the values
// of `targets` into their tensors; the seconds spent inside the ops.
double replay_per_op(const Plan& plan, size_t depth, const std::vector<at::Tensor>& inputs,
                     const std::vector<std::pair<Ref, at::Tensor>>& targets);

// plan_add, plan_remove, plan_clear, plan_direct, take_plan_counts.
void define_plans(pybind11::module& m);

}  // namespace adaptive_eager
