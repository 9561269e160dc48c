"""The fault switch: make the failures of adaptive_eager.faults happen, for a block::

    with faults.inject("compile_error"):
        ...                      # every compile raises; the program must not notice
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from adaptive_eager import faults
from adaptive_eager.faults import ENV_VAR, FAULTS, active

__all__ = ["FAULTS", "active", "inject"]


@contextlib.contextmanager
def inject(*names: str) -> Iterator[None]:
    """Make the named faults happen inside the block (and in workers started in it: they
    read ADAPTIVE_EAGER_TEST_FAULTS when they start)."""
    saved, saved_env = faults.in_effect(), os.environ.get(ENV_VAR)
    wanted = faults.parse(",".join(names)) | saved
    faults.set_in_effect(wanted)
    os.environ[ENV_VAR] = ",".join(sorted(wanted))
    try:
        yield
    finally:
        faults.set_in_effect(saved)
        if saved_env is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved_env
