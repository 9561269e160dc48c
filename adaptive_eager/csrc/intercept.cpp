// The C++ interception backend: a boxed dispatcher fallback on DispatchKey::Fake.
//
// Note [The Fake key]
// In torch 2.13 DispatchKey::Fake sits directly below Python and above BackendSelect, has no
// fallback and no kernels of its own, so a fallback registered there sees every aten op below
// autograd (forward after decomposition, backward, foreach optimizer ops), as a Python
// TorchDispatchMode would, at ~0.2 us per op instead of ~4.4 us. It is registered at run time
// (install(): a key someone else took is an error we can report, not a crash at import), and
// only threads that include the key in their TLS dispatch set (set_included) reach it.
//
// The fallback, PyTorch's boxed fallbacks being the model: (1) the common case of a paused
// thread passes the op straight through, asking Python every kResumeEvery ops whether to come
// back; (2) a short list of exceptions passes through too; (3) everything else goes to the
// Python callback on_op(OpOverload, args, kwargs), whose result replaces the arguments on the
// stack. Everything this file runs below us happens with the key excluded, so ops the runtime
// itself runs (or a kernel runs inside itself) are not seen again, as a dispatch mode is
// popped while its handler runs.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>

#include "hot_path.h"

#include <array>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

namespace py = pybind11;
using c10::DispatchKey;
using c10::DispatchKeySet;

namespace {

constexpr DispatchKey kKey = DispatchKey::Fake;
const DispatchKeySet kBelow(DispatchKeySet::FULL_AFTER, kKey);

// Set once under the GIL, before any thread includes the key; never freed (they live as
// long as the process, like the registration).
PyObject* g_on_op = nullptr;          // on_op(func, args, kwargs) -> result
PyObject* g_should_resume = nullptr;  // should_resume() -> None; may call set_paused(False)
int64_t g_resume_every = 1024;
std::unique_ptr<torch::Library> g_library;
std::unique_ptr<torch::Library> g_unboxed;   // Note [Unboxed pass-through] (unboxed.cpp)

thread_local bool t_paused = false;
thread_local bool t_paused_kernels = false;   // Note [Kernels while paused] (hot_path.cpp)
thread_local int64_t t_paused_ops = 0;
thread_local int64_t t_unboxed_passes = 0;    // Note [Unboxed pass-through] (tests read it)

void pass_through(const c10::OperatorHandle& op, DispatchKeySet ks, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  op.redispatchBoxed(ks & kBelow, stack);
}

// A paused thread's bare loop must come back without any control point, so every
// g_resume_every paused ops Python is asked once (~1 us, a thousandth of an op each).
void ask_resume() {
  t_paused_ops = 0;
  if (g_should_resume == nullptr) return;
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  py::gil_scoped_acquire gil;
  PyObject* result = PyObject_CallNoArgs(g_should_resume);
  if (result == nullptr) throw py::error_already_set();
  Py_DECREF(result);
}

// Mirrors torch's parseIValuesToPyArgsKwargs (not exported from libtorch_python in 2.13):
// positional arguments up to the last non-default one, keyword-only ones unless defaulted,
// and the integers that stand for dtypes, layouts and memory formats as their Python objects.
py::object to_python(const c10::Argument& arg, const c10::IValue& value) {
  if (value.isNone()) return py::none();
  auto kind = arg.real_type()->kind();
  if (auto optional = arg.real_type()->cast<c10::OptionalType>())
    kind = optional->getElementType()->kind();
  if (kind == c10::ScalarTypeType::Kind)
    return py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(value.toInt()))));
  if (kind == c10::LayoutType::Kind)
    return py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(value.toInt()))));
  if (kind == c10::MemoryFormatType::Kind)
    return py::reinterpret_borrow<py::object>(
        torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(value.toInt())));
  return torch::jit::toPyObject(value);
}

bool is_default(const c10::Argument& arg, const c10::IValue& value) {
  return arg.default_value().has_value() && *arg.default_value() == value;
}

std::pair<py::tuple, py::dict> to_args_kwargs(const c10::FunctionSchema& schema,
                                              c10::ArrayRef<c10::IValue> values) {
  const auto& params = schema.arguments();
  size_t kwarg_only_start = values.size();
  while (kwarg_only_start > 0 && params[kwarg_only_start - 1].kwarg_only()) --kwarg_only_start;
  size_t positional = kwarg_only_start;
  while (positional > 0 && is_default(params[positional - 1], values[positional - 1]))
    --positional;
  py::tuple args(positional);
  for (size_t i = 0; i < positional; ++i) args[i] = to_python(params[i], values[i]);
  py::dict kwargs;
  for (size_t i = kwarg_only_start; i < values.size(); ++i)
    if (!is_default(params[i], values[i]))
      kwargs[py::str(params[i].name())] = to_python(params[i], values[i]);
  return {std::move(args), std::move(kwargs)};
}

// Mirrors torch's pushPyOutToStack.
void push_result(const c10::FunctionSchema& schema, torch::jit::Stack* stack, py::handle out) {
  const auto& returns = schema.returns();
  if (returns.empty()) {
    TORCH_CHECK(out.is_none(), "adaptive_eager: on_op for ", schema.name(),
                " returned something where None was expected");
  } else if (returns.size() == 1) {
    stack->push_back(torch::jit::toIValue(out, returns[0].real_type()));
  } else {
    auto outs = py::reinterpret_borrow<py::sequence>(out);
    for (size_t i = 0; i < returns.size(); ++i)
      stack->push_back(torch::jit::toIValue(outs[i], returns[i].real_type()));
  }
}

// Note [Below ADInplaceOrView]
// The runtime must see the thread state a Python dispatch mode's handler sees: autograd and
// ADInplaceOrView excluded. Ops that have an ADInplaceOrView kernel arrive so already, but
// foreach ops have none (their autograd kernel only steps below autograd), so the per-tensor
// in-place ops their kernel runs when the runtime calls it bumped version counters a second
// time, beside the bump the runtime makes itself for foreach ops (runtime/engine.py,
// _bump_versions): an AdamW parameter ended at version 20 where eager's was at 13.
const DispatchKeySet kHidden =
    c10::autograd_dispatch_keyset_with_ADInplaceOrView | DispatchKeySet(kKey);

// False (the stack untouched) when Python answers that a segment just ended at this op
// (adaptive_eager::is_retry).
bool call_python(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  c10::impl::ExcludeDispatchKeyGuard guard(kHidden);   // Note [Below ADInplaceOrView]
  py::gil_scoped_acquire gil;
  py::handle func = torch::detail::getTorchApiFunction(op);   // the OpOverload, cached
  auto [args, kwargs] = to_args_kwargs(schema, torch::jit::last(*stack, num_args));
  PyObject* out = PyObject_CallFunctionObjArgs(g_on_op, func.ptr(), args.ptr(), kwargs.ptr(),
                                               nullptr);
  if (out == nullptr) throw py::error_already_set();
  auto result = py::reinterpret_steal<py::object>(out);
  if (adaptive_eager::is_retry(out)) return false;
  torch::jit::drop(*stack, num_args);
  push_result(schema, stack, result);
  return true;
}

// Note [Boundaries passed when idle]
// An op that ends a segment whatever its arguments (a host sync such as .item(), a profiler
// range, a random op: OpKind.BOUNDARY) changes nothing in the runtime when no segment is open:
// Python's engine would only run it. Python names each such op the first time it sees one
// (pass_when_idle); from then on a thread with nothing open runs it straight through, counted
// per op (take_idle_counts: Python counts them as it counts its own fallbacks). AdamW's
// per-parameter .item()s (12 a step here) and its profiler ranges cost ~20 us each through
// Python. A thread with a segment open still sends it to Python, which ends the segment.
constexpr int kMaxIdleOps = 128;
std::array<std::atomic<const c10::FunctionSchema*>, kMaxIdleOps> g_idle_ops{};
std::array<std::atomic<int64_t>, kMaxIdleOps> g_idle_runs{};
std::array<std::atomic<bool>, kMaxIdleOps> g_idle_host_sync{};   // reads a value back
std::atomic<int> g_idle_count{0};   // written under the GIL, read by any thread

// The op's slot, or -1.
int idle_slot(const c10::OperatorHandle& op) {
  const c10::FunctionSchema* schema = &op.schema();
  const int count = g_idle_count.load(std::memory_order_acquire);
  for (int i = 0; i < count; ++i)
    if (g_idle_ops[i].load(std::memory_order_relaxed) == schema) return i;
  return -1;
}

bool passed_when_idle(const c10::OperatorHandle& op) {
  const int slot = idle_slot(op);
  if (slot < 0) return false;
  g_idle_runs[slot].fetch_add(1, std::memory_order_relaxed);
  return true;
}

// The op's slot (its counts' index in take_idle_counts), or -1: unknown, or the table is full.
int add_idle_op(const std::string& name, const std::string& overload, bool host_sync) {
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  const int count = g_idle_count.load(std::memory_order_relaxed);
  if (!handle || count >= kMaxIdleOps) return -1;
  g_idle_ops[count].store(&handle->schema(), std::memory_order_relaxed);
  g_idle_host_sync[count].store(host_sync, std::memory_order_relaxed);
  g_idle_count.store(count + 1, std::memory_order_release);
  return count;
}

std::vector<int64_t> take_idle_counts() {
  std::vector<int64_t> counts(g_idle_count.load(std::memory_order_acquire));
  for (size_t i = 0; i < counts.size(); ++i)
    counts[i] = g_idle_runs[i].exchange(0, std::memory_order_relaxed);
  return counts;
}

void fallback(const c10::OperatorHandle& op, DispatchKeySet ks, torch::jit::Stack* stack) {
  if (t_paused) {
    if (++t_paused_ops >= g_resume_every) ask_resume();
    if (t_paused) {           // (else it resumed just now: this op is intercepted)
      if (t_paused_kernels && adaptive_eager::paused_op(op, ks, stack)) return;
      return pass_through(op, ks, stack);
    }
  }
  // Exceptions, passed straight through:
  // - meta tensors (FakeTensor propagation while Dynamo, AOTAutograd or make_fx traces: their
  //   kernels run on meta tensors below the Python key) carry no data to fuse;
  // - no callback (set_callbacks not called yet).
  if (ks.has_backend(c10::BackendComponent::MetaBit) || g_on_op == nullptr)
    return pass_through(op, ks, stack);
  // Note [The C++ hot path]: the op may be deferred in C++; else Python sees it, and when
  // Python ended a segment at it, the C++ hot path may begin the next one with it.
  // A harvest inside the hot path may pause the thread (Note [Cold plans]): then the op
  // passes through.
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (adaptive_eager::hot_path_op(op, ks, stack)) return;
    if (t_paused) return pass_through(op, ks, stack);
    if (adaptive_eager::thread_idle() &&
        (passed_when_idle(op) || adaptive_eager::aside_when_idle(op, stack)))
      return pass_through(op, ks, stack);
    if (call_python(op, stack)) return;
  }
  TORCH_CHECK(false, "adaptive_eager: ", op.schema().name(), " was sent back twice");
}

// "" when the fallback is registered (or was already, by us); else why not.
std::string install() {
  if (g_library) return "";
  try {
    auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kKey,
                                                    __FILE__, __LINE__);
    library->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
    g_library = std::move(library);
  } catch (const std::exception& err) {
    std::string message = err.what();
    return message.substr(0, message.find('\n'));
  }
  try {                     // (without them every op reaches the fallback: slower, the same)
    g_unboxed = adaptive_eager::register_unboxed();
  } catch (const std::exception&) {
  }
  return "";
}

// Note [Waking a paused thread]
// A paused thread whose program passes no control point (a bare loop, a decode loop) used to
// keep the key in its dispatch set, so that its fallback could ask every RESUME_EVERY ops
// whether the pause was over: ~0.2-1 us an op through the boxed pass-through, 5-10% of a small
// model's decode step. Instead such a thread takes the key out (plain eager) and is woken from
// another thread: a waker (dispatch/waking.py) arms a one-shot profile function on it
// (_PyEval_SetProfile, as Python 3.12's threading.setprofile_all_threads does for every
// thread), which runs at the thread's next Python call event, between two ops, removes itself
// and calls back into the runtime there, on the thread itself (whose TLS the key lives in). A
// thread running a profiler of its own is not touched: its pause keeps the key in.
int on_wake_event(PyObject* callback, PyFrameObject*, int, PyObject*) {
  PyThreadState* self = PyThreadState_Get();
  Py_INCREF(callback);                   // (removing the profile function drops its reference)
  _PyEval_SetProfile(self, nullptr, nullptr);
  PyObject* result = PyObject_CallNoArgs(callback);
  if (result == nullptr) PyErr_WriteUnraisable(callback);   // never into the program's code
  Py_XDECREF(result);
  Py_DECREF(callback);
  return 0;
}

// 1: armed (or armed already); 0: no such thread; -1: it runs a profiler of its own.
int wake_soon(unsigned long thread_id, py::object callback) {
  PyInterpreterState* interpreter = PyThreadState_GetInterpreter(PyThreadState_Get());
  for (PyThreadState* thread = PyInterpreterState_ThreadHead(interpreter); thread != nullptr;
       thread = PyThreadState_Next(thread)) {
    if (thread->thread_id != thread_id) continue;
    if (thread->c_profilefunc == &on_wake_event) return 1;
    if (thread->c_profilefunc != nullptr) return -1;
    if (_PyEval_SetProfile(thread, &on_wake_event, callback.ptr()) == 0) return 1;
    PyErr_Clear();                       // (an audit hook refused sys.setprofile: try later)
    return -1;
  }
  return 0;
}

// This thread's wake, disarmed if armed.
void wake_cancel() {
  PyThreadState* self = PyThreadState_Get();
  if (self->c_profilefunc == &on_wake_event) _PyEval_SetProfile(self, nullptr, nullptr);
}

}  // namespace

bool adaptive_eager::thread_paused() { return t_paused; }

bool adaptive_eager::passes_unboxed(const c10::OperatorHandle& op) {
  if (!t_paused || t_paused_ops + 1 >= g_resume_every) return false;   // (the fallback asks)
  if (t_paused_kernels && !adaptive_eager::paused_op_passes(op)) return false;
  ++t_paused_ops;
  ++t_unboxed_passes;
  return true;
}

void adaptive_eager::intercept_boxed(const c10::OperatorHandle& op, DispatchKeySet ks,
                                     torch::jit::Stack* stack) {
  fallback(op, ks, stack);
}

int adaptive_eager::host_sync_slot(const c10::OperatorHandle& op) {
  const int slot = idle_slot(op);
  return slot >= 0 && g_idle_host_sync[slot].load(std::memory_order_relaxed) ? slot : -1;
}

void adaptive_eager::count_idle_run(int slot) {
  g_idle_runs[slot].fetch_add(1, std::memory_order_relaxed);
}

void adaptive_eager::run_as_eager(const c10::OperatorHandle& op, DispatchKeySet ks,
                                  torch::jit::Stack* stack) {
  pass_through(op, ks, stack);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "adaptive_eager's C++ interception backend (Note [The Fake key])";
  m.def("install", &install, "Register the fallback: '' on success, else the reason.");
  m.def("unboxed_ops", [] { return g_unboxed ? adaptive_eager::unboxed_op_count() : 0; },
        "How many ops have a kernel of ours on the key (Note [Unboxed pass-through]).");
  m.def("unboxed_passes", [] { return t_unboxed_passes; },
        "Ops this thread passed through unboxed so far (Note [Unboxed pass-through]).");
  // Note [Storages without Python objects] (dispatch/escapes.py)
  m.def("storage_address", [](const at::Tensor& t) -> int64_t {
    return reinterpret_cast<int64_t>(t.storage().unsafeGetStorageImpl());
  }, "The address of a tensor's StorageImpl (UntypedStorage._cdata), making no storage object.");
  m.def("storage_weak_ref", [](const at::Tensor& t) -> int64_t {
    return reinterpret_cast<int64_t>(
        c10::raw::intrusive_ptr::make_weak(t.storage().unsafeGetStorageImpl()));
  }, "A weak reference to a tensor's StorageImpl, as UntypedStorage._weak_ref() makes one.");
  m.def("set_callbacks", [](py::object on_op, py::object should_resume, int64_t every) {
    Py_XDECREF(g_on_op);
    Py_XDECREF(g_should_resume);
    g_on_op = on_op.inc_ref().ptr();
    g_should_resume = should_resume.inc_ref().ptr();
    g_resume_every = every > 0 ? every : 1;
  });
  m.def("set_included", [](bool on) {
    bool previous = c10::impl::tls_is_dispatch_key_included(kKey);
    c10::impl::tls_set_dispatch_key_included(kKey, on);
    return previous;
  }, "Include the key in this thread's dispatch set (intercept); returns the previous state.");
  m.def("is_included", [] { return c10::impl::tls_is_dispatch_key_included(kKey); });
  m.def("set_excluded", [](bool on) {
    bool previous = c10::impl::tls_is_dispatch_key_excluded(kKey);
    c10::impl::tls_set_dispatch_key_excluded(kKey, on);
    return previous;
  }, "Exclude the key on this thread (ops the runtime runs itself); returns the previous state.");
  m.def("set_paused", [](bool on, bool kernels) {
    t_paused = on;
    t_paused_kernels = on && kernels;
    t_paused_ops = 0;
  }, py::arg("on"), py::arg("kernels") = false,
     "Pass this thread's ops straight through (asking should_resume now and then); with "
     "`kernels`, but for the settled kernels' segments (Note [Kernels while paused]).");
  m.def("is_paused", [] { return t_paused; });
  m.def("wake_soon", &wake_soon,
        "Call `callback` on thread `thread_id` at its next Python call event (Note [Waking a "
        "paused thread]): 1 armed, 0 no such thread, -1 it runs a profiler of its own.");
  m.def("wake_cancel", &wake_cancel, "Disarm this thread's wake, if armed.");
  m.def("pass_when_idle", &add_idle_op,
        "Run this op (name, overload, is it a host sync) straight through on a thread with no "
        "segment open (Note [Boundaries passed when idle]); a host sync also inside a run, where "
        "it reads nothing the run touches (Note [Ops aside]): its slot, or -1 if unknown or the "
        "table is full.");
  m.def("take_idle_counts", &take_idle_counts,
        "Runs of each pass_when_idle slot since the last call.");
  adaptive_eager::define_hot_path(m);
}
