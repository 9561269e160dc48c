"""Stable digests of segment keys: the names the disk cache and the CLI will use.

Python's ``hash()`` is salted per process; xxhash over the key's repr is the same in every
process and on every machine with the same torch. Computed once per new key, never per op.
"""
from __future__ import annotations

import xxhash


def stable_digest(key: tuple) -> str:
    """16 hex digits naming a segment key."""
    return xxhash.xxh3_64_hexdigest(repr(key).encode())
