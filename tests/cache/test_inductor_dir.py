"""Our compiles use an Inductor cache directory of their own; the user's torch.compile cache
(TORCHINDUCTOR_CACHE_DIR, or Inductor's default) is never moved, nor cleared
(Note [Our Inductor cache])."""
import os

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.cache import api, inductor_dir
from adaptive_eager.config import config
from helpers import assert_equal, chain

ENV = "TORCHINDUCTOR_CACHE_DIR"


def _users_cache(tmp_path):
    """A user's own Inductor cache directory, with one file of theirs in it."""
    directory = tmp_path / "users-inductor"
    directory.mkdir()
    (directory / "theirs").write_bytes(b"a user's torch.compile cache entry")
    return directory


def test_ours_restores_the_users_setting_and_an_unset_one(tmp_path, monkeypatch):
    users = _users_cache(tmp_path)
    monkeypatch.setenv(ENV, str(users))
    with inductor_dir.ours(str(tmp_path / "cache")) as ours:
        assert os.environ[ENV] == ours == str(tmp_path / "cache" / "inductor")
    assert os.environ[ENV] == str(users)
    monkeypatch.delenv(ENV)
    with inductor_dir.ours(str(tmp_path / "cache")):
        with inductor_dir.ours(str(tmp_path / "cache")):      # nested: still ours
            assert os.environ[ENV] == ours
        assert os.environ[ENV] == ours
    assert ENV not in os.environ
    assert inductor_dir.is_ours(ours)


def test_clear_keeps_an_inductor_directory_we_did_not_make(tmp_path, monkeypatch):
    """Neither the user's TORCHINDUCTOR_CACHE_DIR, even where it is <cache>/inductor, nor a
    directory there without our marker, is removed by `cache clear`."""
    cache = tmp_path / "cache"
    store = api.Store(str(cache))
    store.records()
    users = cache / "inductor"
    users.mkdir()
    (users / "theirs").write_bytes(b"entry")
    assert api.clear(store) == 0
    assert (users / "theirs").exists()                        # no marker: not ours
    inductor_dir.claim(str(users))
    monkeypatch.setenv(ENV, str(users))                       # the user's, marker or not
    api.clear(store)
    assert (users / "theirs").exists()
    monkeypatch.delenv(ENV)
    api.clear(store)
    assert not users.exists()
    store.close()


@pytest.mark.inductor
@pytest.mark.parametrize("users_setting, background", [("unset", False), ("set", False),
                                                        ("unset", True)])
def test_compiling_and_clearing_leave_the_users_inductor_cache_alone(
        tmp_path, monkeypatch, users_setting, background):
    """A real compile (here, or in the worker process), its artifact saved and loaded again:
    Inductor's files land in our directory, the user's setting is what it was (unset stays
    unset), and `cache clear` removes ours but not one file of the user's."""
    users = _users_cache(tmp_path)
    if users_setting == "set":
        monkeypatch.setenv(ENV, str(users))
    else:
        monkeypatch.delenv(ENV, raising=False)
    before = os.environ.get(ENV)
    x = torch.randn(1 << 12)
    with config.patch(ASYNC=background), ae.enabled():
        outs = [chain(x) for _ in range(3)]
        ae.sync(wait_compiles=300)
        outs += [chain(x) for _ in range(2)]
        ae.sync()
    assert ae.stats().compiles == 1 and ae.stats().fused_executions >= 1
    for out in outs:
        assert_equal(out, chain(x))
    assert os.environ.get(ENV) == before
    ours = inductor_dir.inductor_dir(config.CACHE_DIR)
    assert inductor_dir.is_ours(ours) and len(os.listdir(ours)) > 1
    ae.reset()                                     # writes the record; drops the kernel
    with ae.enabled():                             # a warm start: loads the artifact
        assert_equal(chain(x), chain(x))
        outs = [chain(x) for _ in range(2)]
        ae.sync()
    assert ae.stats().cache_hits_disk == 1
    assert os.environ.get(ENV) == before
    store = api.open_store()
    assert api.clear(store) >= 1
    store.close()
    assert not os.path.exists(ours)
    assert sorted(os.listdir(users)) == ["theirs"]
