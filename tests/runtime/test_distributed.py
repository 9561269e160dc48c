"""DDP on gloo, two processes on this machine: parameters equal eager DDP's; collectives are
boundaries; both ranks share one kernel cache."""
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from helpers import MECHANICS_ENV

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not built")


def test_ddp_gloo_two_ranks_equal_eager_ddp(tmp_path):
    job = os.path.join(os.path.dirname(__file__), "ddp_job.py")
    env = {**os.environ, **MECHANICS_ENV, "NEURON_ADAPTIVE_EAGER_HOT_THRESHOLD": "2",
           "NEURON_ADAPTIVE_EAGER_CACHE_DIR": str(tmp_path / "shared-cache"),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    ranks = [subprocess.Popen([sys.executable, job, str(rank), str(tmp_path / "rendezvous")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outputs = [rank.communicate(timeout=600) for rank in ranks]
    for (out, err), rank in zip(outputs, ranks):
        assert rank.returncode == 0, err
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for report in reports:
        assert report["same"] is True                 # parameters equal eager DDP's
        assert report["fused"] > 0                    # and fusion happened
        assert report["collective"] > 0              # all-reduces ran as boundaries
    assert sum(r["compiles"] + r["disk"] for r in reports) >= 2
