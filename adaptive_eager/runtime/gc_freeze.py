"""Freezing the GC's view of long-lived objects, so full collections stay short (Note [GC
stalls]). ``api.enable()`` freezes torch's own objects; the first kernel installed freezes what
Inductor's imports made; ``api.disable()`` unfreezes.
"""
from __future__ import annotations

import gc

_frozen_at: set[str] = set()     # the moments this process froze the GC at (Note [GC stalls])
_user_froze = False              # the program had frozen objects itself: never unfreeze them


def freeze_gc(moment: str) -> None:
    """Note [GC stalls]: a full collection walks every tracked object: ~165k after importing
    torch (~90 ms here), ~377k once Inductor is imported (~200 ms stalls; docs/design.md,
    "Process-wide concerns"). The
    recording path allocates far more objects per op than eager does, so it triggers full
    collections eager would not; freezing what exists at ``moment`` ("enable": torch's own
    objects; "inductor": after the first kernel arrives) takes them out of collections. Each
    moment freezes once: objects frozen are still freed when unreferenced, only cycles among
    them wait for ``unfreeze_gc`` (disable())."""
    global _user_froze
    if moment in _frozen_at:
        return
    if not _frozen_at and gc.get_freeze_count():
        _user_froze = True
    _frozen_at.add(moment)
    gc.freeze()


def unfreeze_gc() -> None:
    global _user_froze
    if _frozen_at:
        _frozen_at.clear()
        if not _user_froze:          # theirs and ours cannot be told apart: keep both frozen
            gc.unfreeze()
        _user_froze = False

