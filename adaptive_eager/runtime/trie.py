"""The index the hot path walks: compiled segments as a trie of op signatures.

Incoming ops are matched one at a time against the children of the current node (a dict
lookup per op). A node that ends a compiled segment holds its ``Variant``s, one per live set
(see Note [Liveness] in runtime.segment).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

from adaptive_eager.dispatch.ops import OpKind
from adaptive_eager.runtime import native_plans
from adaptive_eager.runtime.segment import OpRecord, Segment


@dataclasses.dataclass(eq=False)
class Variant:
    segment: Segment
    kernel: Callable
    entry: Any                      # the policy's KeyEntry, for counting fused runs
    live_set: frozenset = dataclasses.field(init=False)
    mutates: bool = dataclasses.field(init=False)   # has in-place ops (on inputs, maybe)
    on_probation: bool = True       # its first run is checked (see Note [Probation])
    native_handle: int | None = None    # registered with the C++ hot path (native_plans)
    untouched_runs: int = 0             # its C++ launches not yet counted (native_plans)
    direct_tried: bool = False          # offered to be called from C++ (native_plans)

    def __post_init__(self) -> None:
        self.live_set = frozenset(self.segment.live_refs)
        self.mutates = any(op.kind is OpKind.MUTATING for op in self.segment.ops)


class TrieNode:
    __slots__ = ("record", "children", "variants")

    def __init__(self, record: OpRecord | None) -> None:
        self.record = record        # the op that leads here (its output metas feed the hot path)
        self.children: dict[tuple, TrieNode] = {}
        self.variants: dict[tuple, Variant] = {}

    def variant_for(self, live_refs: tuple) -> Variant | None:
        """A kernel that writes at least every live output: the exact live set first."""
        exact = self.variants.get(live_refs)
        if exact is not None or not self.variants:
            return exact
        live = set(live_refs)
        for variant in self.variants.values():
            if live <= variant.live_set:
                return variant
        return None


class KernelTrie:
    def __init__(self) -> None:
        self._roots: dict[tuple, TrieNode] = {}
        self._lock = threading.Lock()

    def root(self, context: tuple) -> TrieNode | None:
        return self._roots.get(context)

    def node_at(self, context: tuple, records) -> TrieNode | None:
        """The node the calls ``records`` lead to from the root of ``context``, if any."""
        node = self._roots.get(context)
        for record in records:
            if node is None:
                return None
            node = node.children.get(record.signature)
        return node

    def path_ids(self, segment: Segment) -> list[int] | None:
        """The identities of the nodes along ``segment``'s path (the C++ trie merges equal
        calls by them; a node lives as long as a kernel needs it)."""
        node, ids = self._roots.get(segment.context), []
        for op in segment.ops:
            node = None if node is None else node.children.get(op.signature)
            if node is None:
                return None
            ids.append(id(node))
        return ids

    def insert(self, segment: Segment, kernel: Callable, entry: Any) -> Variant:
        variant = Variant(segment, kernel, entry)
        with self._lock:
            node = self._roots.setdefault(segment.context, TrieNode(None))
            for op in segment.ops:
                child = node.children.get(op.signature)
                if child is None:
                    child = node.children[op.signature] = TrieNode(op)
                node = child
            node.variants[segment.live_refs] = variant
        return variant

    def remove(self, variant: Variant) -> None:
        """Stop replaying ``variant``, and drop the trie nodes only it needed (a path to no
        kernel would make the hot path defer ops just to replay them)."""
        native_plans.forget(variant)
        with self._lock:
            node = self._roots.get(variant.segment.context)
            path = [node]
            for op in variant.segment.ops:
                if node is None:
                    return
                node = node.children.get(op.signature)
                path.append(node)
            if node is None:
                return
            node.variants.pop(variant.segment.live_refs, None)
            for op, parent, child in zip(reversed(variant.segment.ops), reversed(path[:-1]),
                                         reversed(path[1:])):
                if child.variants or child.children:
                    break
                del parent.children[op.signature]

    def clear(self) -> None:
        native_plans.clear()
        with self._lock:
            self._roots.clear()
