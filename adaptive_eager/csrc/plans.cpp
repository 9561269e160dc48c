// Registering segments with C++ (plan_add) and the tries the hot path walks.
//
// Note [Cold plans]
// Python's engine records a cold segment at ~20-50 us an op (convert the call, key it, keep
// weak references to its outputs), four to ten times what a small op computes, so a program
// ran up to several times slower than eager until its kernels landed, and slower for good
// where none paid: the runtime had to pause itself to do no harm. Yet a cold key seen twice
// is known: its ops will come again in the same form. So once Python has seen a key twice,
// it registers its segment here as a *cold plan* (runtime/native_plans.py, watch): the C++
// hot path walks it like a kernel's, but runs each op at once (as the fallback would pass it
// on) and counts the run against the key, with its wall time and the least time inside its
// ops. Python takes the counts every few runs (take_plan_counts, from the harvest callback),
// and its policy goes on as if it had recorded each run: the key banks toward its compile,
// which lands at such a harvest; the key's kernel then replaces the cold plan. A cold run is
// counted only if it ends where its key's segment ends with the same outputs live; one that
// stops short, or ends with other outputs live, is a miss, and a plan that misses more than
// it runs goes back to Python, whose recording then finds what the program does instead.
// Kernels' paths and cold paths are two tries: a run starts on a kernel's when it can, so a
// settled kernel always wins over watching.
#include "plans.h"

#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <pybind11/complex.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstring>
#include <dlfcn.h>
#include <map>

namespace py = pybind11;
using c10::IValue;

namespace adaptive_eager {

PyRef::~PyRef() {
  if (obj != nullptr && Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    Py_DECREF(obj);
  }
}

Context current_context() {
  return Context{c10::get_default_dtype_as_scalartype(),
                 c10::GradMode::is_enabled(),
                 c10::InferenceMode::is_enabled(),
                 at::autocast::is_autocast_enabled(at::kCPU),
                 at::autocast::is_autocast_enabled(at::kCUDA),
                 at::globalContext().deterministicAlgorithms(),
                 at::autocast::get_autocast_dtype(at::kCPU)};
}

bool same_value(const IValue& spec, const IValue& actual) {
  if (spec.isNone())          // an optional tensor autograd passes on is an undefined one,
    return actual.isNone() ||  // which reaches Python as None
           (actual.isTensor() && !actual.toTensor().defined());
  if (spec.isBool()) return actual.isBool() && spec.toBool() == actual.toBool();
  if (spec.isInt()) {
    if (actual.isInt()) return spec.toInt() == actual.toInt();
    if (actual.isSymInt()) return actual.toSymInt().maybe_as_int() == spec.toInt();
    return false;
  }
  if (spec.isDouble()) {       // bitwise: -0.0 and 0.0 compute differently
    if (!actual.isDouble()) return false;
    double a = spec.toDouble(), b = actual.toDouble();
    return std::memcmp(&a, &b, sizeof a) == 0;
  }
  if (spec.isComplexDouble())
    return actual.isComplexDouble() && spec.toComplexDouble() == actual.toComplexDouble();
  if (spec.isString()) return actual.isString() && spec.toStringRef() == actual.toStringRef();
  if (spec.isDevice()) return actual.isDevice() && spec.toDevice() == actual.toDevice();
  if (spec.isList()) {
    if (!actual.isList()) return false;
    auto a = spec.toListRef(), b = actual.toListRef();
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (!same_value(a[i], b[i])) return false;
    return true;
  }
  return false;
}

namespace {

bool same_arg(const ArgSpec& a, const ArgSpec& b) {
  if (a.type != b.type) return false;
  if (a.type == ArgSpec::Value || a.type == ArgSpec::WrappedNumber)
    return same_value(a.value, b.value);
  if (a.type == ArgSpec::Lifted)
    return a.lifted == b.lifted && a.lifted_list == b.lifted_list &&
           a.lifted_wrapped == b.lifted_wrapped;
  return a.tensors == b.tensors;
}

}  // namespace

bool same_call(const OpSpec& a, const OpSpec& b) {
  if (!(a.op == b.op) || a.kind != b.kind || a.args.size() != b.args.size()) return false;
  for (size_t i = 0; i < a.args.size(); ++i)
    if (!same_arg(a.args[i], b.args[i])) return false;
  return true;
}

namespace {

std::mutex g_trie_mutex;
std::shared_ptr<const Trie> g_trie;            // replaced whole on every change
std::atomic<uint64_t> g_generation{0};
std::map<int64_t, std::shared_ptr<const Plan>> g_plans;   // under g_trie_mutex
thread_local uint64_t t_generation = ~uint64_t{0};
thread_local std::shared_ptr<const Trie> t_trie;

// ------------------------------------------------------------------ the tries

Node* root_in(Roots& roots, const Context& context) {
  for (auto& [root_context, root] : roots)
    if (root_context == context) return root.get();
  roots.emplace_back(context, std::make_unique<Node>());
  return roots.back().second.get();
}

Node* child_for(Node& node, const OpSpec& spec, bool cold) {
  for (auto& child : node.children) {
    bool same = cold ? same_call(*child->spec, spec) : child->spec->node_id == spec.node_id;
    if (same) return child.get();
  }
  return nullptr;
}

void add_path(Roots& roots, const Plan& plan) {
  Node* node = root_in(roots, plan.context);
  node->any_plan = node->any_plan ? node->any_plan : &plan;
  for (const OpSpec& spec : plan.ops) {
    Node* next = child_for(*node, spec, plan.cold);
    if (next == nullptr) {
      node->children.push_back(std::make_unique<Node>());
      next = node->children.back().get();
      next->spec = &spec;
      next->depth = node->depth + 1;
      next->any_plan = &plan;
    }
    node = next;
  }
  node->plans.push_back(&plan);
}

std::shared_ptr<const Trie> build_trie() {     // under g_trie_mutex
  auto trie = std::make_shared<Trie>();
  for (const auto& [handle, plan] : g_plans) {
    trie->plans.push_back(plan);
    add_path(plan->cold ? trie->cold_roots : trie->kernel_roots, *plan);
  }
  return trie;
}

// Under g_trie_mutex. Returns the trie it replaced, for the caller to let go of once it
// holds the GIL again and not the mutex (a plan's last reference drops a Python object: a
// thread holding the GIL may be waiting for the mutex).
std::shared_ptr<const Trie> publish() {
  std::shared_ptr<const Trie> trie = g_plans.empty() ? nullptr : build_trie();
  std::swap(g_trie, trie);
  g_generation.fetch_add(1, std::memory_order_release);
  return trie;
}

// Change the registered plans (under the mutex, without the GIL) and publish.
template <typename Change>
void change_plans(Change change) {
  std::shared_ptr<const Trie> replaced;
  std::vector<std::shared_ptr<const Plan>> dropped;
  {
    py::gil_scoped_release no_gil;
    std::lock_guard<std::mutex> lock(g_trie_mutex);
    if (change(dropped)) replaced = publish();
  }
}

// ------------------------------------------------------------------ registration

Meta meta_from(const py::tuple& t) {      // (sizes, strides, dtype, device)
  Meta meta;
  meta.sizes = t[0].cast<std::vector<int64_t>>();
  meta.strides = t[1].cast<std::vector<int64_t>>();
  meta.dtype = reinterpret_cast<THPDtype*>(t[2].ptr())->scalar_type;
  meta.device = c10::Device(t[3].cast<std::string>());
  return meta;
}

// (op, index, sizes, strides, dtype, device, aligned)
TensorSpec tensor_spec_from(const py::tuple& t) {
  TensorSpec spec;
  spec.ref = Ref{t[0].cast<int32_t>(), t[1].cast<int32_t>()};
  spec.meta = meta_from(py::make_tuple(t[2], t[3], t[4], t[5]));
  spec.aligned = t[6].cast<bool>();
  return spec;
}

bool supported_value(const IValue& v) {
  if (v.isNone() || v.isBool() || v.isInt() || v.isDouble() || v.isComplexDouble() ||
      v.isString() || v.isDevice())
    return true;
  if (v.isList()) {
    for (const auto& item : v.toListRef())
      if (!supported_value(item)) return false;
    return true;
  }
  return false;
}

ArgSpec arg_spec_from(const c10::Argument& argument, const py::tuple& t) {
  ArgSpec spec;
  std::string type = t[0].cast<std::string>();
  if (type == "d") {                   // omitted: the schema's default
    TORCH_CHECK(argument.default_value().has_value(), "no default for ", argument.name());
    spec.type = ArgSpec::Value;
    spec.value = *argument.default_value();
  } else if (type == "v") {
    spec.type = ArgSpec::Value;
    spec.value = torch::jit::toIValue(t[1], argument.real_type());
  } else if (type == "w") {         // ("w", number, kind): b, i, f or c
    spec.type = ArgSpec::WrappedNumber;
    auto kind = t[2].cast<std::string>();
    if (kind == "b") spec.value = IValue(t[1].cast<bool>());
    else if (kind == "i") spec.value = IValue(t[1].cast<int64_t>());
    else if (kind == "f") spec.value = IValue(t[1].cast<double>());
    else spec.value = IValue(c10::complex<double>(t[1].cast<std::complex<double>>()));
  } else if (type == "s") {         // ("s", [input per float], is a list, for a Tensor)
    spec.type = ArgSpec::Lifted;
    spec.lifted = t[1].cast<std::vector<int32_t>>();
    spec.lifted_list = t[2].cast<bool>();
    spec.lifted_wrapped = t[3].cast<bool>();
  } else if (type == "t") {
    spec.type = ArgSpec::Tensor;
    spec.tensors.emplace_back(tensor_spec_from(t[1].cast<py::tuple>()));
  } else {
    TORCH_CHECK(type == "l", "unknown argument spec ", type);
    spec.type = ArgSpec::TensorList;
    for (auto item : t[1].cast<py::list>()) {
      if (item.is_none()) spec.tensors.emplace_back(std::nullopt);
      else spec.tensors.emplace_back(tensor_spec_from(item.cast<py::tuple>()));
    }
  }
  TORCH_CHECK(spec.type == ArgSpec::Tensor || spec.type == ArgSpec::TensorList ||
                  spec.type == ArgSpec::Lifted || supported_value(spec.value),
              "unsupported value for ", argument.name());
  return spec;
}

// (node_id, name, overload, kind, args, outs, list_return, returned_args, written_lists,
//  extern_op)
OpSpec op_spec_from(const py::tuple& t) {
  auto name = t[1].cast<std::string>(), overload = t[2].cast<std::string>();
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
  OpSpec spec{t[0].cast<int64_t>(), handle, static_cast<Kind>(t[3].cast<int>())};
  const auto& arguments = handle.schema().arguments();
  auto args = t[4].cast<py::list>();
  TORCH_CHECK(args.size() == arguments.size(), "one spec per schema argument");
  for (size_t i = 0; i < arguments.size(); ++i)
    spec.args.push_back(arg_spec_from(arguments[i], args[i].cast<py::tuple>()));
  for (auto out : t[5].cast<py::list>()) spec.outs.push_back(meta_from(out.cast<py::tuple>()));
  spec.list_return = t[6].cast<bool>();
  spec.returned_args = t[7].cast<std::vector<int>>();
  spec.written_lists = t[8].cast<std::vector<int>>();
  spec.extern_op = t[9].cast<bool>();
  return spec;
}

Context context_from(const py::tuple& t) {
  auto dtype = [](py::handle h) { return reinterpret_cast<THPDtype*>(h.ptr())->scalar_type; };
  return Context{dtype(t[0]), t[1].cast<bool>(), t[2].cast<bool>(), t[3].cast<bool>(),
                 t[5].cast<bool>(), t[6].cast<bool>(), dtype(t[4])};
}

std::vector<Ref> refs_from(const py::list& list) {
  std::vector<Ref> refs;
  for (auto item : list) {
    auto pair = item.cast<py::tuple>();
    refs.push_back(Ref{pair[0].cast<int32_t>(), pair[1].cast<int32_t>()});
  }
  return refs;
}

// "" when registered; else why the plan stays with Python.
std::string plan_add(int64_t handle, bool cold, py::object segment, py::tuple context,
                     py::list ops, py::list live, py::list final_results, bool mutates,
                     std::vector<int32_t> written_inputs) {
  auto plan = std::make_shared<Plan>();
  try {
    plan->handle = handle;
    plan->cold = cold;
    plan->context = context_from(context);
    for (auto op : ops) plan->ops.push_back(op_spec_from(op.cast<py::tuple>()));
    plan->live = refs_from(live);
    plan->final_results = refs_from(final_results);
    plan->mutates = mutates;
    plan->written_inputs = std::move(written_inputs);
    plan->segment = std::make_shared<PyRef>(segment);
  } catch (const std::exception& err) {
    std::string message = err.what();
    return message.substr(0, message.find('\n'));
  }
  TORCH_CHECK(!plan->ops.empty(), "a plan needs ops");
  change_plans([&](std::vector<std::shared_ptr<const Plan>>& dropped) {
    auto& slot = g_plans[handle];
    if (slot) dropped.push_back(std::move(slot));
    slot = std::move(plan);
    return true;
  });
  return "";
}

// [(handle, runs, misses, wall_s, compute_s, fusible_s, last_s)] of the plans that ran since
// the last call.
py::list take_plan_counts() {
  std::vector<std::pair<int64_t, PlanCounts>> taken;
  {
    // With the GIL: whoever holds the mutex never waits for it (see publish), and letting
    // it go here would let the program's other threads in at every harvest.
    std::lock_guard<std::mutex> lock(g_trie_mutex);
    for (const auto& [handle, plan] : g_plans) {
      std::lock_guard<std::mutex> counts_lock(plan->counts_mutex);
      if (plan->counts.runs == 0 && plan->counts.misses == 0) continue;
      taken.emplace_back(handle, plan->counts);
      plan->counts = PlanCounts();
    }
  }
  py::list result;
  for (const auto& [handle, c] : taken)
    result.append(py::make_tuple(handle, c.runs, c.misses, c.wall_s, c.compute_s, c.fusible_s,
                                 c.last_s));
  return result;
}

// Note [Launching from C++] (runtime/direct_call.py): "" when the kernel of plan `handle` is
// now called from here; else why not.
std::string plan_direct(int64_t handle, const std::string& library, std::vector<int> arguments) {
  if (arguments.empty() || arguments.size() > kMaxDirectArguments) return "too many arguments";
  void* opened = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);   // loaded by its binding
  if (opened == nullptr) return "library not loaded";
  void* function = dlsym(opened, "kernel");
  dlclose(opened);                                 // the binding's own handle keeps it
  if (function == nullptr) return "no kernel symbol";
  std::lock_guard<std::mutex> lock(g_trie_mutex);
  auto found = g_plans.find(handle);
  if (found == g_plans.end() || found->second->cold) return "no such kernel plan";
  const Plan& plan = *found->second;
  if (plan.direct.load() != nullptr) return "";
  plan.direct_owned = std::make_unique<DirectKernel>(DirectKernel{function, std::move(arguments)});
  plan.direct.store(plan.direct_owned.get(), std::memory_order_release);
  return "";
}

}  // namespace

const std::shared_ptr<const Trie>& current_trie() {
  uint64_t generation = g_generation.load(std::memory_order_acquire);
  if (generation != t_generation) {
    std::shared_ptr<const Trie> latest;
    {
      std::lock_guard<std::mutex> lock(g_trie_mutex);
      latest = g_trie;
      t_generation = g_generation.load(std::memory_order_relaxed);
    }
    t_trie.swap(latest);    // the old snapshot goes outside the mutex (see publish)
  }
  return t_trie;
}

const Node* root_for(const Roots& roots, const Context& context) {
  for (const auto& [root_context, root] : roots)
    if (root_context == context) return root.get();
  return nullptr;
}

void define_plans(py::module& m) {
  m.def("plan_add", &plan_add,
        "Register a segment: a kernel's (cold=False) or a cold key's; '' or why not.");
  m.def("plan_remove", [](int64_t handle) {
    change_plans([&](std::vector<std::shared_ptr<const Plan>>& dropped) {
      auto found = g_plans.find(handle);
      if (found == g_plans.end()) return false;
      dropped.push_back(std::move(found->second));
      g_plans.erase(found);
      return true;
    });
  });
  m.def("plan_clear", [] {
    change_plans([&](std::vector<std::shared_ptr<const Plan>>& dropped) {
      for (auto& [handle, plan] : g_plans) dropped.push_back(std::move(plan));
      g_plans.clear();
      return true;
    });
  });
  m.def("take_plan_counts", &take_plan_counts,
        "[(handle, runs, misses, wall_s, compute_s, fusible_s, last_s)] since the last call.");
  m.def("plan_direct", &plan_direct,
        "Call a kernel plan's generated code from C++: '' or why not.");
}

}  // namespace adaptive_eager
