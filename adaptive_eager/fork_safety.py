"""Fork hooks (Note [Fork] in runtime/engine.py). ``os.register_at_fork`` is POSIX-only: where
it is missing, processes never fork, and there is nothing to do."""
from __future__ import annotations

import os
from typing import Callable


def at_fork(**hooks: Callable[[], None]) -> None:
    """``os.register_at_fork(**hooks)`` where processes can fork."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(**hooks)


def reinit_in_child(*locks) -> None:
    """Make ``locks`` anew in a forked child: a thread of the parent may have held one at the
    fork, and no thread of the child would ever release it."""
    for lock in locks:
        at_fork(after_in_child=lock._at_fork_reinit)
