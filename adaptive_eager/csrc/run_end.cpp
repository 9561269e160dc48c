// Ending a run (Note [The C++ hot path] in hot_path.cpp): a deferred one fused (launched
// through Python, or from here: Note [Launching from C++] in runtime/direct_call.py),
// replayed per-op for a kernel's trial, or handed to Python's engine (takeover); a cold one
// counted against its plan (Note [Cold plans] in plans.cpp), with a harvest now and then.
#include "hot_path.h"
#include "run.h"

#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <utility>

namespace py = pybind11;

namespace adaptive_eager {
namespace {

thread_local int64_t t_runs_since_harvest = 0;      // cold runs and direct launches
thread_local double t_run_s_since_harvest = 0.0;

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

// Does an input the plan writes share memory with another input? (runtime/fused_runs.py,
// _written_inputs_shared: the kernel would not see its own write through the other.)
bool written_inputs_shared(const Plan& plan, const std::vector<at::Tensor>& inputs) {
  if (plan.written_inputs.empty()) return false;
  bool any_view = false;
  for (const auto& t : inputs) any_view = any_view || t.is_view();
  if (!any_view) return false;
  for (int32_t written : plan.written_inputs) {
    const c10::StorageImpl* storage = inputs.at(written).storage().unsafeGetStorageImpl();
    for (size_t i = 0; i < inputs.size(); ++i)
      if (static_cast<int32_t>(i) != written &&
          inputs[i].storage().unsafeGetStorageImpl() == storage)
        return true;
  }
  return false;
}

py::list tensor_list(const std::vector<at::Tensor>& tensors) {
  py::list list(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i)
    list[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(tensors[i]));
  return list;
}

// Versions as eager left them (runtime/fused_runs.py, _run_kernel).
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

// launch's answer (and Python's: native_plans._launch). Checked: a kernel's first run failed
// its check, and the outputs hold the per-op results the check computed (Note [First runs
// in C++] in runtime/first_runs.py).
enum class Launched { Refused = 0, Fused = 1, PerOp = 2, Checked = 3 };

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
// The run's deferred ops replayed per-op into the outputs the program holds; their seconds.
double replay_run(Run& run, const Plan& plan) {
  std::vector<std::pair<Ref, at::Tensor>> targets;
  std::vector<at::Tensor> written;
  for (Ref ref : live_refs(run)) {
    targets.emplace_back(ref, buffer_for(run, plan, ref));
    written.push_back(targets.back().second);
  }
  KeepVersions versions(run.inputs, written);   // eager bumped them when they were deferred
  double seconds = replay_per_op(plan, run.node->depth, run.inputs, targets);
  g_per_op_ops.fetch_add(run.node->depth, std::memory_order_relaxed);
  return seconds;
}

void run_per_op(Run& run, const Plan& plan) {
  const double waited_s = seconds_since(run.started);   // Note [Like for like] (profit.py)
  double seconds = replay_run(run, plan);
  py::gil_scoped_acquire gil;
  PyObject* result = PyObject_CallFunction(g_ran_per_op, "Ldd",
                                           static_cast<long long>(plan.handle), seconds,
                                           waited_s);
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

// Hand the run to Python's engine (see the Note): it replays or finishes a deferred run; a
// cold run's ops ran already, and Python records on from them (Note [Cold plans]).
void take_over(Run& run) {
  const Node& node = *run.node;
  std::shared_ptr<const Trie> keep = run.trie;     // the plan (and its segment) stay alive
  const bool cold = run.cold;
  const double wall_s = seconds_since(run.started);
  const double compute_s = run.compute_s, extern_s = run.extern_s;
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
  py::object timing = py::none();
  if (cold) timing = py::make_tuple(wall_s, compute_s, extern_s);
  PyObject* result = PyObject_CallFunction(g_takeover, "OiOOO", node.any_plan->segment->obj,
                                           node.depth, inputs.ptr(), outputs.ptr(),
                                           timing.ptr());
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

// Count the run against its plan (Note [Cold plans]). A run that ends elsewhere (stops short
// of its path's plans, or ends with other outputs live) is another segment that shares the
// path's first ops: Python records on from the ops that ran (take_over), so that segment gets
// its own key and plan instead of running unseen, and the plan at the node counts a miss.
void end_cold_run(Run& run) {
  const Plan* plan = cold_plan_for(run);
  if (plan == nullptr) {
    if (!run.node->plans.empty()) {
      const Plan* missed = run.node->plans.front();
      std::lock_guard<std::mutex> lock(missed->counts_mutex);
      missed->counts.misses += 1;
    }
    g_cold_misses.fetch_add(1, std::memory_order_relaxed);
    c10::impl::ExcludeDispatchKeyGuard guard(kHidden);
    return take_over(run);
  }
  double wall_s = seconds_since(run.started);
  {
    std::lock_guard<std::mutex> lock(plan->counts_mutex);
    PlanCounts& counts = plan->counts;
    counts.runs += 1;
    counts.wall_s += wall_s;
    counts.compute_s = std::min(counts.compute_s, run.compute_s);
    counts.fusible_s = std::min(counts.fusible_s, run.compute_s - run.extern_s);
  }
  g_cold_runs.fetch_add(1, std::memory_order_relaxed);
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

// Note [Paths that lead nowhere] (hot_path.cpp): a launch from the path's first node, which
// forgives what its earlier starts exceed the allowed share by.
void count_launch(const Run& run) {
  if (run.first == nullptr) return;
  const int64_t launches = run.first->launches.fetch_add(1, std::memory_order_relaxed) + 1;
  const int64_t allowed = launches * kStartsPerLaunch;
  int64_t starts = run.first->starts.load(std::memory_order_relaxed);
  while (starts > allowed &&
         !run.first->starts.compare_exchange_weak(starts, allowed, std::memory_order_relaxed)) {
  }
}

// Note [Divergence in C++]
// A deferred run that ends where no kernel fits (the program went on with other ops, or kept
// other outputs) used to be handed to Python's engine, which replayed its ops and recorded
// the rest of the segment at ~20-50 us an op: every step, where a kernel's path shares its
// first ops with a segment that has no kernel (the layers of a model's backward). Its ops
// are replayed here instead (into the outputs the program holds, as a kernel's trial runs
// them), and the run goes on as a cold run along the cold plans' path of the same calls,
// where the next op may follow it (or, if none does, Python records on from there: a cold
// run's take_over). With no such path the run is still Python's to replay: its trie may go
// on along a kernel that C++ does not run yet (one whose first fused run, on probation, is
// to come through Python's engine: native_plans.offer).
const Node* same_path_among_cold_plans(const Run& run) {
  const Plan& plan = *run.node->any_plan;
  const Node* node = root_for(run.trie->cold_roots, plan.context);
  for (int i = 0; node != nullptr && i < run.node->depth; ++i) {
    const Node* next = nullptr;
    for (const auto& child : node->children)
      if (same_call(*child->spec, plan.ops[i])) {
        next = child.get();
        break;
      }
    node = next;
  }
  return node;
}

void go_on_cold(Run& run, Run& current) {
  const Node* cold_node = same_path_among_cold_plans(run);
  if (cold_node == nullptr) return take_over(run);   // Python's trie may go on to a kernel
  g_divergences.fetch_add(1, std::memory_order_relaxed);
  run.compute_s = replay_run(run, *run.node->any_plan);
  run.cold = true;
  run.extern_s = 0.0;
  run.node = cold_node;
  std::swap(run, current);          // the thread's run again (`run` is cleared when ended)
}

// Note [Kernels while paused] (hot_path.cpp): Python's engine is off; the run's ops are
// replayed here, as a divergence's are.
void replay_paused(Run& run, const Plan* plan) {
  g_divergences.fetch_add(1, std::memory_order_relaxed);
  replay_run(run, plan != nullptr ? *plan : *run.node->any_plan);
}

}  // namespace

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
  if (plan != nullptr && !written_inputs_shared(*plan, run.inputs)) {
    const Launched launched = launch(run, *plan);
    if (launched != Launched::Refused) count_launch(run);
    switch (launched) {
      case Launched::Fused:
        g_fused_runs.fetch_add(1, std::memory_order_relaxed);
        g_fused_ops.fetch_add(run.node->depth, std::memory_order_relaxed);
        return;
      case Launched::PerOp:
        return run_per_op(run, *plan);
      case Launched::Checked:
        g_per_op_ops.fetch_add(run.node->depth, std::memory_order_relaxed);
        return;
      case Launched::Refused:
        break;
    }
  }
  if (thread_paused()) return replay_paused(run, plan);
  if (plan == nullptr) return go_on_cold(run, current);
  take_over(run);
}

}  // namespace adaptive_eager
