"""Ending a deferred run (runtime/engine.py): fused when a kernel fits, per-op beside its
kernel while that kernel is on trial (Note [Side by side] in runtime/profit.py), replayed
per-op otherwise, with a check of the kernel's result on probation and in verify mode.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from adaptive_eager.config import config
from adaptive_eager.dispatch.escapes import raw_untyped_storage
from adaptive_eager.runtime import clock, native_plans
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime.graph import run_eagerly
from adaptive_eager.runtime.scheduling import program_seconds
from adaptive_eager.runtime.segment import SegmentBuilder
from adaptive_eager.runtime.stats import counters
from adaptive_eager.runtime.trie import TrieNode
from adaptive_eager.runtime.verify import Verification, VerificationError


class FusedRuns:
    """Mixed into ``Runtime``: how a deferred run ends (it needs ``_hot``, ``_builder``,
    ``pool``, ``native``, ``table``, ``_per_op``, ``_backend`` and ``_watch_kernel``)."""

    def _end_hot(self) -> bool:
        """Finish a deferred run: fused if a kernel fits, else replayed per-op.

        Returns True when the segment is over (it ran fused, or per-op beside its kernel on
        trial); False when it was replayed and the builder goes on recording it as a cold
        segment."""
        with torch._C._AutoDispatchBelowADInplaceOrView():   # Note [Ops above autograd]
            return self._finish_hot()

    def _finish_hot(self) -> bool:
        node, self._hot = self._hot, None
        builder = self._builder
        live = builder.live_refs()
        variant = self._pick_variant(node, builder, live)
        if variant is not None and self.table.wants_eager_run(variant):
            self._run_beside(variant, builder, live)
            finished = True
        else:
            try:
                finished = variant is not None and self._run_fused(variant, builder)
            except VerificationError:
                self._builder = None           # finished per-op; the user gets the error
                raise
        if finished:
            self._builder = None
            self._watch_kernel(variant)
            return True
        self._replay(builder, live)
        return False

    def _run_beside(self, variant, builder: SegmentBuilder, live: tuple) -> None:
        """Note [Side by side] (runtime/profit.py): run a deferred segment whose kernel is on
        trial per-op instead, and time it for the comparison (Note [Like for like])."""
        waited_s = clock.perf_counter() - builder.started
        ops_s = self._replay(builder, live)
        self.table.touch_eager(variant, ops_s + program_seconds(waited_s, len(builder),
                                                                self._backend()))

    def _replay(self, builder: SegmentBuilder, live: tuple) -> float:
        """Run the deferred ops per-op into the tensors the user holds; the ops' seconds."""
        targets = [(ref, builder.live_tensor(ref)) for ref in live]
        seconds = run_eagerly(builder.ops, builder.inputs,
                              [(ref, tensor) for ref, tensor in targets if tensor is not None])
        self._per_op += len(builder)
        return seconds

    def _pick_variant(self, node: TrieNode, builder: SegmentBuilder, live: tuple):
        """The kernel to finish this deferred run with, or None (the reason is counted)."""
        variant = node.variant_for(live)
        if variant is None or len(builder.inputs) != len(variant.segment.input_metas):
            counters.add("divergences")        # other ops, live outputs or input aliasing
            counters.fallback("divergence")
            decide("divergence", key=_first_variant_digest(node), at_op=len(builder))
            return None
        if _written_inputs_shared(builder.inputs, variant.segment.written_inputs):
            counters.fallback("aliased_inputs")
            return None
        return variant

    def _run_fused(self, variant, builder: SegmentBuilder) -> bool:
        """Run the kernel. True when the segment is finished: fused, or per-op after a check
        caught a broken kernel; False when the caller must replay it per-op."""
        segment = variant.segment
        buffers = [builder.live_tensor(ref) for ref in segment.live_refs]
        buffers = [self.pool.empty(segment.out_meta(ref)) if t is None else t
                   for ref, t in zip(segment.live_refs, buffers)]
        checker = _checker(variant, builder.inputs)
        try:
            with profiler_range(variant):
                _run_kernel(variant.kernel, builder.inputs, buffers)
        except Exception as err:  # a kernel that fails at run time is dropped, not fatal
            self.table.demote(variant, f"kernel_error: {type(err).__name__}: {err}")
            if checker is None:
                return False
            checker.keep_per_op_result(buffers, builder.inputs)   # it may have written some
            self._per_op += len(builder)
            return True
        seconds = clock.perf_counter() - builder.started
        if checker is not None and not checker.passes(buffers, builder.inputs):
            self.reject(variant, checker, buffers, builder.inputs)
            self._per_op += len(builder)
            return True
        variant.on_probation = False
        counters.add("fused_executions")
        counters.add("fused_ops", len(builder))
        # Verify mode's runs time the check too: no samples for the profit trial (a kernel
        # judged by them was dropped, and the verdict stored for good). A probation run is
        # the trial's warm-up run, whose time is set aside anyway.
        self.table.touch(variant, None if config.VERIFY != "off" else seconds)
        if self.native is not None:
            native_plans.offer(variant, self.table.trie, self.native)
        return True

    def reject(self, variant, checker: Verification, buffers: list, inputs: list) -> None:
        """A fused run computed something else than per-op: keep the per-op result, never run
        that kernel again (and raise, with VERIFY=strict)."""
        digest = variant.entry.digest
        decide("verify_mismatch", key=digest, max_error=checker.max_error,
               ops=" ".join(str(op.func) for op in variant.segment.ops))
        checker.keep_per_op_result(buffers, inputs)
        self.table.demote(variant, checker.reason)
        if config.VERIFY == "strict":
            raise VerificationError(checker.message(digest))


@contextlib.contextmanager
def no_autocast() -> Iterator[None]:
    """Recorded ops already carry autocast's casts: kernels and replays must not add more."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _written_inputs_shared(inputs: list, written: frozenset) -> bool:
    """Does an input the kernel writes share memory with another input (a view and its base,
    two overlapping views)?

    A kernel treats inputs as independent, so its write through one would not be seen through
    the other as it is in eager. Only views can share storage with another tensor, so
    segments whose inputs are no views pay nothing but ``_is_view()`` calls; inputs that are
    only read may share memory (the query, key and value views of one projection)."""
    if not written or not any(t._is_view() for t in inputs):
        return False
    storages = [raw_untyped_storage(t).data_ptr() for t in inputs]
    return any(storages.count(storages[index]) > 1 for index in written)


def _run_kernel(kernel, inputs: list, buffers: list) -> None:
    """Run a fused kernel, keeping version counters as eager left them.

    Eager already bumped the versions of mutated inputs when each in-place op was deferred
    (autograd's ADInplaceOrView runs above the mode); the compiled wrapper's own copy back into
    a mutated input would bump them again, so they are restored. So are the output buffers':
    AOTAutograd counts the graph's writes into them as input mutations and bumps them too, and
    an output autograd saved (a LayerNorm's input, for its backward) then failed backward with
    "modified by an inplace operation"."""
    tensors = [*inputs, *buffers]
    versions = [None if t.is_inference() else t._version for t in tensors]
    with no_autocast():
        kernel(*inputs, *buffers)
    changed = [(t, v) for t, v in zip(tensors, versions) if v is not None and t._version != v]
    if changed:
        torch._C._autograd._unsafe_set_version_counter(*zip(*changed))


def _first_variant_digest(node: TrieNode) -> str:
    """A key the diverging run was heading for (for the decision log)."""
    while not node.variants and node.children:
        node = next(iter(node.children.values()))
    return next(iter(node.variants.values())).entry.digest if node.variants else "-"


def profiler_range(variant):
    """A named range per fused run when torch.profiler records (Chrome trace, TensorBoard)."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    name = f"adaptive_eager.fused[{variant.entry.digest}] ops={len(variant.segment.ops)}"
    return torch.autograd.profiler.record_function(name)


def _checker(variant, inputs: list) -> Verification | None:
    """Every run is checked with VERIFY on; a new kernel's first run always (Note [Probation])."""
    if config.VERIFY != "off":
        return Verification(variant.segment, inputs)
    if variant.on_probation:
        return Verification(variant.segment, inputs, probation=True)
    return None
