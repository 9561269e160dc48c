"""Opt-in: glibc's malloc thresholds set where its own adaptation ends (Note [Allocator
thresholds])."""
import ctypes
import os
import subprocess
import sys

import pytest

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.runtime import allocator

# glibc's malloc statistics (mallinfo2, glibc >= 2.33): bytes in mmap'd blocks, heap size.
ALLOCATIONS = """
import ctypes, sys, torch
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "tuned":
    from adaptive_eager.runtime.allocator import keep_freed_memory
    assert keep_freed_memory()
mapped = libc.mallinfo2().hblkhd
step_tensor = torch.ones(1 << 18)                           # 1 MiB
mapped = libc.mallinfo2().hblkhd - mapped
blocks = [torch.ones(1 << 20) for _ in range(4)]            # 16 MiB, then freed
heap = libc.mallinfo2().arena
del blocks
print(mapped, heap - libc.mallinfo2().arena)
"""


def _allocate(variant: str) -> tuple[int, int]:
    """(bytes mmap'd for a 1 MiB tensor, bytes the heap gave back after 16 MiB were freed)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("MALLOC_")}
    run = subprocess.run([sys.executable, "-c", ALLOCATIONS, variant], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    mapped, given_back = run.stdout.split()
    return int(mapped), int(given_back)


@pytest.mark.skipif(allocator._mallopt() is None or not hasattr(ctypes.CDLL(None), "mallinfo2"),
                    reason="glibc >= 2.33 only")
def test_freed_tensor_memory_stays_for_reuse():
    mapped, _ = _allocate("untuned")
    assert mapped >= 1 << 20                 # glibc alone: a fresh mmap, faulted in, given back
    mapped, given_back = _allocate("tuned")
    assert mapped == 0 and given_back == 0   # from the heap, and kept there once freed


@pytest.fixture
def calls(monkeypatch):
    recorded = []
    monkeypatch.setattr(allocator, "_tuned", None)
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda *args: recorded.append(args) or 1)
    for name in allocator._USER_SETTINGS + ("GLIBC_TUNABLES",):
        monkeypatch.delenv(name, raising=False)
    return recorded


def test_thresholds_are_set_once_per_process(calls):
    assert allocator.keep_freed_memory() and allocator.keep_freed_memory()
    assert calls == [(allocator.M_MMAP_THRESHOLD, 32 << 20), (allocator.M_TRIM_THRESHOLD, 64 << 20)]


@pytest.mark.parametrize("name, value", [("MALLOC_TRIM_THRESHOLD_", "1000000"),
                                         ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4096")])
def test_a_programs_own_malloc_settings_are_kept(calls, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert not allocator.keep_freed_memory()
    assert calls == []
    assert allocator.why_left_alone() == "the environment sets malloc's own settings"


def test_another_malloc_is_left_alone_and_says_so(monkeypatch):
    monkeypatch.setattr(allocator, "_tuned", None)
    monkeypatch.setattr(allocator, "_mallopt", lambda: None)
    for name in allocator._USER_SETTINGS + ("GLIBC_TUNABLES",):
        monkeypatch.delenv(name, raising=False)
    assert allocator.why_left_alone() == "malloc is not glibc's"
    assert not allocator.keep_freed_memory()


def test_enable_leaves_malloc_alone_unless_asked(calls):
    """No process-wide side effect by default: the thresholds are an opt-in."""
    with ae.enabled():
        pass
    assert calls == []
    with config.patch(MALLOC_TUNING=True), ae.enabled():
        pass
    assert len(calls) == 2
