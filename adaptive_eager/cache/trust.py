"""Which cache directories the program may load compiled code from (Note [Trusted cache]).

This module does not import torch (the CLI and the store use it).
"""
from __future__ import annotations

import os

# Note [Trusted cache]: an artifact is compiled code that the program loads and runs (a
# shared library inside, unpacked into Inductor's cache and opened). Whoever can write the
# cache directory can make the program run their code, so:
#   - the cache directory is created private to the user (0700), its artifact directories
#     too, and artifacts are written 0644 (whatever the umask);
#   - an artifact is loaded only when it, each directory from it up to the cache directory,
#     and the cache directory itself are owned by the user running the program and not
#     writable by group or others. Otherwise the runtime warns once and compiles afresh, as
#     for a damaged artifact (no per-op fallback: the segment is still fused), and does not
#     save artifacts there either.
# NEURON_ADAPTIVE_EAGER_CACHE_SHARED=1 says a directory is shared on purpose (a team's
# cache): directories are then created with the umask's permissions and nothing is checked.
# Modes and owners are read with os.stat, not os.access: root may write anything, and what
# matters is who else can. Inductor's own directory inside ours is not checked file by file:
# a private cache directory keeps everyone else out of it.

PRIVATE_DIR_MODE = 0o700
ARTIFACT_MODE = 0o644
_OTHERS_WRITE = 0o022


def _shared() -> bool:
    from adaptive_eager.config import config
    return config.CACHE_SHARED


def make_dirs(root: str, below: str = "") -> None:
    """Create the cache directory ``root`` and ``below`` it (a relative path) level by level,
    private unless the cache is shared."""
    mode = 0o777 if _shared() else PRIVATE_DIR_MODE
    path = root
    _make_dir(path, mode)
    for part in filter(None, below.split("/")):
        path = os.path.join(path, part)
        _make_dir(path, mode)


def _make_dir(path: str, mode: int) -> None:
    if os.path.isdir(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)   # above the cache dir: as usual
    try:
        os.mkdir(path, mode)
    except FileExistsError:                              # another process, just now
        pass


def why_untrusted(path: str, root: str) -> str | None:
    """Why code at ``path`` (inside cache directory ``root``, or a private transfer directory)
    must not be loaded; None when it may (always, for a cache shared on purpose)."""
    if _shared():
        return None
    for each in _owners_chain(path, root):
        try:
            status = os.stat(each)
        except OSError as err:
            return f"{each} cannot be checked ({err.strerror})"
        if status.st_uid != os.getuid():
            return f"{each} is owned by uid {status.st_uid}, not this user ({os.getuid()})"
        if status.st_mode & _OTHERS_WRITE:
            return f"{each} is writable by other users (mode {status.st_mode & 0o777:o})"
    return None


def distrusted_dir(root: str) -> bool:
    """Is there a cache directory ``root`` that nobody should load code from? (One that does
    not exist yet will be made private.)"""
    return os.path.isdir(root) and why_untrusted(root, root) is not None


def _owners_chain(path: str, root: str) -> list[str]:
    """``path`` and each directory above it up to ``root``; for a path outside ``root``,
    ``path`` and its directory."""
    path, root = os.path.abspath(path), os.path.abspath(root)
    if os.path.commonpath([path, root]) != root:
        return [path, os.path.dirname(path)]
    chain = [path]
    while chain[-1] != root:
        chain.append(os.path.dirname(chain[-1]))
    return chain
