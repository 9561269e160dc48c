"""The keys the table knows: one ``KeyEntry`` per key, one ``Structure`` per op structure.

At most MAX_KEYS keys are kept, least recently seen forgotten first (what was decided about
them stays on disk); keys seen once shrink to a sighting (Note [Keys seen once]); keys that
differ only in shapes share a structure, which counts its shapes (Note [Megamorphic]).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable

import cachetools

from adaptive_eager.config import config
from adaptive_eager.runtime import scalars
from adaptive_eager.runtime.decisions import decide, logged as decision_logged
from adaptive_eager.runtime.entries import KeyEntry, KeyState, Structure, structure_of
from adaptive_eager.runtime.records import Records
from adaptive_eager.runtime.segment import Segment
from adaptive_eager.runtime.stats import counters

# Note [Keys seen once]: a key is kept whole (its recorded ops, ~100-180 GC-tracked objects)
# while it is among the last SEEN_ONCE_KEPT keys seen just once; older ones shrink to a
# sighting (see KeyBook.shrink_seen_once).
SEEN_ONCE_KEPT = 64
RECENCY_RUNS = 64     # see KeyBook.sight_again


class KeyBook:
    def __init__(self, records: Records, release: Callable[[KeyEntry], None]) -> None:
        """``release(entry)`` lets go of what else holds a key being forgotten (its place
        in the compile queue, a generic kernel's place in the trie)."""
        self._records = records
        self._release = release
        self._entries: OrderedDict[tuple, KeyEntry] = OrderedDict()   # least recently seen 1st
        # structure -> shape variants seen; an LRU so ever-new structures stay bounded
        self._structures = cachetools.LRUCache(maxsize=config.MAX_KEYS)
        # Note [Keys seen once]: keys of _entries seen once, oldest first; and what is left of
        # older ones, by hash(key)
        self._seen_once: OrderedDict[tuple, None] = OrderedDict()
        # (first_seen, megamorphic): a plain tuple of atoms, which the GC stops tracking (a
        # NamedTuple it would track for good)
        self._sightings: OrderedDict[int, tuple[float, bool]] = OrderedDict()
        # hash(structure key) -> shapes it was seen in, for structures dropped with their one
        # key: the count goes on when another shape comes (Note [Megamorphic])
        self._structure_counts: OrderedDict[int, int] = OrderedDict()

    def entries(self) -> list[KeyEntry]:
        return list(self._entries.values())

    def sight(self, segment: Segment) -> KeyEntry:
        """The entry of ``segment``'s key, counted as seen once more (a new one past MAX_KEYS
        makes the least recently seen forgotten); its stored record recalled when due."""
        entry = self._entries.get(segment.key)
        if entry is None:
            entry = self._entries[segment.key] = self._new_entry(segment)
            self._forget_least_recent()
        else:
            self._entries.move_to_end(segment.key)
        entry.sighted(1)
        if entry.seen == 2:
            self._seen_once.pop(segment.key, None)
        if not entry.recalled and (entry.seen >= 2 or config.HOT_THRESHOLD <= 1):
            self._records.recall(entry)
        return entry

    def sight_again(self, entry: KeyEntry, runs: int) -> bool:
        """``runs`` more sightings of a known ``entry`` (Note [Cold plans] in
        csrc/plans.cpp); False if it was forgotten meanwhile. Its place among the most
        recently seen is renewed every RECENCY_RUNS runs: each renewal hashes its whole key
        (~10 us for a few dozen ops), more than counting the runs costs."""
        if entry.forgotten:
            return False
        if entry.seen - entry.renewed_at >= RECENCY_RUNS:
            entry.renewed_at = entry.seen
            self._entries.move_to_end(entry.segment.key)
        entry.sighted(runs)
        return True

    def _forget_least_recent(self) -> None:
        """Keep at most MAX_KEYS entries: forget the least recently seen that hold no kernel
        of their own and are not compiling (what was decided about them stays on disk), never
        the newest. A shape served by a generic kernel is forgotten with its place in the
        trie; it is served again after its next per-op run."""
        excess = len(self._entries) - config.MAX_KEYS
        if excess <= 0:
            return
        older = itertools.islice(self._entries.items(), len(self._entries) - 1)
        forgettable = list(itertools.islice(
            (key for key, entry in older
             if entry.generic or entry.state not in (KeyState.READY, KeyState.COMPILING)),
            excess))
        for key in forgettable:
            entry = self._entries.pop(key)
            entry.forgotten = True
            self._release(entry)
            self._records.forget(entry)
        counters.add("keys_forgotten", len(forgettable))

    def _new_entry(self, segment: Segment) -> KeyEntry:
        sighting = self._sightings.pop(hash(segment.key), None) if self._sightings else None
        if sighting is not None:
            return self._entry_seen_before(segment, sighting)
        counters.add("keys_seen")
        scalars.learn(segment.key)            # Note [Lifted scalars]
        entry = KeyEntry(segment)
        if self._records.warm:
            self._records.recall(entry)
        self._count_shape_variant(entry)
        self._seen_once[segment.key] = None
        return entry

    # Note [Keys seen once]
    # Most keys of a long dynamic program are seen once: a new shape each step, or float
    # scalars that change every step (AdamW's bias corrections make a new key for the tail of
    # every foreach step). Keeping each whole up to MAX_KEYS kept ~1M GC-tracked objects after
    # 4,000 AdamW steps, and full collections of them stalled the program for 0.2-0.5 s, longer
    # as it ran. A second sight records the segment again, so nothing of the first recording is
    # needed then but when it was first seen (and whether it was a megamorphic shape, so that
    # its structure's count and its state do not change): past SEEN_ONCE_KEPT keys seen once,
    # the oldest shrinks to that, under hash(key). Two keys with the same hash (2^-64 a pair)
    # cost at most a compile: the second is taken for the first one seen again, turns hot a
    # sight early, and is compiled from its own recording.

    def shrink_seen_once(self, entry: KeyEntry) -> None:
        """``entry`` was just seen: if for the first time, and past SEEN_ONCE_KEPT keys seen
        once, the oldest of those shrinks to a sighting (Note [Keys seen once])."""
        if entry.seen != 1 or len(self._seen_once) <= SEEN_ONCE_KEPT:
            return
        key, _ = self._seen_once.popitem(last=False)
        oldest = self._entries.get(key)
        if oldest is None or oldest.seen != 1 or oldest.generic or oldest.artifact_path \
                or oldest.state not in (KeyState.COLD, KeyState.MEGAMORPHIC):
            return                         # forgotten already, or more than a key seen once
        del self._entries[key]
        oldest.forgotten = True
        _bounded_put(self._sightings, hash(key),
                     (oldest.first_seen, oldest.state is KeyState.MEGAMORPHIC))
        structure = oldest.structure
        if structure.variants == 1 and structure.generic_state == "none":
            # it came in no other shape (yet): keep only its count, not its recording
            self._structures.pop(structure.key, None)
            _bounded_put(self._structure_counts, hash(structure.key), structure.variants)
        self._records.forget(oldest)

    def _entry_seen_before(self, segment: Segment, sighting: tuple[float, bool]) -> KeyEntry:
        """The entry of a key shrunk to ``sighting``, seen again: it counts as seen once
        before; its structure counts it as the shape it already was."""
        first_seen, megamorphic = sighting
        entry = KeyEntry(segment, seen=1, first_seen=first_seen)
        if megamorphic:
            _make_megamorphic(entry)
        entry.structure = self._structure(structure_of(segment))
        if not entry.structure.variants:        # forgotten with its count: count it again
            entry.structure.remember(segment)
        return entry

    def _structure(self, key: tuple) -> Structure:
        """The Structure of ``key``; a dropped one comes back with its count."""
        structure = self._structures.get(key)
        if structure is None:
            counted = self._structure_counts.pop(hash(key), 0) if self._structure_counts else 0
            structure = self._structures[key] = Structure(variants=counted, key=key)
        return structure

    def _count_shape_variant(self, entry: KeyEntry) -> None:
        """Note [Megamorphic]: keys that differ only in shapes and strides share a structure.
        Past MAX_SHAPE_VARIANTS of one structure, new ones are not compiled, which bounds the
        compiles of a loop over ever-new shapes."""
        structure = self._structure(structure_of(entry.segment))
        structure.remember(entry.segment)
        entry.structure = structure
        variants = structure.variants
        if variants > config.MAX_SHAPE_VARIANTS and entry.state is KeyState.COLD:
            _make_megamorphic(entry)
            counters.fallback("megamorphic")
            if decision_logged("megamorphic"):   # else no name: most are seen once (~0.1 ms)
                decide("megamorphic", key=entry.digest, variants=variants)

    def clear(self) -> None:
        for entry in self._entries.values():
            entry.forgotten = True
        self._entries.clear()
        self._structures.clear()
        self._seen_once.clear()
        self._sightings.clear()
        self._structure_counts.clear()


def _bounded_put(table: OrderedDict, key, value) -> None:
    """``table[key] = value``, dropping the oldest past MAX_KEYS."""
    table[key] = value
    if len(table) > config.MAX_KEYS:
        table.popitem(last=False)


def _make_megamorphic(entry: KeyEntry) -> None:
    entry.state = KeyState.MEGAMORPHIC
    entry.reason = f"more than {config.MAX_SHAPE_VARIANTS} shape variants"

