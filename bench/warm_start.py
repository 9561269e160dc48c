"""Cold vs warm start: time to the first fused execution in a first and a second process.

    python bench/warm_start.py

Runs the same short job twice in fresh processes on one empty cache directory: the first
compiles, the second should load the kernel from disk. Prints, per run: seconds from process
start to the first fused step, compile seconds, artifact load seconds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

JOB = textwrap.dedent("""
    import json, time
    started = time.perf_counter()
    import torch
    import adaptive_eager as ae
    imported = time.perf_counter() - started
    x = torch.randn(1 << 20)
    first_fused = None
    with ae.enabled():
        for step in range(8):
            y = torch.tanh((x * 1.5 + 0.25).sin() * x) - 0.5
            ae.sync()
            if first_fused is None and ae.stats().fused_executions:
                first_fused = (step, time.perf_counter() - started)
    s = ae.stats()
    print(json.dumps({"import_s": imported, "first_fused_step": first_fused[0],
                      "first_fused_s": first_fused[1], "compiles": s.compiles,
                      "compile_s": s.compile_seconds, "disk_hits": s.cache_hits_disk,
                      "load_s": s.cache_load_seconds}))
""")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="ae-warm-") as directory:
        # Synchronous compiles, so "first fused step" compares compiling with loading.
        env = {**os.environ, "NEURON_ADAPTIVE_EAGER_CACHE_DIR": os.path.join(directory, "c"),
               "NEURON_ADAPTIVE_EAGER_ASYNC": "0",
               "TORCHINDUCTOR_VEC_ISA_OK": os.environ.get("TORCHINDUCTOR_VEC_ISA_OK", "1")}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        print(f"{'run':<8}{'first fused step':>17}{'s to it':>9}{'compiles':>9}"
              f"{'compile s':>10}{'loads':>6}{'load ms':>9}")
        for run in ("first", "second"):
            out = subprocess.run([sys.executable, "-c", JOB], env=env, capture_output=True,
                                 text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(f"{run:<8}{row['first_fused_step']:>17}{row['first_fused_s']:>9.2f}"
                  f"{row['compiles']:>9}{row['compile_s']:>10.2f}{row['disk_hits']:>6}"
                  f"{row['load_s'] * 1e3:>9.1f}")


if __name__ == "__main__":
    main()
