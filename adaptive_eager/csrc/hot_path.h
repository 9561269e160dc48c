// The hot path in C++ (Note [The C++ hot path] in hot_path.cpp).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>

namespace torch { class Library; }

namespace adaptive_eager {

// An op of an intercepting, unpaused thread. True: deferred here, its outputs are on the
// stack; false: Python must see it (any deferred run has been ended first).
bool hot_path_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

// An op of a thread paused with its kernels on (Note [Kernels while paused]). True: deferred
// here; false: it passes straight through (any deferred run has been ended first).
bool paused_op(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

// Is this thread paused (passing ops straight through, but for its kernels: intercept.cpp)?
bool thread_paused();

// Note [Unboxed pass-through] (unboxed.cpp). Would the fallback only pass this op straight
// through (counted as a paused op if so)? intercept_boxed is the fallback itself.
bool passes_unboxed(const c10::OperatorHandle& op);
void intercept_boxed(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                     torch::jit::Stack* stack);
// Would paused_op pass this op straight through, whatever its arguments: no run deferred
// and no settled kernel's path starting with its operator?
bool paused_op_passes(const c10::OperatorHandle& op);
// Kernels of our own on the key for the most common ops: registered while the returned
// library lives (throws where the dispatcher refuses one); how many ops it covers.
std::unique_ptr<torch::Library> register_unboxed();
int64_t unboxed_op_count();

// Does this thread run on the C++ hot path with no segment open, neither Python's nor a run
// of its own (Note [Boundaries passed when idle] in intercept.cpp)?
bool thread_idle();

// Note [Ops aside] (runtime/aside.py). The slot of a host sync Python named (pass_when_idle),
// or -1; count_idle_run counts a run of it, as Python counts its own.
int host_sync_slot(const c10::OperatorHandle& op);
void count_idle_run(int slot);

// Is it an op of 0-dim CPU tensors only, run as it comes on a thread with nothing open
// (counted)?
bool aside_when_idle(const c10::OperatorHandle& op, const torch::jit::Stack* stack);

// Run the op below the interception, as eager would.
void run_as_eager(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

// Is Python's answer to an op "a segment just ended at it: try your hot path, then ask me
// again" (the stack is untouched)?
bool is_retry(PyObject* answer);

// The module functions that register compiled segments and end runs from Python.
void define_hot_path(pybind11::module& m);

}  // namespace adaptive_eager
