"""Fault injection points, for the tests of the failure paths. Not a user feature.

Each fault makes one thing go wrong at its place in the code (the ``check_*`` calls and
``damaged_kernel`` below), so every recovery path can be exercised on purpose and
reproducibly. Tests switch faults on with ``adaptive_eager.testing.faults.inject``, which
also sets ``ADAPTIVE_EAGER_TEST_FAULTS`` in the environment, so compile workers started inside
the block inherit the faults (a worker reads it once, when it starts).
"""
from __future__ import annotations

import errno
import os

ENV_VAR = "ADAPTIVE_EAGER_TEST_FAULTS"

FAULTS = {
    "compile_error": "the compiler raises (in the program or in the worker)",
    "wrong_arity": "kernels take other arguments than the segment's: they raise when run",
    "wrong_values": "kernels run but write wrong-shaped garbage into every tensor they get",
    "worker_crash": "the compile worker process dies in the middle of a compile",
    "worker_hang": "the compile worker never answers (COMPILE_TIMEOUT_S must fire)",
    "disk_full": "every write into the cache directory fails with ENOSPC",
}


def parse(text: str) -> frozenset:
    names = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = names - set(FAULTS)
    if unknown:
        raise ValueError(f"{ENV_VAR}: unknown faults {sorted(unknown)}; known: {sorted(FAULTS)}")
    return names


_active: frozenset = parse(os.environ.get(ENV_VAR, ""))


def active(name: str) -> bool:
    return name in _active


def in_effect() -> frozenset:
    return _active


def set_in_effect(names: frozenset) -> None:
    """The faults that happen from now on in this process (testing.faults.inject)."""
    global _active
    _active = names


def check_disk_write(directory: str) -> None:
    """Raise the OSError a full disk would, when ``disk_full`` is injected."""
    if active("disk_full"):
        raise OSError(errno.ENOSPC, "No space left on device (injected fault)", directory)


def check_compile(in_worker: bool = False) -> None:
    if active("compile_error"):
        raise RuntimeError("compiler failure (injected fault)")
    if in_worker and active("worker_crash"):
        os._exit(3)
    if in_worker and active("worker_hang"):
        import time
        time.sleep(24 * 3600)


def damaged_kernel(kernel):
    """The kernel a broken compiler would return, when ``wrong_arity``/``wrong_values`` is
    injected; else ``kernel`` itself."""
    if active("wrong_arity"):
        return lambda first: kernel(first)
    if active("wrong_values"):
        def garbage(*tensors):
            import torch
            for tensor in tensors:
                if tensor.is_floating_point() and tensor.numel():
                    # a wrong-shaped result broadcast into the output, as a bad kernel would
                    tensor.copy_(torch.full((1,), 12345.0, dtype=tensor.dtype))
        return garbage
    return kernel
