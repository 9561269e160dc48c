"""Inductor's cache directory for our compiles and loads only (Note [Our Inductor cache]).

Only ``ours()`` imports torch: the CLI uses the rest to clear the cache without it.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from typing import Iterator

from adaptive_eager.cache import trust
from adaptive_eager.fork_safety import reinit_in_child

ENV_VAR = "TORCHINDUCTOR_CACHE_DIR"
INDUCTOR_DIR = "inductor"        # under our cache directory
MARKER = ".adaptive-eager"       # in an Inductor directory we made: only such a one is cleared

# Note [Our Inductor cache]: a kernel artifact loads in ~8 ms when Inductor's cache directory
# already holds what its compile left there, ~5 s when it is empty (docs/design.md, "The kernel
# cache"), so our
# compiles and loads use one Inductor directory inside our cache: <CACHE_DIR>/inductor. Only
# ours do. Inductor finds its directory in TORCHINDUCTOR_CACHE_DIR at each use
# (torch/_inductor/runtime/cache_dir_utils.py: cache_dir(), which also *sets* the variable to
# its default when it is unset), so setting it for the whole process would move the user's
# own torch.compile cache into ours, where `adaptive-eager cache clear` would delete it.
#
# Importing Inductor calls cache_dir() too (torch/_dynamo/package.py builds its DynamoCache
# at import), so `ours()` first imports it as the program would have (leaving the variable as
# it found it), and only then moves the directory: Dynamo's cache stays the user's.
#
# So, in the user's process, `ours()` sets the variable around each of our calls into
# Inductor and puts back what was there (or nothing) afterwards, clearing Inductor's
# in-memory caches on the way in and out as Inductor's own temporary_cache_dir() does (some
# memoize paths under the directory). A lock keeps two of our threads from interleaving
# their swaps; a thread of the user compiling at the very same moment would see our
# directory for that moment (its compile still works; its cache entry lands in ours). The
# longest such moment is the CPU ISA probe before the first load (up to ~7 s, on our loader
# thread, unless TORCHINDUCTOR_VEC_ISA_OK is set). The
# compile worker is our process: it sets the variable once for itself (worker.serve), and
# ours() does nothing there. Precompiled headers (codecache._HEADER_DIR) live under
# Inductor's default directory whatever the variable says, and are not ours to clear.
#
# `adaptive-eager cache clear` removes <CACHE_DIR>/inductor only if it holds MARKER, which
# claim() writes when we first use it: a directory a user made there, or pointed
# TORCHINDUCTOR_CACHE_DIR at, is left alone.

# What our compiles and loads import: imported before the directory moves (they all import
# torch._dynamo, whose import fixes Dynamo's cache directory).
_INDUCTOR_MODULES = ("torch._inductor.codecache", "torch._inductor.async_compile",
                     "torch._inductor.compile_fx", "torch._inductor.cpu_vec_isa",
                     "torch._inductor.standalone_compile")

_lock = threading.RLock()
reinit_in_child(_lock)   # Note [Fork] (runtime/engine.py)


def inductor_dir(cache_dir: str) -> str:
    """Where our compiles keep Inductor's cache, for the cache directory ``cache_dir``."""
    return os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), INDUCTOR_DIR)


def claim(directory: str) -> None:
    """Create ``directory`` for Inductor and mark it ours (so that `cache clear` may remove
    it). OSError when it cannot be written."""
    trust.make_dirs(os.path.dirname(directory), os.path.basename(directory))
    marker = os.path.join(directory, MARKER)
    if not os.path.exists(marker):
        with open(marker, "w") as handle:
            handle.write("Inductor's cache for adaptive-eager's compiles; "
                         "`adaptive-eager cache clear` removes this directory.\n")


def is_ours(directory: str) -> bool:
    """Did we make ``directory`` (and may `cache clear` remove it)? Never a directory that
    this process's TORCHINDUCTOR_CACHE_DIR names."""
    user = os.environ.get(ENV_VAR)
    if user and os.path.realpath(user) == os.path.realpath(directory):
        return False
    return os.path.isfile(os.path.join(directory, MARKER))


@contextlib.contextmanager
def ours(cache_dir: str | None = None) -> Iterator[str]:
    """Inside the block, Inductor caches into our directory; outside, wherever the user's
    TORCHINDUCTOR_CACHE_DIR (or Inductor's default) says. Yields the directory."""
    if cache_dir is None:
        from adaptive_eager.config import config
        cache_dir = config.CACHE_DIR
    directory = inductor_dir(cache_dir)
    with _lock:
        saved = os.environ.get(ENV_VAR)
        if saved == directory:            # the worker, or a block inside a block
            yield directory
            return
        _import_inductor(saved)
        with contextlib.suppress(OSError):    # unwritable: Inductor's compile says so
            claim(directory)
        os.environ[ENV_VAR] = directory
        _clear_inductor_memos()
        try:
            yield directory
        finally:
            _restore(saved)
            _clear_inductor_memos()


def use_for_process(cache_dir: str) -> None:
    """Our own processes only (the compile worker): Inductor caches into ours throughout."""
    directory = inductor_dir(cache_dir)
    with contextlib.suppress(OSError):
        claim(directory)
    os.environ[ENV_VAR] = directory


def _import_inductor(saved: str | None) -> None:
    """Import what our calls use, as the program would have: with the user's directory, and
    the variable left as it was (Inductor sets it to its default where it was unset)."""
    if all(name in sys.modules for name in _INDUCTOR_MODULES):
        return
    try:
        for name in _INDUCTOR_MODULES:
            importlib.import_module(name)
    finally:
        _restore(saved)


def _restore(saved: str | None) -> None:
    if saved is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = saved


def _clear_inductor_memos() -> None:
    """Forget what Inductor memoized under the other directory (nothing before it is
    imported)."""
    utils = sys.modules.get("torch._inductor.utils")
    if utils is not None:
        utils.clear_caches()
