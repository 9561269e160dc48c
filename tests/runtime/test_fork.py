"""Note [Fork]: a forked child (DataLoader workers, multiprocessing's fork start) runs plain eager
and leaves the parent's compile worker and cache database alone."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import adaptive_eager as ae
from helpers import MECHANICS_ENV, assert_equal, chain

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


class Normalized(Dataset):
    """Per-item ops in the worker, as datasets that normalize and augment do."""
    data = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return 64

    def __getitem__(self, index):
        modes = len(_get_current_dispatch_mode_stack())   # 0: plain eager here
        return chain(self.data[index % 16]), torch.tensor(modes)


def test_dataloader_workers_forked_under_the_runtime_run_plain_eager():
    loader = DataLoader(Normalized(), batch_size=8, num_workers=2,
                        multiprocessing_context="fork")
    x = torch.randn(64)
    with ae.enabled():
        batches = list(loader)
        parent = [chain(x) for _ in range(4)]        # the parent's runtime is unaffected
    for index, (values, modes) in enumerate(batches):
        assert modes.tolist() == [0] * 8, "the worker ran under the parent's runtime"
        expected = torch.stack([chain(Normalized.data[i % 16])
                                for i in range(index * 8, index * 8 + 8)])
        assert_equal(values, expected)
    for out in parent:
        assert_equal(out, chain(x))
    assert ae.stats().fused_executions >= 1


FORKING = textwrap.dedent("""
    import json, os, sqlite3, sys, torch
    import adaptive_eager as ae
    from adaptive_eager.cache.store import DB_NAME, TABLE
    from adaptive_eager.config import config
    from adaptive_eager.runtime import engine
    from adaptive_eager.runtime.compiler import use_compiler
    from adaptive_eager.testing import CountingCompiler
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    def chain(x):
        return ((x * 2 + 1).sin() * 3).cos()

    def other(x):
        return ((x - 1).exp() * 2).tanh()

    def rows():
        with sqlite3.connect(os.path.join(config.CACHE_DIR, DB_NAME)) as db:
            return db.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0]

    x = torch.randn(64)
    with use_compiler(CountingCompiler()), ae.enabled():
        for _ in range(4):
            chain(x)
        ae.sync(wait_compiles=120)                  # a worker runs; the database is open
        engine.shared_table().flush()
        before = rows()
        fresh = torch.randn(64)
        deferred = chain(fresh)                     # fused: filled when its segment ends
        pid = os.fork()
        if pid == 0:                                # a normal exit: atexit hooks run
            plain = not _get_current_dispatch_mode_stack()
            filled = torch.equal(deferred, ((fresh * 2 + 1).sin() * 3).cos())
            same = all(torch.equal(other(x), ((x - 1).exp() * 2).tanh()) for _ in range(4))
            sys.exit(4 if not filled else 0 if plain and same else 3)
        child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        after_child = rows()
        for _ in range(4):
            other(x)                                # the parent's worker still compiles
        ae.sync(wait_compiles=120)
        fused = [torch.equal(chain(x), ((x * 2 + 1).sin() * 3).cos()) for _ in range(3)]
    stats = ae.stats()
    print(json.dumps({"child": child, "before": before, "after_child": after_child,
                      "compiles": stats.compiles, "failures": stats.compile_failures,
                      "fused_right": all(fused)}))
""")


def test_a_forked_child_leaves_the_parents_worker_and_cache_alone(tmp_path):
    env = {**os.environ, **MECHANICS_ENV, "NEURON_ADAPTIVE_EAGER_ASYNC": "1",
           "NEURON_ADAPTIVE_EAGER_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", FORKING], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["child"] != 4, "the child got an unfilled buffer"
    assert report["child"] == 0, "the child ran under the parent's runtime"
    assert report["after_child"] == report["before"], "the child wrote the parent's database"
    assert report["compiles"] == 2 and report["failures"] == 0
    assert report["fused_right"]
