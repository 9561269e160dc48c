// Note [The C++ hot path]
// Deferring the ops of a compiled segment cost ~26 us an op in Python (encode the call, walk
// the trie, allocate, register outputs), four times a tiny op itself, so fused kernels only
// paid on large tensors. Here the same walk runs in C++ on the fallback's stack, without the
// GIL, for segments whose kernel is settled (judged profitable, off probation: Python
// registers them with plan_add, runtime/native_plans.py). Per op: match the call against the
// children of the current node (operator, every argument: tensors by where they come from in
// the segment and by shape, strides, dtype, device and alignment; other values exactly), and
// leave it deferred as Python's engine does (runtime/engine.py, _defer): views run on the
// deferred tensors, computing ops return fresh empty tensors, in-place ops return what they
// write. Python is called once per segment: launch(handle, inputs, buffers, seconds) runs the
// kernel. Everything else goes back to Python's engine whole, by takeover(segment, depth,
// inputs, outputs): a run that cannot end fused (other live outputs, aliased inputs, a kernel
// that failed or was dropped meanwhile) becomes the Python engine's own deferred run, which
// replays it and records on. So the rare paths have one implementation, in Python.
//
// Liveness is Python's (Note [Liveness] in runtime/segment.py): outputs are held weakly, by
// their TensorImpl and their storage; an output is live while either survives (a view or
// autograd's shallow copy holds the storage: Note [Shallow copies]).
#include "hot_path.h"
#include "plans.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <ATen/record_function.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace py = pybind11;
using c10::DispatchKeySet;
using c10::IValue;

namespace adaptive_eager {
namespace {

constexpr int64_t kAlignmentBytes = 16;

std::atomic<int64_t> g_ops_deferred{0}, g_fused_runs{0}, g_fused_ops{0}, g_takeovers{0};
std::atomic<int64_t> g_cold_runs{0}, g_cold_ops{0}, g_cold_misses{0}, g_direct_runs{0};
std::atomic<int64_t> g_per_op_ops{0};           // replayed per-op for a trial
PyObject* g_launch = nullptr;                   // launch(handle, inputs, buffers, seconds)
PyObject* g_takeover = nullptr;                 // takeover(segment, depth, inputs, outputs)
PyObject* g_harvest = nullptr;                  // harvest(): take the cold plans' counts
PyObject* g_ran_per_op = nullptr;               // ran_per_op(handle, seconds): a trial's run
// A thread harvests after this many cold runs, or this much of their wall time, whichever
// comes first (native_plans.HARVEST_EVERY, HARVEST_AFTER_S).
std::atomic<int64_t> g_harvest_every{64};
std::atomic<double> g_harvest_after_s{0.002};
PyObject* g_retry = nullptr;                    // on_op's answer: a segment just ended here
// Storages of tensors that share a numpy array's memory (Note [Outside memory]): by address.
std::mutex g_outside_mutex;
std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> g_outside;
std::atomic<bool> g_any_outside{false};
std::atomic<bool> g_off{false};                 // a forked child: Python's engine only

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl>;
using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

struct Output {                     // a computing op's output, held weakly (Note [Liveness])
  Ref ref;
  WeakImpl impl;
  WeakStorage storage;
  bool pooled;                      // its storage is the pool's (which holds one reference)
  // A later computing op returned a tensor on this storage (a cold run's _unsafe_view of a
  // bmm): that tensor holds it, not a copy of this one (runtime/segment.py, _watch_storage).
  bool storage_taken = false;
};

// The memory of large deferred outputs, reused once nothing but the pool refers to it, as
// runtime/buffers.py does for Python's hot path (page faults of fresh memory cost as much
// as a kernel). Per thread, CPU only; up to g_pool_limit bytes.
constexpr int64_t kMinPooledBytes = 1 << 20;
constexpr size_t kMaxPerSize = 4;
std::atomic<int64_t> g_pool_limit{0};
struct Pool {
  std::map<int64_t, std::vector<c10::Storage>> slots;   // by size in bytes
  int64_t held = 0;
};
thread_local Pool t_pool;

int64_t storage_bytes(const Meta& meta) {
  int64_t span = 1;
  for (size_t i = 0; i < meta.sizes.size(); ++i) {
    if (meta.sizes[i] == 0) return 0;
    span += (meta.sizes[i] - 1) * meta.strides[i];
  }
  return span * static_cast<int64_t>(c10::elementSize(meta.dtype));
}

// An uninitialized tensor like `meta`; `pooled` says whether its storage is the pool's.
at::Tensor empty_like_meta(const Meta& meta, bool& pooled) {
  pooled = false;
  int64_t nbytes = storage_bytes(meta);
  if (nbytes < kMinPooledBytes || !meta.device.is_cpu() ||
      g_pool_limit.load(std::memory_order_relaxed) <= 0)
    return at::empty_strided(meta.sizes, meta.strides, meta.options());
  auto& slots = t_pool.slots[nbytes];
  for (const c10::Storage& storage : slots) {
    if (storage.use_count() == 1) {
      pooled = true;
      at::AutoDispatchBelowADInplaceOrView below;     // a fresh tensor: version 0
      return at::empty({0}, meta.options()).set_(storage, 0, meta.sizes, meta.strides);
    }
  }
  at::Tensor fresh = at::empty_strided(meta.sizes, meta.strides, meta.options());
  if (slots.size() < kMaxPerSize && t_pool.held + nbytes <= g_pool_limit.load()) {
    slots.push_back(fresh.storage());
    t_pool.held += nbytes;
    pooled = true;
  }
  return fresh;
}

// Up to 6 dimensions without a heap allocation: an output's layout is kept per op.
using Dims = c10::SmallVector<int64_t, 6>;

struct Layout {
  int64_t offset;
  Dims sizes, strides;
  c10::ScalarType dtype;
  bool operator==(const Layout& o) const {
    return offset == o.offset && sizes == o.sizes && strides == o.strides && dtype == o.dtype;
  }
};

Layout layout_of(const at::Tensor& t) {
  return Layout{t.storage_offset(), Dims(t.sizes().begin(), t.sizes().end()),
                Dims(t.strides().begin(), t.strides().end()), t.scalar_type()};
}

// An output's place in memory, to know its unseen aliases (Note [Shallow copies]).
struct Placed {
  const c10::StorageImpl* storage;   // valid while the output's weak references hold it
  Layout layout;
  Ref ref;
};

struct Run {
  std::shared_ptr<const Trie> trie;   // the snapshot the run walks (plans stay alive)
  const Node* node = nullptr;
  bool cold = false;                  // on a cold plan's path: its ops run at once
  double compute_s = 0.0, extern_s = 0.0;   // cold: inside its ops, and extern ones
  std::vector<at::Tensor> inputs;
  // Flat vectors, searched from the newest (a segment has at most MAX_SEGMENT_OPS ops): no
  // allocation per op once a thread's run has grown to its segments' size.
  std::vector<std::pair<const c10::TensorImpl*, Ref>> known;   // valid: weakly held below
  std::vector<WeakImpl> outputs;                           // every op's, flat (takeover)
  std::vector<int32_t> first_output;                       // per op, its first in outputs
  std::vector<Output> computed;                            // what kernels write
  std::vector<Placed> placed;
  std::chrono::steady_clock::time_point started;

  const Ref* known_ref(const c10::TensorImpl* impl) const {
    for (auto it = known.rbegin(); it != known.rend(); ++it)
      if (it->first == impl) return &it->second;
    return nullptr;
  }
  const WeakImpl& output(Ref ref) const { return outputs[first_output[ref.op] + ref.index]; }
  int32_t outputs_of(size_t op) const {
    size_t end = op + 1 < first_output.size() ? first_output[op + 1] : outputs.size();
    return static_cast<int32_t>(end - first_output[op]);
  }

  void clear() {
    trie.reset();
    node = nullptr;
    inputs.clear();
    known.clear();
    outputs.clear();
    first_output.clear();
    computed.clear();
    placed.clear();
    cold = false;
    compute_s = extern_s = 0.0;
  }
};

thread_local Run t_run;
thread_local bool t_open = false;       // Python's engine has a segment open on this thread
thread_local int64_t t_runs_since_harvest = 0;      // cold runs and direct launches
thread_local double t_run_s_since_harvest = 0.0;
thread_local bool t_hot = false;        // this thread's runtime runs on C++ (not a thread
                                        // that only inherited the key, e.g. autograd's)

// ------------------------------------------------------------------ matching

bool same_number(const IValue& spec, const at::Tensor& t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->is_wrapped_number() || !t.is_cpu()) return false;
  switch (t.scalar_type()) {    // read in place: an item() op would come back here
    case c10::kDouble: return same_value(spec, IValue(*t.const_data_ptr<double>()));
    case c10::kLong: return same_value(spec, IValue(*t.const_data_ptr<int64_t>()));
    case c10::kBool: return same_value(spec, IValue(*t.const_data_ptr<bool>()));
    case c10::kComplexDouble:
      return same_value(spec, IValue(*t.const_data_ptr<c10::complex<double>>()));
    default: return false;
  }
}

bool shares_outside_memory(const at::Tensor& t) {
  if (!g_any_outside.load(std::memory_order_relaxed) || !t.has_storage()) return false;
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(g_outside_mutex);
  for (const auto& weak : g_outside)
    if (!weak.expired() && weak._unsafe_get_target() == storage) return true;
  return false;
}

// A call's new external inputs, committed only when the whole call matched.
using Pending = c10::SmallVector<at::Tensor, 4>;   // (no allocation per op)

std::optional<Ref> ref_of(Run& run, const at::Tensor& t, const Pending& pending) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (const Ref* found = run.known_ref(impl)) return *found;
  for (size_t i = 0; i < pending.size(); ++i)
    if (pending[i].unsafeGetTensorImpl() == impl)
      return Ref{-1, static_cast<int32_t>(run.inputs.size() + i)};
  if (t.has_storage()) {      // Note [Shallow copies]: an unseen alias of an output
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    bool on_output = false;
    std::optional<Layout> layout;
    for (const Placed& place : run.placed) {
      if (place.storage != storage) continue;
      on_output = true;
      if (!layout) layout = layout_of(t);
      if (place.layout == *layout) return place.ref;
    }
    if (on_output) return std::nullopt;   // other memory of an output, made by no op
  }
  return Ref{-2, 0};          // new
}

bool tensor_matches(Run& run, const TensorSpec& spec, const at::Tensor& t, Pending& pending) {
  if (!t.defined() || t.layout() != c10::kStrided || t.is_quantized() ||
      t.unsafeGetTensorImpl()->is_python_dispatch())
    return false;
  if (t.scalar_type() != spec.meta.dtype || t.device() != spec.meta.device ||
      t.sizes() != c10::IntArrayRef(spec.meta.sizes) ||
      t.strides() != c10::IntArrayRef(spec.meta.strides))
    return false;
  int64_t offset = t.storage_offset();
  bool aligned = offset == 0 || (offset * static_cast<int64_t>(t.element_size())) %
                                        kAlignmentBytes == 0;
  if (aligned != spec.aligned) return false;
  auto ref = ref_of(run, t, pending);
  if (!ref) return false;
  if (ref->op == -2) {        // a new external input: the next number, plain memory
    Ref next{-1, static_cast<int32_t>(run.inputs.size() + pending.size())};
    if (!(next == spec.ref) || shares_outside_memory(t)) return false;
    pending.push_back(t);
    return true;
  }
  return *ref == spec.ref;
}

bool call_matches(Run& run, const OpSpec& spec, const c10::OperatorHandle& op,
                  torch::jit::Stack* stack, Pending& pending) {
  if (!(spec.op == op)) return false;
  auto args = torch::jit::last(*stack, spec.args.size());
  for (size_t i = 0; i < spec.args.size(); ++i) {
    const ArgSpec& arg = spec.args[i];
    const IValue& value = args[i];
    switch (arg.type) {
      case ArgSpec::Value:
        if (!same_value(arg.value, value)) return false;
        break;
      case ArgSpec::Tensor:
        if (!value.isTensor() || !tensor_matches(run, *arg.tensors[0], value.toTensor(), pending))
          return false;
        break;
      case ArgSpec::WrappedNumber:
        if (!value.isTensor() || !same_number(arg.value, value.toTensor())) return false;
        break;
      case ArgSpec::TensorList: {
        if (!value.isList()) return false;
        auto items = value.toListRef();
        if (items.size() != arg.tensors.size()) return false;
        for (size_t k = 0; k < items.size(); ++k) {
          const auto& item_spec = arg.tensors[k];
          if (!item_spec) {
            if (!items[k].isNone()) return false;
          } else if (!items[k].isTensor() ||
                     !tensor_matches(run, *item_spec, items[k].toTensor(), pending)) {
            return false;
          }
        }
        break;
      }
    }
  }
  return true;
}

// ------------------------------------------------------------------ deferring

void remember_output(Run& run, const at::Tensor& t, Ref ref, bool computed, bool pooled) {
  run.known.emplace_back(t.unsafeGetTensorImpl(), ref);
  run.outputs.emplace_back(t.getIntrusivePtr());
  if (!t.has_storage()) return;
  WeakStorage storage = t.storage().getWeakStorageImpl();
  run.placed.push_back(Placed{t.storage().unsafeGetStorageImpl(), layout_of(t), ref});
  if (!computed) return;
  const c10::StorageImpl* place = t.storage().unsafeGetStorageImpl();
  for (Output& earlier : run.computed)
    earlier.storage_taken |= earlier.storage._unsafe_get_target() == place;
  run.computed.push_back(Output{ref, WeakImpl(t.getIntrusivePtr()), storage, pooled});
}

// A matched call's new external inputs join the run.
void commit_inputs(Run& run, Pending& pending) {
  for (auto& t : pending) {
    run.known.emplace_back(t.unsafeGetTensorImpl(),
                           Ref{-1, static_cast<int32_t>(run.inputs.size())});
    run.inputs.push_back(std::move(t));
  }
}

void defer(Run& run, const Node& node, const c10::OperatorHandle& op, DispatchKeySet ks,
           torch::jit::Stack* stack, Pending& pending) {
  commit_inputs(run, pending);
  const OpSpec& spec = *node.spec;
  const int32_t index = node.depth - 1;
  run.first_output.push_back(static_cast<int32_t>(run.outputs.size()));
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  if (spec.kind == Kind::View) {          // metadata only: safe on unfilled buffers
    op.redispatchBoxed(ks & kBelow, stack);
    auto returns = torch::jit::last(*stack, op.schema().returns().size());
    int32_t k = 0;
    for (const IValue& value : returns) {
      if (value.isTensor()) {
        remember_output(run, value.toTensor(), Ref{index, k++}, false, false);
      } else if (value.isTensorList()) {
        for (const at::Tensor& t : value.toTensorVector())
          remember_output(run, t, Ref{index, k++}, false, false);
      }
    }
  } else if (spec.kind == Kind::Fusible) {
    torch::jit::drop(*stack, spec.args.size());
    c10::SmallVector<at::Tensor, 4> outs;
    for (size_t k = 0; k < spec.outs.size(); ++k) {
      bool pooled;
      outs.push_back(empty_like_meta(spec.outs[k], pooled));
      remember_output(run, outs.back(), Ref{index, static_cast<int32_t>(k)}, true, pooled);
    }
    if (spec.list_return) {
      stack->emplace_back(
          c10::List<at::Tensor>(std::vector<at::Tensor>(outs.begin(), outs.end())));
    } else {
      for (auto& t : outs) stack->emplace_back(std::move(t));
    }
  } else {                                // Mutating: returns what it writes
    auto args = torch::jit::last(*stack, spec.args.size());
    for (int position : spec.written_lists)
      for (const at::Tensor& t : args[position].toTensorVector())
        if (!t.is_inference()) torch::autograd::impl::bump_version(t);
    std::vector<IValue> returns;
    for (int position : spec.returned_args) returns.push_back(args[position]);
    torch::jit::drop(*stack, spec.args.size());
    for (auto& value : returns) stack->push_back(std::move(value));
  }
  run.node = &node;
  g_ops_deferred.fetch_add(1, std::memory_order_relaxed);
}

// ------------------------------------------------------------------ cold runs

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Note [Cold plans] (plans.cpp): the op runs now, as Python's cold path runs it (its thread
// state, then the version bumps eager makes for foreach in-place ops: runtime/engine.py,
// _run_cold), timed; its outputs are remembered so later calls of the path match.
void run_cold(Run& run, const Node& node, const c10::OperatorHandle& op, DispatchKeySet ks,
              torch::jit::Stack* stack, Pending& pending) {
  commit_inputs(run, pending);
  const OpSpec& spec = *node.spec;
  const int32_t index = node.depth - 1;
  run.first_output.push_back(static_cast<int32_t>(run.outputs.size()));
  std::vector<at::Tensor> written;
  if (!spec.written_lists.empty()) {
    auto args = torch::jit::last(*stack, spec.args.size());
    for (int position : spec.written_lists)
      for (const at::Tensor& t : args[position].toTensorVector()) written.push_back(t);
  }
  auto started = std::chrono::steady_clock::now();
  {
    c10::impl::ExcludeDispatchKeyGuard guard(kHidden);   // Note [Below ADInplaceOrView]
    op.redispatchBoxed(ks & kBelow, stack);
  }
  double seconds = seconds_since(started);
  run.compute_s += seconds;
  if (spec.extern_op) run.extern_s += seconds;
  for (const at::Tensor& t : written)
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
  if (spec.kind != Kind::Mutating) {      // a mutating op returns tensors the run knows
    auto returns = torch::jit::last(*stack, op.schema().returns().size());
    const bool computed = spec.kind == Kind::Fusible;
    int32_t k = 0;
    for (const IValue& value : returns) {
      if (value.isTensor()) {
        remember_output(run, value.toTensor(), Ref{index, k++}, computed, false);
      } else if (value.isTensorList()) {
        for (const at::Tensor& t : value.toTensorVector())
          remember_output(run, t, Ref{index, k++}, computed, false);
      }
    }
  }
  run.node = &node;
  g_cold_ops.fetch_add(1, std::memory_order_relaxed);
}

bool advance(Run& run, const c10::OperatorHandle& op, DispatchKeySet ks,
             torch::jit::Stack* stack) {
  Pending pending;
  for (const auto& child : run.node->children) {
    pending.clear();
    if (call_matches(run, *child->spec, op, stack, pending)) {
      if (run.cold) run_cold(run, *child, op, ks, stack, pending);
      else defer(run, *child, op, ks, stack, pending);
      return true;
    }
  }
  return false;
}

// ------------------------------------------------------------------ ending a run

const Meta& meta_of(const Plan& plan, Ref ref) { return plan.ops[ref.op].outs[ref.index]; }

// The tensor a kernel writes `ref` into: the output itself, the whole output rebuilt on the
// storage a view or shallow copy keeps, or (dead, but in the kernel's live set) a fresh one.
// Is something else than the pool holding the storage of a dead output (a view, autograd's
// shallow copy)?
bool held_elsewhere(const Output& out) {
  if (out.storage_taken) return false;
  auto storage = out.storage.lock();
  return storage && storage.use_count() > (out.pooled ? 2u : 1u);   // (the pool's, this lock)
}

at::Tensor buffer_for(const Run& run, const Plan& plan, Ref ref) {
  for (const Output& out : run.computed) {
    if (!(out.ref == ref)) continue;
    if (auto impl = out.impl.lock()) return at::Tensor(std::move(impl));
    if (held_elsewhere(out)) {
      auto storage = out.storage.lock();
      const Meta& meta = meta_of(plan, ref);
      return at::empty({0}, meta.options())
          .set_(c10::Storage(std::move(storage)), 0, meta.sizes, meta.strides);
    }
    break;
  }
  bool pooled;
  return empty_like_meta(meta_of(plan, ref), pooled);
}

std::vector<Ref> live_refs(const Run& run) {
  std::vector<Ref> live;
  for (const Output& out : run.computed)
    if (!out.impl.expired() || held_elsewhere(out)) live.push_back(out.ref);
  const auto& ending = run.node->plans;          // their path is the run's
  if (live.empty() && !ending.empty() && !ending.front()->mutates)
    live = ending.front()->final_results;
  std::sort(live.begin(), live.end());
  return live;
}

const Plan* plan_for(const Node& node, const std::vector<Ref>& live) {
  const Plan* superset = nullptr;
  for (const Plan* plan : node.plans) {
    std::vector<Ref> writes(plan->live.begin(), plan->live.end());
    std::sort(writes.begin(), writes.end());
    if (writes == live) return plan;
    if (!superset && std::includes(writes.begin(), writes.end(), live.begin(), live.end()))
      superset = plan;
  }
  return superset;
}

bool inputs_share_memory(const std::vector<at::Tensor>& inputs) {
  bool any_view = false;
  for (const auto& t : inputs) any_view = any_view || t.is_view();
  if (!any_view) return false;
  std::vector<const void*> storages;
  for (const auto& t : inputs) storages.push_back(t.storage().unsafeGetStorageImpl());
  std::sort(storages.begin(), storages.end());
  return std::adjacent_find(storages.begin(), storages.end()) != storages.end();
}

py::list tensor_list(const std::vector<at::Tensor>& tensors) {
  py::list list(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i)
    list[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(tensors[i]));
  return list;
}

// Versions as eager left them (runtime/engine.py, _run_kernel).
struct KeepVersions {
  std::vector<std::pair<at::Tensor, uint32_t>> saved;
  explicit KeepVersions(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    for (const auto* list : {&a, &b})
      for (const auto& t : *list)
        if (!t.is_inference()) saved.emplace_back(t, t.unsafeGetTensorImpl()->version_counter()
                                                         .current_version());
  }
  ~KeepVersions() {
    for (auto& [t, version] : saved) {
      c10::VariableVersion counter = t.unsafeGetTensorImpl()->version_counter();   // shared
      if (counter.current_version() != version) counter.set_version(version);
    }
  }
};

void count_for_harvest(double wall_s);

// Note [Launching from C++] (runtime/direct_call.py): the kernel's code called with the data
// pointers of the run's inputs and buffers, through a function pointer of as many pointer
// parameters (the generated code takes `const float*` and the like: the same registers).
using Caller = void (*)(void*, void* const*);

template <size_t... I>
void call_with(void* function, void* const* pointers, std::index_sequence<I...>) {
  using Function = void (*)(decltype((void)I, static_cast<void*>(nullptr))...);
  reinterpret_cast<Function>(function)(pointers[I]...);
}

template <size_t N>
void call_n(void* function, void* const* pointers) {
  call_with(function, pointers, std::make_index_sequence<N>{});
}

template <size_t... N>
constexpr std::array<Caller, sizeof...(N)> callers(std::index_sequence<N...>) {
  return {&call_n<N>...};
}

constexpr auto kCallers = callers(std::make_index_sequence<kMaxDirectArguments + 1>{});

// False when an argument index does not fit the run (the Python call takes over).
bool launch_direct(const Run& run, const Plan& plan, const DirectKernel& direct,
                   const std::vector<at::Tensor>& buffers) {
  void* pointers[kMaxDirectArguments];
  const size_t inputs = run.inputs.size();
  for (size_t i = 0; i < direct.arguments.size(); ++i) {
    const size_t index = static_cast<size_t>(direct.arguments[i]);
    if (index >= inputs + buffers.size()) return false;
    pointers[i] = (index < inputs ? run.inputs[index] : buffers[index - inputs]).data_ptr();
  }
  kCallers[direct.arguments.size()](direct.function, pointers);
  g_direct_runs.fetch_add(1, std::memory_order_relaxed);
  double wall_s = seconds_since(run.started);
  {
    std::lock_guard<std::mutex> lock(plan.counts_mutex);
    plan.counts.runs += 1;
    plan.counts.wall_s += wall_s;
    plan.counts.last_s = wall_s;
  }
  count_for_harvest(wall_s);
  return true;
}

// launch's answer (and Python's: native_plans._launch).
enum class Launched { Refused = 0, Fused = 1, PerOp = 2 };

Launched launch(Run& run, const Plan& plan) {
  std::vector<at::Tensor> buffers;
  buffers.reserve(plan.live.size());
  for (Ref ref : plan.live) buffers.push_back(buffer_for(run, plan, ref));
  const DirectKernel* direct = plan.direct.load(std::memory_order_acquire);
  if (direct != nullptr && !at::hasCallbacks() && launch_direct(run, plan, *direct, buffers))
    return Launched::Fused;          // (a profiler records: Python names the run)
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                 run.started).count();
  KeepVersions versions(run.inputs, buffers);
  py::gil_scoped_acquire gil;
  py::object inputs = tensor_list(run.inputs), outs = tensor_list(buffers);
  PyObject* result = PyObject_CallFunction(g_launch, "LOOd", static_cast<long long>(plan.handle),
                                           inputs.ptr(), outs.ptr(), seconds);
  if (result == nullptr) throw py::error_already_set();
  long answer = PyLong_AsLong(result);
  Py_DECREF(result);
  if (answer == -1 && PyErr_Occurred()) throw py::error_already_set();
  return static_cast<Launched>(answer);
}

// Note [Side by side] (runtime/profit.py): a kernel on trial wants this run per-op, timed.
void run_per_op(Run& run, const Plan& plan) {
  std::vector<std::pair<Ref, at::Tensor>> targets;
  std::vector<at::Tensor> written;
  for (Ref ref : live_refs(run)) {
    targets.emplace_back(ref, buffer_for(run, plan, ref));
    written.push_back(targets.back().second);
  }
  double seconds;
  {
    KeepVersions versions(run.inputs, written);   // eager bumped them when they were deferred
    seconds = replay_per_op(plan, run.node->depth, run.inputs, targets);
  }
  g_per_op_ops.fetch_add(run.node->depth, std::memory_order_relaxed);
  py::gil_scoped_acquire gil;
  PyObject* result = PyObject_CallFunction(g_ran_per_op, "Ld",
                                           static_cast<long long>(plan.handle), seconds);
  if (result == nullptr) throw py::error_already_set();
  Py_DECREF(result);
}

// An output as Python's engine must see it to judge it live: itself; for a computing op's
// output only something else holds (a view the program keeps in C++ alone, such as a
// gradient autograd accumulated, or a shallow copy), the whole output rebuilt on its storage,
// whose storage Python then watches (Note [Shallow copies]); else undefined (dead).
at::Tensor output_for_python(const Run& run, const Plan& plan, Ref ref) {
  if (auto impl = run.output(ref).lock()) return at::Tensor(std::move(impl));
  for (const Output& out : run.computed)
    if (out.ref == ref && held_elsewhere(out)) return buffer_for(run, plan, ref);
  return at::Tensor();
}

// Hand the run to Python's engine (see the Note): it replays or finishes it.
void take_over(Run& run) {
  g_takeovers.fetch_add(1, std::memory_order_relaxed);
  const Node& node = *run.node;
  std::shared_ptr<const Trie> keep = run.trie;     // the plan (and its segment) stay alive
  py::gil_scoped_acquire gil;
  py::object inputs = tensor_list(run.inputs);
  py::list outputs(run.first_output.size());
  for (size_t i = 0; i < run.first_output.size(); ++i) {
    py::list flat(run.outputs_of(i));
    for (int32_t k = 0; k < run.outputs_of(i); ++k) {
      Ref ref{static_cast<int32_t>(i), static_cast<int32_t>(k)};
      at::Tensor tensor = output_for_python(run, *node.any_plan, ref);
      flat[k] = tensor.defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(tensor))
                                 : py::none();
    }
    outputs[i] = flat;
  }
  run.clear();                 // Python alone holds them now: its weakrefs judge liveness
  PyObject* result = PyObject_CallFunction(g_takeover, "OiOO", node.any_plan->segment->obj,
                                           node.depth, inputs.ptr(), outputs.ptr());
  if (result == nullptr) throw py::error_already_set();
  Py_DECREF(result);
}

// The cold plan ending at the run's node whose key's live outputs are the run's.
const Plan* cold_plan_for(const Run& run) {
  if (run.node->plans.empty()) return nullptr;
  std::vector<Ref> live = live_refs(run);
  for (const Plan* plan : run.node->plans) {
    std::vector<Ref> key_live(plan->live.begin(), plan->live.end());
    std::sort(key_live.begin(), key_live.end());
    if (key_live == live) return plan;
  }
  return nullptr;
}

void harvest() {
  t_runs_since_harvest = 0;
  t_run_s_since_harvest = 0.0;
  if (g_harvest == nullptr) return;
  c10::impl::ExcludeDispatchKeyGuard guard(kHidden);
  py::gil_scoped_acquire gil;
  PyObject* result = PyObject_CallNoArgs(g_harvest);
  if (result == nullptr) throw py::error_already_set();
  Py_DECREF(result);
}

// A run Python has not seen: harvest now and then (native_plans.HARVEST_EVERY).
void count_for_harvest(double wall_s) {
  t_run_s_since_harvest += wall_s;
  if (++t_runs_since_harvest >= g_harvest_every.load(std::memory_order_relaxed) ||
      t_run_s_since_harvest >= g_harvest_after_s.load(std::memory_order_relaxed))
    harvest();
}

// Count the run against its plan, or as a miss of the path (Note [Cold plans]).
void end_cold_run(Run& run) {
  double wall_s = seconds_since(run.started);
  const Plan* plan = cold_plan_for(run);
  const Plan* charged = plan != nullptr ? plan : run.node->any_plan;
  {
    std::lock_guard<std::mutex> lock(charged->counts_mutex);
    PlanCounts& counts = charged->counts;
    if (plan != nullptr) {
      counts.runs += 1;
      counts.wall_s += wall_s;
      counts.compute_s = std::min(counts.compute_s, run.compute_s);
      counts.fusible_s = std::min(counts.fusible_s, run.compute_s - run.extern_s);
    } else {
      counts.misses += 1;
    }
  }
  (plan != nullptr ? g_cold_runs : g_cold_misses).fetch_add(1, std::memory_order_relaxed);
  run.clear();
  count_for_harvest(wall_s);
}

// The run being ended, swapped out of t_run: a flush that the kernel's own Python code sets
// off (an escape such as data_ptr) finds nothing deferred instead of ending it twice, and the
// swap keeps both runs' vectors for the next runs (no allocation per op once they have
// grown). A run ended inside the end of another is moved out instead.
thread_local Run t_ending;
thread_local bool t_ending_busy = false;

struct Ending {
  Run& run;
  bool spare;
  Ending(Run& run, bool spare) : run(run), spare(spare) { t_ending_busy |= spare; }
  ~Ending() {
    run.clear();
    if (spare) t_ending_busy = false;
  }
};

void end_run(Run& current) {
  if (current.node == nullptr) return;
  if (current.cold) return end_cold_run(current);
  Run moved;
  const bool spare = !t_ending_busy;
  Run& run = spare ? t_ending : moved;
  std::swap(run, current);
  Ending ending(run, spare);
  c10::impl::ExcludeDispatchKeyGuard guard(kHidden);
  if (run.node->depth == 0) return;
  const Plan* plan = plan_for(*run.node, live_refs(run));
  if (plan != nullptr && !(plan->mutates && inputs_share_memory(run.inputs))) {
    switch (launch(run, *plan)) {
      case Launched::Fused:
        g_fused_runs.fetch_add(1, std::memory_order_relaxed);
        g_fused_ops.fetch_add(run.node->depth, std::memory_order_relaxed);
        return;
      case Launched::PerOp:
        return run_per_op(run, *plan);
      case Launched::Refused:
        break;
    }
  }
  take_over(run);
}

}  // namespace

bool hot_path_op(const c10::OperatorHandle& op, DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!t_hot || g_off.load(std::memory_order_relaxed)) return false;
  Run& run = t_run;
  if (run.node != nullptr) {
    if (advance(run, op, ks, stack)) return true;
    end_run(run);                  // fused, or Python's now (which may open its segment)
  }
  if (t_open) return false;
  const auto& trie = current_trie();
  if (!trie) return false;
  const Context context = current_context();
  for (bool cold : {false, true}) {       // a settled kernel first
    const Node* root = root_for(cold ? trie->cold_roots : trie->kernel_roots, context);
    if (root == nullptr) continue;
    run.trie = trie;
    run.node = root;
    run.cold = cold;
    run.started = std::chrono::steady_clock::now();
    if (advance(run, op, ks, stack)) return true;
    run.clear();
  }
  return false;
}

bool is_retry(PyObject* answer) { return answer == g_retry && answer != nullptr; }

void define_hot_path(py::module& m) {
  define_plans(m);
  m.def("set_hot_callbacks", [](py::object launch, py::object takeover, py::object retry,
                                py::object harvest, py::object ran_per_op,
                                int64_t harvest_every, double harvest_after_s) {
    for (PyObject* old : {g_launch, g_takeover, g_retry, g_harvest, g_ran_per_op})
      Py_XDECREF(old);
    g_launch = launch.inc_ref().ptr();
    g_takeover = takeover.inc_ref().ptr();
    g_retry = retry.inc_ref().ptr();
    g_harvest = harvest.inc_ref().ptr();
    g_ran_per_op = ran_per_op.inc_ref().ptr();
    g_harvest_every = harvest_every > 0 ? harvest_every : 1;
    g_harvest_after_s = harvest_after_s;
  });
  m.def("hot_path_off", [] { g_off = true; },
        "For good, in this process (a forked child: no lock is taken, another thread of the "
        "parent may have held it).");
  m.def("set_pool_limit", [](int64_t bytes) { g_pool_limit = bytes; },
        "Bytes of large deferred outputs each thread may keep to reuse (BUFFER_POOL_MB).");
  m.def("pool_clear", [] {
    t_pool.slots.clear();
    t_pool.held = 0;
  }, "Give back this thread's pooled memory.");
  m.def("set_hot_thread", [](bool on) {
    bool previous = t_hot;
    t_hot = on;
    return previous;
  }, "Does this thread's runtime run on the C++ hot path? Returns the previous state.");
  m.def("set_open", [](bool open) { t_open = open; },
        "Does Python's engine have a segment open on this thread (no new run starts)?");
  m.def("run_pending", [] { return t_run.node != nullptr && !t_run.cold; },
        "Does this thread have deferred work?");
  m.def("cold_run_pending", [] { return t_run.node != nullptr && t_run.cold; },
        "Is this thread on a cold plan's path (Note [Cold plans])?");
  m.def("end_run", [] { end_run(t_run); },
        "End this thread's run: a deferred one fused or Python's, a cold one counted.");
  m.def("note_outside", [](py::object tensor) {
    const at::Tensor& t = THPVariable_Unpack(tensor.ptr());
    if (!t.has_storage()) return;
    std::lock_guard<std::mutex> lock(g_outside_mutex);
    g_outside.erase(std::remove_if(g_outside.begin(), g_outside.end(),
                                   [](const WeakStorage& w) { return w.expired(); }),
                    g_outside.end());
    g_outside.push_back(t.storage().getWeakStorageImpl());
    g_any_outside = true;
  }, "A tensor sharing outside memory (Note [Outside memory]): never a deferred input.");
  m.def("take_counts", [] {
    return py::make_tuple(g_ops_deferred.exchange(0), g_fused_runs.exchange(0),
                          g_fused_ops.exchange(0), g_takeovers.exchange(0),
                          g_cold_ops.exchange(0), g_cold_runs.exchange(0),
                          g_cold_misses.exchange(0), g_direct_runs.exchange(0),
                          g_per_op_ops.exchange(0));
  }, "(ops deferred, fused runs, fused ops, takeovers, cold ops, cold runs, cold misses, "
     "direct launches, ops replayed for trials) since the last call.");
}

}  // namespace adaptive_eager
