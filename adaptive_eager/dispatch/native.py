"""The C++ interception extension (csrc/intercept.cpp): built on first use, loaded, installed.

Note [Building the extension]
The extension is compiled with ``torch.utils.cpp_extension.load`` into
``<EXT_DIR>/<torch version>-<source hash>/`` (by default ``ext/`` in the user's default cache
directory, whatever CACHE_DIR a program sets: it is part of the install, not of a kernel
cache), so a new torch or a changed source never loads an old build, and the user's
processes build it once (``load`` holds a
lock file in that directory while it builds; a second process waits for it, then finds it
built). The build takes 10-30 s, so it never happens in the program: ``prepare()`` imports a
finished build at once (a few ms) or starts one in a subprocess and returns; a daemon
thread waits for it (no CPU, no GIL) and marks it landed; the program runs on the Python mode
meanwhile and switches at its next control point (dispatch/interceptor.py). No compiler, a
failed build or a key someone else took: one log line, and the Python mode for good. The
library is code the program loads, so it is trusted as artifacts are (Note [Trusted cache] in
cache/trust.py): built into a private directory, never loaded from one others can write.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
from types import ModuleType

from adaptive_eager.cache import trust
from adaptive_eager.config import _default_cache_dir, config

NAME = "adaptive_eager_intercept"
_CSRC = os.path.join(os.path.dirname(os.path.dirname(__file__)), "csrc")
SOURCES = tuple(os.path.join(_CSRC, name) for name in ("intercept.cpp", "hot_path.cpp",
                                                        "run_end.cpp", "plans.cpp",
                                                        "replay.cpp", "unboxed.cpp"))
HEADERS = tuple(os.path.join(_CSRC, name) for name in ("hot_path.h", "run.h", "plans.h"))
BUILD_TIMEOUT_S = 600          # a build (or a wait for another process's) taking longer fails
BUILD_LOG = "build.log"

log = logging.getLogger("adaptive_eager")

_lock = threading.Lock()
_module: ModuleType | None = None    # loaded and installed
_failure: str | None = None          # why the extension cannot be used in this process
_building: threading.Thread | None = None
_landed = threading.Event()          # a background build ended (well or not)
_listeners: list = []                # called (on the build thread) when it lands


def build_directory() -> str:
    import torch
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        with open(path, "rb") as handle:
            digest.update(handle.read())
    digest = digest.hexdigest()[:16]
    return os.path.join(config.EXT_DIR, f"{torch.__version__}-{digest}")


def _library_path(directory: str) -> str:
    return os.path.join(directory, NAME + ".so")


def loaded() -> ModuleType | None:
    """The installed extension, or None (not built yet, failed, or not wanted)."""
    return _module


def failure() -> str | None:
    return _failure


def landed() -> bool:
    """Has a background build ended since ``prepare()`` started one?"""
    return _landed.is_set()


def prepare(wait_s: float = 0.0) -> ModuleType | None:
    """The extension if it can be used now; else start building it in the background (once
    per process) and return None. ``wait_s``: wait that long for the build (tests, benches)."""
    global _building
    with _lock:
        if _module is not None or _failure is not None:
            return _module
        directory = build_directory()
        if os.path.exists(_library_path(directory)):
            return _load(directory)
        if trust.distrusted_dir(config.EXT_DIR):
            return _fail(f"the extension's directory is not private: "
                         f"{trust.why_untrusted(config.EXT_DIR, config.EXT_DIR)}")
        if _building is None:
            _building = threading.Thread(target=_build_in_background, args=(directory,),
                                         name="adaptive_eager-build", daemon=True)
            _building.start()
        thread = _building
    if wait_s:
        thread.join(wait_s)
        return finish()
    return None


def finish() -> ModuleType | None:
    """After a background build landed: load its result (call from a program thread)."""
    with _lock:
        if _module is not None or _failure is not None or not _landed.is_set():
            return _module
        directory = build_directory()
        if not os.path.exists(_library_path(directory)):
            return _fail(f"the build left no library (see {os.path.join(directory, BUILD_LOG)})")
        return _load(directory)


def _build_in_background(directory: str) -> None:
    try:
        _make_private_dirs(directory)
        env = dict(os.environ)
        env["NEURON_ADAPTIVE_EAGER"] = "0"          # the build must not run under us
        with open(os.path.join(directory, BUILD_LOG), "ab") as output:
            process = subprocess.Popen(
                [sys.executable, "-m", "adaptive_eager.dispatch.native", directory, *SOURCES],
                stdin=subprocess.DEVNULL, stdout=output, stderr=output, env=env)
            try:
                process.wait(BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    except OSError as err:
        log.debug("extension build could not start: %s", err)
    finally:
        _landed.set()
        for listener in list(_listeners):
            listener()


def _make_private_dirs(directory: str) -> None:
    """Create ``directory`` below EXT_DIR, private; the default cache directory above the
    default EXT_DIR too, as the cache would (made by the umask, group-writable under umask
    002, the cache directory would then be refused: Note [Trusted cache])."""
    home = _default_cache_dir()
    if os.path.dirname(os.path.abspath(config.EXT_DIR)) == os.path.abspath(home):
        trust.make_dirs(home)
    trust.make_dirs(config.EXT_DIR, os.path.relpath(directory, config.EXT_DIR))


def when_landed(listener) -> None:
    """Call ``listener()`` (on the build's thread; it must only set flags) once a background
    build ends; now if it has."""
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)
    if _landed.is_set():
        listener()


def _load(directory: str) -> ModuleType | None:
    """Import a finished build and register its fallback (holding ``_lock``)."""
    global _module
    started = time.perf_counter()
    untrusted = trust.why_untrusted(_library_path(directory), config.EXT_DIR)
    if untrusted:                          # Note [Trusted cache] (cache/trust.py)
        return _fail(f"the built extension is not loaded: {untrusted}")
    try:
        spec = importlib.util.spec_from_file_location(NAME, _library_path(directory))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as err:
        return _fail(f"the built extension does not import: {err}")
    taken = module.install()
    if taken:
        return _fail(f"DispatchKey::Fake is taken: {taken}")
    if not module.unboxed_ops():    # Note [Unboxed pass-through]: slower, the same results
        log.info("C++ interception: no unboxed pass-through (an op's kernel was refused); "
                 "every op goes through the boxed fallback")
    from adaptive_eager.dispatch.escapes import tell_outside_memory
    tell_outside_memory(module)
    _module = module
    log.debug("C++ interception loaded in %.3f s from %s", time.perf_counter() - started,
              directory)
    return module


def _fail(reason: str) -> None:
    global _failure
    _failure = reason
    level = logging.WARNING if config.BACKEND == "cpp" else logging.INFO
    log.log(level, "C++ interception unavailable, using the Python dispatch mode: %s", reason)
    return None


def forget() -> None:
    """Tests: forget a failure (a loaded, installed module stays: it cannot be unloaded)."""
    global _failure, _building
    with _lock:
        _failure, _building = None, None
        _landed.clear()


def _build(directory: str, sources: list[str]) -> None:
    """The build subprocess: compile (or wait for another process compiling) into
    ``directory``. Errors go to stderr, which is BUILD_LOG there. At the program's priority,
    like the compile worker (Note [Why a process] in runtime/worker.py): niced beside a busy
    program, it would take many minutes."""
    from torch.utils.cpp_extension import load
    load(name=NAME, sources=sources, build_directory=directory, extra_cflags=["-O2"],
         verbose=True)


if __name__ == "__main__":
    _build(sys.argv[1], sys.argv[2:])
