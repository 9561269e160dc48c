"""Keeping freed CPU tensor memory for the next step (glibc malloc).

# Note [Allocator thresholds]
CPU tensors come from malloc. glibc serves a block of at least M_MMAP_THRESHOLD (128 KiB at
start) with a fresh mmap, whose pages fault in on first touch and go back to the OS on free,
and it gives free memory at the top of its heap back once there is more than
M_TRIM_THRESHOLD of it. Both thresholds grow as the program frees mmap'd blocks (up to 32 and
64 MiB), so how many pages each training step faults in depends on which blocks the program
happened to free first. The runtime changes that order (a segment holds its inputs until it
ends; an optimizer's first step runs plainly): in a small MLP's training, whose tensors are
128-512 KiB, a process faulted ~480 pages in every step where the same program in another
process faulted none. So the first enable() sets both thresholds where glibc's own
adaptation ends (32 and 64 MiB), and steady steps reuse freed memory whatever the order.
The price: up to 64 MiB of freed memory stays with the process, as tcmalloc (which PyTorch's
CPU launcher, torch.backends.xeon.run_cpu, preloads by default) keeps freed memory too.
A program that chose its own malloc settings (MALLOC_*_ variables, GLIBC_TUNABLES) keeps
them; another allocator (LD_PRELOAD=libjemalloc.so) never sees the call; and
NEURON_ADAPTIVE_EAGER_MALLOC_TUNING=0 leaves malloc alone.
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1      # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20    # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit machines
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES   # what glibc sets beside it
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_")

_tuned: bool | None = None     # None: not tried yet in this process


def _user_chose_malloc_settings() -> bool:
    return any(name in os.environ for name in _USER_SETTINGS) or \
        "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def _mallopt():
    """glibc's mallopt, or None (macOS, Windows, musl: no such thresholds to set)."""
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):      # no confstr, or not this name
        return None
    if not libc.startswith("glibc"):
        return None
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None


def why_left_alone() -> str | None:
    """Why keep_freed_memory() would leave malloc alone in this process (None: it would not)."""
    if _user_chose_malloc_settings():
        return "the environment sets malloc's own settings"
    if _mallopt() is None:
        return "malloc is not glibc's"
    return None


def keep_freed_memory() -> bool:
    """Note [Allocator thresholds]: set glibc's thresholds once per process. True if they are
    set (now or before); False where they are left alone."""
    global _tuned
    if _tuned is None:
        mallopt = None if _user_chose_malloc_settings() else _mallopt()
        _tuned = mallopt is not None and \
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and \
            mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return _tuned
