"""Compiled code is loaded only from a cache nobody else can write (Note [Trusted cache]).

Tests run as root here, which may write anything: modes and owners are what is checked (os.stat),
so chmod and chown on the test's own directory stand for another user's access."""
import logging
import os
import stat

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.cache.store import Store
from adaptive_eager.config import config
from helpers import assert_equal, chain

OTHER_UID = 54321          # no user of this machine


def _run(x, times=4):
    with ae.enabled():
        outs = [chain(x) for _ in range(times)]
    for out in outs:
        assert_equal(out, chain(x))
    stats = ae.stats()
    ae.reset()                       # a new process: nothing in memory, the same directory
    return stats


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _artifact():
    [record] = Store(config.CACHE_DIR).records()
    return Store(config.CACHE_DIR).artifact_file(record.artifact)


def test_the_cache_directory_is_created_private(compiler):
    old_umask = os.umask(0o002)                 # a umask that lets the group write
    try:
        _run(torch.randn(16))
    finally:
        os.umask(old_umask)
    store = Store(config.CACHE_DIR)
    assert _mode(config.CACHE_DIR) == 0o700
    assert _mode(os.path.dirname(store.artifact_dir)) == _mode(store.artifact_dir) == 0o700
    assert _mode(_artifact()) == 0o644


def test_a_shared_cache_directory_takes_the_umask(compiler):
    old_umask = os.umask(0o002)
    try:
        with config.patch(CACHE_SHARED=True):
            _run(torch.randn(16))
    finally:
        os.umask(old_umask)
    assert _mode(config.CACHE_DIR) == 0o775


@pytest.mark.parametrize("tamper", ["dir_group_writable", "dir_other_writable",
                                    "dir_foreign_owner", "artifact_writable",
                                    "artifact_foreign_owner", "artifacts_dir_writable"])
def test_a_cache_others_can_write_is_not_loaded_from(compiler, caplog, tamper):
    """The second run compiles afresh (with one warning) instead of loading compiled code
    another user could have put there; with CACHE_SHARED=1 it loads as usual."""
    x, y = torch.randn(16), torch.randn(8)            # two keys: still one warning
    _run(x), _run(y)
    store = Store(config.CACHE_DIR)
    target = {"dir": config.CACHE_DIR, "artifact": _artifacts(store),
              "artifacts": [store.artifact_dir]}[tamper.split("_")[0]]
    for path in target if isinstance(target, list) else [target]:
        if tamper.endswith("foreign_owner"):
            os.chown(path, OTHER_UID, -1)
        else:
            os.chmod(path, _mode(path) | (0o020 if "group" in tamper else 0o002))
    loads = compiler.loads
    with caplog.at_level(logging.WARNING, logger="adaptive_eager"):
        with ae.enabled():
            outs = [f(v) for f, v in ((chain, x), (chain, y)) for _ in range(4)]
        stats = ae.stats()
    for out, v in zip(outs, [x] * 4 + [y] * 4):
        assert_equal(out, chain(v))
    assert compiler.loads == loads and stats.cache_hits_disk == 0 and stats.compiles == 2
    assert stats.fused_executions > 0                  # compiled afresh, still fused
    told = [m for m in caplog.messages if "not loading compiled kernels" in m]
    assert len(told) == 1 and "CACHE_SHARED" in told[0]
    ae.reset()
    with config.patch(CACHE_SHARED=True):              # shared on purpose: loaded
        stats = _run(x)
    assert stats.cache_hits_disk == 1 and stats.compiles == 0


def _artifacts(store):
    return [store.artifact_file(record.artifact) for record in store.records()
            if record.artifact]


def test_the_worker_ships_through_a_private_directory_when_the_cache_is_not_trusted(
        compiler):
    """A background compile for a cache others can write: the kernel still arrives (through
    a private temporary directory) and runs fused; nothing is written into that cache."""
    Store(config.CACHE_DIR).records()                  # creates it, private
    os.chmod(config.CACHE_DIR, 0o777)
    x = torch.randn(64)
    with config.patch(ASYNC=True, COMPILE_TIMEOUT_S=120):
        with ae.enabled():
            outs = [chain(x) for _ in range(3)]
            ae.sync(wait_compiles=120)
            outs += [chain(x) for _ in range(3)]
        stats = ae.stats()
    for out in outs:
        assert_equal(out, chain(x))
    assert stats.compiles == 1 and stats.fused_executions >= 2
    assert os.listdir(Store(config.CACHE_DIR).artifact_dir) == []
