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
// write. The run ends in run_end.cpp: the kernel is launched (from here where its generated
// code allows: Note [Launching from C++] in runtime/direct_call.py; else through Python,
// launch(handle, inputs, buffers, seconds)), or replayed per-op here for the kernel's trial
// (replay.cpp). Everything else goes back to Python's engine whole, by takeover(segment,
// depth, inputs, outputs): a run that cannot end fused (other live outputs, aliased inputs, a
// kernel that failed or was dropped meanwhile) becomes the Python engine's own deferred run,
// which replays it and records on. So the rare paths have one implementation, in Python.
// Cold plans (Note [Cold plans] in plans.cpp) are walked the same way, their ops run at once.
//
// Liveness is Python's (Note [Liveness] in runtime/segment.py): outputs are held weakly, by
// their TensorImpl and their storage; an output is live while either survives (a view or
// autograd's shallow copy holds the storage: Note [Shallow copies]).
#include "hot_path.h"
#include "run.h"

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

namespace py = pybind11;
using c10::DispatchKeySet;
using c10::IValue;

namespace adaptive_eager {

std::atomic<int64_t> g_ops_deferred{0}, g_fused_runs{0}, g_fused_ops{0}, g_divergences{0};
std::atomic<int64_t> g_cold_runs{0}, g_cold_ops{0}, g_cold_misses{0}, g_direct_runs{0};
std::atomic<int64_t> g_per_op_ops{0};
PyObject* g_launch = nullptr;
PyObject* g_takeover = nullptr;
PyObject* g_harvest = nullptr;
PyObject* g_ran_per_op = nullptr;
std::atomic<int64_t> g_harvest_every{64};
std::atomic<double> g_harvest_after_s{0.002};

namespace {

constexpr int64_t kAlignmentBytes = 16;
PyObject* g_retry = nullptr;                    // on_op's answer: a segment just ended here
// Storages of tensors that share a numpy array's memory (Note [Outside memory]): by address.
std::mutex g_outside_mutex;
std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> g_outside;
std::atomic<bool> g_any_outside{false};
std::atomic<bool> g_off{false};                 // a forked child: Python's engine only

thread_local Run t_run;
thread_local bool t_open = false;       // Python's engine has a segment open on this thread
thread_local bool t_hot = false;        // this thread's runtime runs on C++ (not a thread
                                        // that only inherited the key, e.g. autograd's)

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

}  // namespace

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

namespace {

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

// Note [Lifted scalars] (runtime/scalars.py): each float becomes the next new input, a 0-dim
// float64 tensor, numbered as Python numbers them (after the call's tensors: Python lifts
// once the call is encoded). A float recorded elsewhere does not match; one lifted for a
// Tensor argument comes as a wrapped number (Python keys a 0-dim tensor apart).
std::optional<double> lifted_float(const ArgSpec& spec, const IValue& item) {
  if (!spec.lifted_wrapped) return item.isDouble() ? std::optional(item.toDouble()) : std::nullopt;
  if (!item.isTensor()) return std::nullopt;
  const at::Tensor& t = item.toTensor();
  if (!t.defined() || !t.unsafeGetTensorImpl()->is_wrapped_number() || !t.is_cpu() ||
      t.scalar_type() != c10::kDouble)
    return std::nullopt;
  return *t.const_data_ptr<double>();     // read in place: an item() op would come back here
}

bool lifted_matches(const Run& run, const ArgSpec& spec, const IValue& value,
                    Pending& pending) {
  auto take = [&](const IValue& item, int32_t input) {
    std::optional<double> number = lifted_float(spec, item);
    if (!number || input != static_cast<int32_t>(run.inputs.size() + pending.size()))
      return false;
    // made without an op: one would come back to this thread's interception
    pending.push_back(at::detail::scalar_tensor_static(*number, at::kDouble, at::kCPU));
    return true;
  };
  if (!spec.lifted_list) return take(value, spec.lifted[0]);
  if (!value.isList()) return false;
  auto items = value.toListRef();
  if (items.size() != spec.lifted.size()) return false;
  for (size_t k = 0; k < items.size(); ++k)
    if (!take(items[k], spec.lifted[k])) return false;
  return true;
}

std::optional<Ref> ref_of(Run& run, const at::Tensor& t, const Pending& pending) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (const Ref* found = run.known_ref(impl)) return *found;
  for (size_t i = 0; i < pending.size(); ++i)
    if (pending[i].unsafeGetTensorImpl() == impl)
      return Ref{-1, static_cast<int32_t>(run.inputs.size() + i)};
  if (t.has_storage()) {      // Note [Shallow copies]: an unseen alias of an output
    // From the newest: memory the pool handed out again within the run holds its newest
    // computed output, and what was placed on it before is gone (Python keeps the newest).
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    bool on_output = false;
    std::optional<Layout> layout;
    for (auto place = run.placed.rbegin(); place != run.placed.rend(); ++place) {
      if (place->storage != storage) continue;
      on_output = true;
      if (!layout) layout = layout_of(t);
      if (place->layout == *layout) return place->ref;
      if (place->computed) break;
    }
    // Other memory of an output, made by no op; unless the output was a view of an input,
    // whose memory is the input's (Python: SegmentBuilder._unseen_alias).
    if (on_output) {
      for (const at::Tensor& input : run.inputs)
        if (input.has_storage() && input.storage().unsafeGetStorageImpl() == storage)
          return Ref{-2, 0};
      return std::nullopt;
    }
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
  c10::SmallVector<size_t, 2> lifted;
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
      case ArgSpec::Lifted:
        lifted.push_back(i);                  // after the call's tensors, as Python does
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
  for (size_t i : lifted)
    if (!lifted_matches(run, spec.args[i], args[i], pending)) return false;
  return true;
}

// ------------------------------------------------------------------ deferring

void remember_output(Run& run, const at::Tensor& t, Ref ref, bool computed, bool pooled) {
  run.known.emplace_back(t.unsafeGetTensorImpl(), ref);
  run.outputs.emplace_back(t.getIntrusivePtr());
  if (!t.has_storage()) return;
  WeakStorage storage = t.storage().getWeakStorageImpl();
  run.placed.push_back(Placed{t.storage().unsafeGetStorageImpl(), layout_of(t), ref, computed});
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

// The matched call of `node` becomes the run's next op: its new inputs join; its index.
int32_t begin_op(Run& run, const Node& node, Pending& pending) {
  commit_inputs(run, pending);
  run.first_output.push_back(static_cast<int32_t>(run.outputs.size()));
  return node.depth - 1;
}

// Remember the tensors an op that ran left on the stack (`computed`: a kernel writes them).
void remember_returns(Run& run, const c10::OperatorHandle& op, torch::jit::Stack* stack,
                      int32_t index, bool computed) {
  auto returns = torch::jit::last(*stack, op.schema().returns().size());
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

void defer(Run& run, const Node& node, const c10::OperatorHandle& op, DispatchKeySet ks,
           torch::jit::Stack* stack, Pending& pending) {
  const int32_t index = begin_op(run, node, pending);
  const OpSpec& spec = *node.spec;
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  if (spec.kind == Kind::View) {          // metadata only: safe on unfilled buffers
    op.redispatchBoxed(ks & kBelow, stack);
    remember_returns(run, op, stack, index, false);
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

// Note [Cold plans] (plans.cpp): the op runs now, as Python's cold path runs it (its thread
// state, then the version bumps eager makes for foreach in-place ops: runtime/engine.py,
// _run_cold), timed; its outputs are remembered so later calls of the path match.
void run_cold(Run& run, const Node& node, const c10::OperatorHandle& op, DispatchKeySet ks,
              torch::jit::Stack* stack, Pending& pending) {
  const int32_t index = begin_op(run, node, pending);
  const OpSpec& spec = *node.spec;
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
  if (spec.kind != Kind::Mutating)        // a mutating op returns tensors the run knows
    remember_returns(run, op, stack, index, spec.kind == Kind::Fusible);
  run.node = &node;
  g_cold_ops.fetch_add(1, std::memory_order_relaxed);
}

// Note [Paths that lead nowhere]
// A deferred run starts wherever an op is the first call of a kernel's path. Where other
// segments share that call and part from the path later (a model's backward layers share
// their first ops; keys recorded at shifted alignments share them too), each such run is
// deferred, then replayed into the outputs the program holds (Note [Divergence in C++] in
// run_end.cpp): allocations, copies and bookkeeping that eager never pays, every step. So a
// path's first node counts the runs started there and the launches they ended in; once
// kMinStarts runs started with fewer than one launch in kStartsPerLaunch, an op there no
// longer starts a deferred run (it goes on along a cold plan, or to Python). One pass in
// kReprobeEvery starts one anyway, and a launch forgives the excess of earlier starts, so
// a path that pays again (the program changed phase) is taken again within that many passes.
constexpr int64_t kMinStarts = 16, kReprobeEvery = 16;   // (kStartsPerLaunch: run.h)

bool leads_nowhere(const Node& first) {
  const int64_t starts = first.starts.load(std::memory_order_relaxed);
  const int64_t launches = first.launches.load(std::memory_order_relaxed);
  if (starts < kMinStarts || launches * kStartsPerLaunch >= starts) return false;
  return first.passed.fetch_add(1, std::memory_order_relaxed) % kReprobeEvery != 0;
}

bool advance(Run& run, const c10::OperatorHandle& op, DispatchKeySet ks,
             torch::jit::Stack* stack) {
  Pending pending;
  for (const auto& child : run.node->children) {
    pending.clear();
    if (!call_matches(run, *child->spec, op, stack, pending)) continue;
    if (run.cold) {
      run_cold(run, *child, op, ks, stack, pending);
      return true;
    }
    if (run.node->depth == 0) {           // a deferred run would start here
      if (leads_nowhere(*child)) continue;
      child->starts.fetch_add(1, std::memory_order_relaxed);
      run.first = child.get();
    }
    defer(run, *child, op, ks, stack, pending);
    return true;
  }
  return false;
}

// ------------------------------------------------------------------ ops aside

std::atomic<int64_t> g_aside_ops{0};

// Note [Ops aside] (runtime/aside.py): the tensors among an op's arguments; false if one is
// not a plain strided tensor.
bool tensors_of(const c10::OperatorHandle& op, const torch::jit::Stack* stack,
                c10::SmallVector<const at::Tensor*, 8>& tensors) {
  for (const IValue& value : torch::jit::last(*stack, op.schema().arguments().size())) {
    auto take = [&](const at::Tensor& t) {
      if (!t.defined()) return true;
      if (t.layout() != c10::kStrided || t.is_quantized() ||
          t.unsafeGetTensorImpl()->is_python_dispatch() || !t.has_storage())
        return false;
      tensors.push_back(&t);
      return true;
    };
    if (value.isTensor()) {
      if (!take(value.toTensor())) return false;
    } else if (value.isTensorList() || value.isList()) {
      for (const IValue& item : value.toListRef())
        if (item.isTensor() && !take(item.toTensor())) return false;
    }
  }
  return true;
}

bool cpu_scalars(const c10::SmallVector<const at::Tensor*, 8>& tensors) {
  if (tensors.empty()) return false;
  for (const at::Tensor* t : tensors)
    if (t->dim() != 0 || !t->is_cpu()) return false;
  return true;
}

bool touches(const Run& run, const at::Tensor& t) {
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  for (const at::Tensor& input : run.inputs)
    if (input.has_storage() && input.storage().unsafeGetStorageImpl() == storage) return true;
  for (const Placed& place : run.placed)
    if (place.storage == storage) return true;
  return false;
}

// May this op, which matched none of the run's next ops, run now with the run going on? If
// so it is counted: as a host sync where Python named it one, else as an op aside.
bool runs_aside(const Run& run, const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  c10::SmallVector<const at::Tensor*, 8> tensors;
  if (!tensors_of(op, stack, tensors) || tensors.empty()) return false;
  const int sync_slot = host_sync_slot(op);
  if (sync_slot < 0 && !cpu_scalars(tensors)) return false;
  for (const at::Tensor* t : tensors)
    if (touches(run, *t)) return false;
  if (sync_slot >= 0) count_idle_run(sync_slot);
  else g_aside_ops.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// Start the thread's run at ``root`` with ``op``: true where the op was taken (deferred, or
// run on a cold plan); else the run is cleared and the op is not.
bool start_run(Run& run, const std::shared_ptr<const Trie>& trie, const Node* root, bool cold,
               const c10::OperatorHandle& op, DispatchKeySet ks, torch::jit::Stack* stack) {
  run.trie = trie;
  run.node = root;
  run.cold = cold;
  run.started = std::chrono::steady_clock::now();
  if (advance(run, op, ks, stack)) return true;
  run.clear();
  return false;
}

// The thread's run takes ``op`` as its next op, or runs it aside (Note [Ops aside]) and goes
// on: true; false where the op ends it.
bool run_goes_on(Run& run, const c10::OperatorHandle& op, DispatchKeySet ks,
                 torch::jit::Stack* stack) {
  if (advance(run, op, ks, stack)) return true;
  if (!runs_aside(run, op, stack)) return false;
  run_as_eager(op, ks, stack);
  return true;
}

}  // namespace

bool aside_when_idle(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  c10::SmallVector<const at::Tensor*, 8> tensors;
  if (!tensors_of(op, stack, tensors) || !cpu_scalars(tensors)) return false;
  g_aside_ops.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool hot_path_op(const c10::OperatorHandle& op, DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!t_hot || g_off.load(std::memory_order_relaxed)) return false;
  Run& run = t_run;
  if (run.node != nullptr) {
    if (run_goes_on(run, op, ks, stack)) return true;
    end_run(run);                  // fused, or Python's now (which may open its segment),
    if (run.node != nullptr) {     // or replayed and on a cold plan's path
      if (advance(run, op, ks, stack)) return true;
      end_run(run);
    }
  }
  if (t_open || thread_paused()) return false;   // (a harvest may have paused it)
  const auto& trie = current_trie();
  if (!trie) return false;
  const Context context = current_context();
  for (bool cold : {false, true}) {       // a settled kernel first
    const Node* root = root_for(cold ? trie->cold_roots : trie->kernel_roots, context);
    if (root != nullptr && start_run(run, trie, root, cold, op, ks, stack)) return true;
  }
  return false;
}

// Note [Kernels while paused]
// The runtime pauses (Note [Pausing] in runtime/pausing.py, Note [Judged by the step] in
// runtime/step_judge.py) where watching the program's cold ops costs more than its kernels
// save: GPT-2's training step ran 12-14% slower intercepted, while its AdamW kernel took
// 3.1 ms against 7.3 per-op. A pause used to stop the kernels too. Here a paused thread
// still runs its settled kernels' segments: an op that starts a kernel's path is deferred,
// the run goes on and ends as on the hot path (launched, or per-op for a trial), and every
// other op passes straight through (~0.2 us: a root's children compared by operator). What
// a pause stops is the rest: cold plans, Python's recording, its bookkeeping per segment. A
// run that cannot end fused is replayed here into the outputs the program holds (Note
// [Divergence in C++] in run_end.cpp), never handed to Python's engine, which is off. A pause
// with no kernel to run takes the key out of the thread's dispatch set instead
// (CppInterceptor.deactivate), and ae.paused() stops the kernels too (plain eager).
bool paused_op(const c10::OperatorHandle& op, DispatchKeySet ks, torch::jit::Stack* stack) {
  if (!t_hot || g_off.load(std::memory_order_relaxed)) return false;
  if (ks.has_backend(c10::BackendComponent::MetaBit)) return false;   // (Dynamo's tracing)
  Run& run = t_run;
  if (run.node != nullptr) {
    if (!run.cold && run_goes_on(run, op, ks, stack)) return true;
    end_run(run);                 // fused, or replayed (paused: not Python's)
    if (run.node != nullptr || !thread_paused()) return false;   // (a harvest resumed it)
  }
  const auto& trie = current_trie();
  if (!trie) return false;
  const Node* root = root_for(trie->kernel_roots, current_context());
  return root != nullptr && start_run(run, trie, root, /*cold=*/false, op, ks, stack);
}

bool paused_op_passes(const c10::OperatorHandle& op) {
  if (!t_hot || g_off.load(std::memory_order_relaxed)) return true;
  if (t_run.node != nullptr) return false;
  const auto& trie = current_trie();
  if (!trie) return true;
  for (const auto& [context, root] : trie->kernel_roots)   // (any context: paused_op checks)
    for (const auto& child : root->children)
      if (child->spec->op == op) return false;
  return true;
}

bool is_retry(PyObject* answer) { return answer == g_retry && answer != nullptr; }

bool thread_idle() { return t_hot && !t_open && t_run.node == nullptr; }

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
  m.def("has_kernels", [] {
    const auto& trie = current_trie();
    return trie != nullptr && !trie->kernel_roots.empty();
  }, "Does C++ run any kernel's segments (Note [Kernels while paused])?");
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
                          g_fused_ops.exchange(0), g_divergences.exchange(0),
                          g_cold_ops.exchange(0), g_cold_runs.exchange(0),
                          g_cold_misses.exchange(0), g_direct_runs.exchange(0),
                          g_per_op_ops.exchange(0), g_aside_ops.exchange(0));
  }, "(ops deferred, fused runs, fused ops, divergences, cold ops, cold runs, cold misses, "
     "direct launches, ops replayed for trials, ops run aside: Note [Ops aside]) since the "
     "last call.");
}

}  // namespace adaptive_eager