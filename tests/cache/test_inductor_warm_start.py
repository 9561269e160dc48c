"""Warm start with real Inductor artifacts, across two processes (slow: one real compile)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.inductor

SCRIPT = textwrap.dedent("""
    import time
    started = time.perf_counter()
    import torch
    import adaptive_eager as ae
    x = torch.randn(1 << 20)      # its ops compute well above the cost gates (MIN_SEGMENT_US)
    expected = ((x * 2 + 1).sin() * 3).cos()
    first_fused, results = None, []
    with ae.enabled():
        for i in range(6):
            y = ((x * 2 + 1).sin() * 3).cos()
            ae.sync()
            if first_fused is None and ae.stats().fused_executions:
                first_fused = i
            results.append(y)
    assert all(torch.allclose(y, expected, atol=1e-6) for y in results)
    s = ae.stats()
    print("compiles", s.compiles, "disk", s.cache_hits_disk, "first_fused", first_fused,
          "seconds %.2f" % (time.perf_counter() - started))
""")


def test_second_process_loads_the_inductor_kernel(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "NEURON_ADAPTIVE_EAGER_CACHE_DIR": str(tmp_path / "cache"),
           "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD": "3", "NEURON_ADAPTIVE_EAGER_ASYNC": "0"}
    env.pop("TORCHINDUCTOR_CACHE_DIR")          # ours keeps Inductor's cache inside it
    runs = [subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                           text=True, timeout=600) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert "compiles 1 disk 0 first_fused 3" in runs[0].stdout, runs[0].stdout
    assert "compiles 0 disk 1 first_fused 1" in runs[1].stdout, runs[1].stdout
    assert (tmp_path / "cache" / "inductor").is_dir()
