"""pytest-benchmark over the package's workloads (steady state, one process):

    pytest bench/ --benchmark-only [-k "chain8 and large"]

Not part of the default test run (pyproject: testpaths = ["tests"]). Cold start, first-iteration
latency and break-even need fresh processes: that is ``adaptive-eager bench``.
"""
from __future__ import annotations

import os
import tempfile

# Before torch is imported: this session compiles into caches of its own, so no result depends
# on what an earlier run left behind, and Inductor skips its slow gcc ISA probes.
_SESSION_DIR = tempfile.mkdtemp(prefix="adaptive-eager-bench-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_SESSION_DIR, "inductor")
os.environ["NEURON_ADAPTIVE_EAGER_CACHE_DIR"] = os.path.join(_SESSION_DIR, "cache")
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
