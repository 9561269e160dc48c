// A deferred or cold run of a thread along a plan's path (Note [The C++ hot path] in
// hot_path.cpp, Note [Cold plans] in plans.cpp): what hot_path.cpp builds op by op and
// run_end.cpp ends.
#pragma once

#include "plans.h"

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <utility>
#include <vector>

namespace adaptive_eager {

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

inline Layout layout_of(const at::Tensor& t) {
  return Layout{t.storage_offset(), Dims(t.sizes().begin(), t.sizes().end()),
                Dims(t.strides().begin(), t.strides().end()), t.scalar_type()};
}

// An output's place in memory, to know its unseen aliases (Note [Shallow copies]).
struct Placed {
  const c10::StorageImpl* storage;   // valid while the output's weak references hold it
  Layout layout;
  Ref ref;
  bool computed;                     // a computing op's output: the storage's new contents
};

struct Run {
  std::shared_ptr<const Trie> trie;   // the snapshot the run walks (plans stay alive)
  const Node* node = nullptr;
  const Node* first = nullptr;        // a deferred run's first node (where it started)
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
    first = nullptr;
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

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// An uninitialized tensor like `meta` (hot_path.cpp, from the pool where it is large);
// `pooled` says whether its storage is the pool's.
at::Tensor empty_like_meta(const Meta& meta, bool& pooled);

// A kernel path's first node stops starting deferred runs below one launch in this many
// runs started there (Note [Paths that lead nowhere] in hot_path.cpp).
constexpr int64_t kStartsPerLaunch = 4;

// End a thread's run (run_end.cpp): a deferred one fused, replayed for a trial, handed to
// Python's engine, or replayed where no kernel fits and left going on along the cold plans'
// path of the same calls (Note [Divergence in C++]); a cold one counted.
void end_run(Run& current);

// Counts since take_counts (hot_path.cpp defines them).
extern std::atomic<int64_t> g_ops_deferred, g_fused_runs, g_fused_ops, g_divergences;
extern std::atomic<int64_t> g_cold_runs, g_cold_ops, g_cold_misses, g_direct_runs;
extern std::atomic<int64_t> g_per_op_ops;

// Python's callbacks (set_hot_callbacks).
extern PyObject* g_launch;        // launch(handle, inputs, buffers, seconds) -> Launched
extern PyObject* g_takeover;      // takeover(segment, depth, inputs, outputs, cold timing)
extern PyObject* g_harvest;       // harvest(): take the plans' counts
extern PyObject* g_ran_per_op;    // ran_per_op(handle, seconds): a trial's per-op run
// A thread harvests after this many runs Python did not see, or this much of their wall
// time, whichever comes first (native_plans.HARVEST_EVERY, HARVEST_AFTER_S).
extern std::atomic<int64_t> g_harvest_every;
extern std::atomic<double> g_harvest_after_s;

}  // namespace adaptive_eager
