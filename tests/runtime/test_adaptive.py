"""The adaptive policy's gates: too cheap to fuse, unprofitable kernels, megamorphic shapes."""
import gc
import time

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.cache.store import Store
from adaptive_eager.config import config
from adaptive_eager.dispatch import control
from adaptive_eager.runtime import engine, entries, keys, policy, profit
from adaptive_eager.runtime.compiler import use_compiler
from adaptive_eager.runtime.entries import KeyState
from adaptive_eager.runtime.scheduling import DEFERRING_S_PER_OP
from helpers import TimedKernels, assert_equal, by_size, chain


def _states():
    return [entry.state for entry in engine.shared_table().entries()]


def test_segments_too_cheap_to_repay_fusion_are_never_compiled(compiler, fake_clock):
    fake_clock.op_s = by_size(1e-6)                          # 1 us an element
    tiny, large = torch.randn(16), torch.randn(1 << 12)      # 96 us vs ~25 ms of compute
    with config.patch(MIN_SEGMENT_US=1000, HOT_THRESHOLD=4), ae.enabled():
        for _ in range(6):
            chain(tiny).sum().item()
            chain(large).sum().item()
        by_length = {e.segment.input_metas[0].shape[0]: e
                     for e in engine.shared_table().entries()}
        assert by_length[16].state is KeyState.UNFUSIBLE
        assert by_length[16].reason == "too_cheap"
        assert by_length[1 << 12].state is KeyState.READY
    assert compiler.count == 1 and ae.stats().fallbacks["too_cheap"] == 1


@pytest.mark.parametrize("mm_s, compiled", [(1e-3, False), (100e-6, True)])
def test_segments_whose_time_is_in_matmuls_are_never_compiled(compiler, fake_clock,
                                                               mm_s, compiled):
    """Note [Predicted saving]: a matmul costs the same fused or not. Its segment is
    compiled only when more than 10% of its time is in the ops fusion can speed up (here
    relu and mul, 10 us each: 2% beside a 1 ms matmul, 17% beside a 100 us one)."""
    fake_clock.op_s = lambda op, args: mm_s if op is torch.ops.aten.mm.default else 10e-6
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with config.patch(MAX_EXTERN_PERCENT=90), ae.enabled():      # the shipped limit
        outs = [((a @ b).relu() * 2).sum().item() for _ in range(4)]
        [entry] = engine.shared_table().entries()
        assert entry.state is (KeyState.READY if compiled else KeyState.UNFUSIBLE)
        assert entry.reason == (None if compiled else "extern_bound")
    assert compiler.count == int(compiled)
    assert outs == pytest.approx([((a @ b).relu() * 2).sum().item()] * 4, rel=1e-5)


PROGRAM_S = 0.002      # the program's own code between two ops of a segment


def test_a_trials_per_op_runs_count_the_programs_time_between_their_ops(backend):
    """Note [Like for like]: a fused run's time includes the program's code between its
    segment's ops (from its first op deferred to its kernel's end), so the per-op runs it is
    judged against include it too (measured on the machine's clock: a sleep is a floor)."""
    x = torch.randn(64)

    def chain_with_code_between(x):
        y = (x * 2 + 1).sin()
        time.sleep(PROGRAM_S)                        # e.g. a model's Python between two ops
        return (y * 3).cos()

    with config.patch(KEEP_UNPROFITABLE=False), ae.enabled():
        outs = [chain_with_code_between(x) for _ in range(20)]
        ae.sync()
        [entry] = engine.shared_table().entries()
        assert entry.judged and len(entry.control_samples) >= 2
        # (less what deferring its ops is taken to cost a fused run: program_seconds)
        deferring_s = len(entry.segment.ops) * DEFERRING_S_PER_OP[ae.stats().backend]
        assert min(entry.control_samples) >= PROGRAM_S - deferring_s   # was the ops' alone
        assert min(entry.fused_samples[1:]) >= PROGRAM_S           # (after its warm-up run)
    for out in outs:
        assert_equal(out, chain_with_code_between(x), bitwise=True)


OP_S = 100e-6          # each op of the chain (5 ops), on the fake clock
SLOW_KERNEL_S = 0.02   # far slower than the ops it replaces


def test_a_kernel_slower_than_per_op_is_dropped_with_both_timings(fake_clock):
    fake_clock.op_s = OP_S
    x = torch.randn(64)
    with use_compiler(TimedKernels(fake_clock, SLOW_KERNEL_S)), \
            config.patch(KEEP_UNPROFITABLE=False), ae.enabled():
        outs = [chain(x) for _ in range(16)]
    for out in outs:
        assert_equal(out, chain(x))
    [entry] = engine.shared_table().entries()
    assert entry.state is KeyState.UNPROFITABLE
    assert entry.fused_ms == pytest.approx(SLOW_KERNEL_S * 1e3)
    assert entry.eager_ms == pytest.approx(5 * OP_S * 1e3)
    assert "fused" in entry.reason and "eager" in entry.reason
    stats = ae.stats()
    # 2 per-op runs make it hot; a checked warm-up run; 3 timed runs, each beside a plain
    # eager run, lost; 3 more pairs, lost; then per-op for good (1 run here)
    assert stats.fused_executions == 7 and len(entry.control_samples) == 3
    assert stats.fallbacks["unprofitable"] == 1
    ae.reset()                                        # persisted for the next process
    [record] = Store(config.CACHE_DIR).records()
    assert record.state == "unprofitable"
    assert record.fused_ms == pytest.approx(SLOW_KERNEL_S * 1e3)
    assert record.eager_ms == pytest.approx(5 * OP_S * 1e3)


def test_a_kernels_record_keeps_the_eager_time_timed_beside_it(fake_clock):
    """``cache ls`` divides the stored eager time by the fused one: once a key has a kernel,
    per-op runs under the runtime (slower: interception, a compile beside them) must not
    overwrite the plain eager time measured beside the kernel (Note [Side by side])."""
    fake_clock.op_s = OP_S
    x = torch.randn(64)
    with use_compiler(TimedKernels(fake_clock, OP_S)), \
            config.patch(KEEP_UNPROFITABLE=False), ae.enabled():
        for _ in range(16):
            chain(x)                               # hot, compiled, kept: 5 ops vs 1 kernel
        [entry] = engine.shared_table().entries()
        assert entry.state is KeyState.READY and entry.control_samples
        entry.control_samples.clear()              # as a process that loaded it: no trial
        for _ in range(8):                         # slow per-op runs
            entry.add_sample(entry.eager_samples, 100 * 5 * OP_S)
        engine.shared_table().records.note_seen(entry)
    ae.reset()                                     # written for the next process
    [record] = Store(config.CACHE_DIR).records()
    assert record.eager_ms == pytest.approx(5 * OP_S * 1e3)


def test_verify_mode_runs_are_no_profit_samples(fake_clock):
    """A checked run pays for the check: verify mode's runs must not get a kernel dropped
    (the verdict is stored, and a later process without verify mode would obey it)."""
    fake_clock.op_s = OP_S
    x = torch.randn(64)
    with use_compiler(TimedKernels(fake_clock, SLOW_KERNEL_S)), \
            config.patch(KEEP_UNPROFITABLE=False, VERIFY="on"), ae.enabled():
        outs = [chain(x) for _ in range(16)]
        [entry] = engine.shared_table().entries()
        assert entry.state is KeyState.READY and not entry.judged and entry.fused_ms is None
    for out in outs:
        assert_equal(out, chain(x))
    assert ae.stats().fused_executions == 16 - 2 and "unprofitable" not in ae.stats().fallbacks


def test_a_kernel_that_beats_per_op_by_the_margin_is_kept(fake_clock):
    fake_clock.op_s = OP_S                            # 5 ops: 0.5 ms per-op
    fused_s = 5 * OP_S * (1 - profit.PROFIT_MARGIN) * 0.99
    x = torch.randn(64)
    with use_compiler(TimedKernels(fake_clock, fused_s)), \
            config.patch(KEEP_UNPROFITABLE=False), ae.enabled():
        outs = [chain(x) for _ in range(16)]
        [entry] = engine.shared_table().entries()
        assert entry.state is KeyState.READY and entry.judged and not entry.retimed
    for out in outs:
        assert_equal(out, chain(x))
    assert "unprofitable" not in ae.stats().fallbacks
    # a checked warm-up run, 3 timed runs beside 3 plain eager ones, then fused for good
    assert ae.stats().fused_executions == 16 - 2 - 3


def _kernel_of_chain(x):
    """Run ``chain`` until its kernel is in: the key table and the kernel's variant."""
    for _ in range(4):
        chain(x)
    table = engine.shared_table()
    [variant] = table.kernels.values()
    return table, variant


def test_a_kernel_on_trial_alternates_with_plain_eager_runs_of_its_segment(monkeypatch):
    """Note [Side by side]: the kernel is compared with eager at the same moment. Its runs
    alternate with per-op runs (eager's results exactly), PROFIT_SAMPLES of each."""
    x = torch.randn(64)
    eager_runs = []
    table = engine.shared_table()
    touch_eager = table.touch_eager
    monkeypatch.setattr(table, "touch_eager",
                        lambda variant, seconds: (eager_runs.append(seconds),
                                                  touch_eager(variant, seconds)))
    with config.patch(KEEP_UNPROFITABLE=False), ae.enabled():
        runs = []
        for _ in range(2 + 1 + 2 * profit.PROFIT_SAMPLES):
            fused_before, eager_before = ae.stats().fused_executions, len(eager_runs)
            out = chain(x)
            ae.sync()                                 # the deferred run ends here
            runs.append((out, ae.stats().fused_executions - fused_before,
                         len(eager_runs) - eager_before))
    for out, _, _ in runs:
        assert_equal(out, chain(x))
    kinds = ["fused" if fused else "eager" if eager else "cold" for _, fused, eager in runs]
    assert kinds == ["cold", "cold", "fused", "eager", "fused", "eager", "fused", "eager",
                     "fused"]
    [entry] = table.entries()
    assert len(eager_runs) == 3 and all(seconds > 0 for seconds in eager_runs)
    assert entry.judged or entry.retimed              # a verdict, or a second trial


def test_a_kernel_is_judged_against_plain_eager_timed_beside_it():
    """Per-op runs under the runtime also pay for interception, and the cold runs came
    seconds before the kernel, on a machine perhaps more or less busy: the profit check
    compares with the ops' own time in per-op runs interleaved with the kernel's."""
    x = torch.randn(64)
    with config.patch(KEEP_UNPROFITABLE=True), ae.enabled():
        table, variant = _kernel_of_chain(x)
        entry = variant.entry
        entry.eager_samples, entry.compute_seconds = [0.010] * 4, 0.001   # a calm moment,
        entry.control_samples = [0.008] * 3                               # then a busy one
        entry.fused_samples, entry.judged = [0.005] * 4, False
        table.profit.judge(variant)
        assert entry.state is KeyState.READY and entry.judged             # 5 ms vs 8 ms: kept
        entry.control_samples, entry.judged = [0.002] * 3, False          # beats 10 ms, not 2
        entry.retimed = True                                              # its second trial
        table.profit.judge(variant)
        assert entry.state is KeyState.UNPROFITABLE and "eager 2.000 ms" in entry.reason
        assert variant not in table.kernels.values()


def test_a_trial_waits_while_a_compile_is_in_flight(monkeypatch):
    """Note [Trials without a compile beside]: while the worker compiles another key, a kernel
    on trial runs fused and untimed; its trial goes on once nothing compiles."""
    x = torch.randn(64)
    with config.patch(KEEP_UNPROFITABLE=True), ae.enabled():
        table, variant = _kernel_of_chain(x)
        entry = variant.entry
        entry.fused_samples, entry.control_samples, entry.judged = [0.030], [], False
        with config.patch(KEEP_UNPROFITABLE=False):
            monkeypatch.setattr(type(table.compiles), "in_flight", property(lambda self: 1))
            assert not table.wants_eager_run(variant)
            for _ in range(5):
                table.touch(variant, 0.050)                  # a compile beside: not a sample
            assert entry.fused_samples == [0.030] and not entry.judged
            assert entry.fused_runs >= 5
            monkeypatch.undo()                               # the worker is idle again
            assert table.wants_eager_run(variant)
            for _ in range(3):
                table.touch_eager(variant, 0.010)
                table.touch(variant, 0.004)
        assert entry.judged and entry.state is KeyState.READY and entry.fused_ms == 4.0


def test_a_kernel_that_loses_its_first_trial_is_timed_once_more():
    """Three timed runs can all fall in one busy moment; the verdict would be for good (and
    on disk), so a kernel that loses is dropped only if it loses again."""
    x = torch.randn(64)
    with config.patch(KEEP_UNPROFITABLE=True), ae.enabled():
        table, variant = _kernel_of_chain(x)
        entry = variant.entry
        entry.control_samples = [0.010] * 3
        entry.fused_samples, entry.judged = [0.030] + [0.020] * 3, False   # a busy moment
        table.profit.judge(variant)
        assert entry.state is KeyState.READY and entry.retimed and not entry.judged
        assert entry.control_samples == [] and len(entry.fused_samples) == 1
        with config.patch(KEEP_UNPROFITABLE=False):
            for _ in range(3):
                table.touch(variant, 0.004)                            # the kernel's own time
                table.touch_eager(variant, 0.010)
        assert entry.judged and entry.state is KeyState.READY and entry.fused_ms == 4.0
        assert variant in table.kernels.values()
    assert "unprofitable" not in ae.stats().fallbacks


def test_kept_unprofitable_kernels_with_the_setting(fake_clock):
    fake_clock.op_s = OP_S
    x = torch.randn(64)
    with use_compiler(TimedKernels(fake_clock, SLOW_KERNEL_S)), \
            config.patch(KEEP_UNPROFITABLE=True), ae.enabled():
        for _ in range(8):
            chain(x)
        assert _states() == [KeyState.READY]


def test_ever_new_shapes_compile_a_bounded_number_of_times(compiler):
    outs = []
    with config.patch(MAX_SHAPE_VARIANTS=3), ae.enabled():
        for length in range(4, 12):                   # 8 shapes, each hot
            x = torch.randn(length)
            for _ in range(3):
                outs.append((x, chain(x)))
    # two shapes compile alone; at the third, one kernel for every length (Note [Generic kernels])
    stats = ae.stats()
    assert compiler.count == 3 and stats.generic_kernels == 1
    assert stats.generic_instances == 6 and stats.fused_executions >= 6
    for x, out in outs:
        assert_equal(out, chain(x))


def trimmed_chain(x):
    # a size of ceil(L / 2) (constant arguments): no product of the lengths, nor one plus an
    # offset (L - 1 is generic: Note [Affine sizes])
    return chain(x)[::2].exp()


def test_shapes_one_kernel_cannot_serve_compile_a_bounded_number_of_times(compiler):
    outs = []
    with config.patch(MAX_SHAPE_VARIANTS=3), ae.enabled():
        for length in range(4, 12):
            x = torch.randn(length)
            for _ in range(3):
                outs.append((x, trimmed_chain(x)))
        assert _states().count(KeyState.MEGAMORPHIC) == 5
    stats = ae.stats()
    assert compiler.count == 3 and stats.generic_kernels == 0
    assert stats.fallbacks["not_generic"] == 1 and stats.fallbacks["megamorphic"] == 5
    for x, out in outs:
        assert_equal(out, trimmed_chain(x))


@pytest.mark.parametrize("lengths", [range(5, 45)], ids=["new_length_each_step"])
def test_a_new_sequence_length_every_step_compiles_nothing(compiler, lengths):
    with ae.enabled():
        for length in lengths:
            chain(torch.randn(length)).sum().item()
    stats = ae.stats()
    assert compiler.count == 0 and stats.fused_executions == 0
    # Every key was seen once: none is worth a row, not even the megamorphic ones
    assert stats.fallbacks["megamorphic"] > 0 and Store(config.CACHE_DIR).records() == []


def test_keys_seen_once_are_never_named(compiler, monkeypatch):
    # A digest costs ~0.1 ms; ever-new shapes make keys seen once that need no name, not even
    # those past MAX_SHAPE_VARIANTS (megamorphic).
    named = []
    monkeypatch.setattr(entries, "stable_digest", lambda key: named.append(key) or "0" * 16)
    with config.patch(MAX_SHAPE_VARIANTS=4), ae.enabled():
        for length in range(5, 25):
            chain(torch.randn(length)).sum().item()
    stats = ae.stats()
    assert stats.keys_seen >= 20 and stats.fallbacks["megamorphic"] >= 10 and named == []


def logged(out):
    """``out``, after an .item() of it ended its segment (as a loss logged each step does)."""
    out.sum().item()
    return out


def test_a_megamorphic_key_seen_again_is_recorded_as_megamorphic(compiler):
    with config.patch(MAX_SHAPE_VARIANTS=2), ae.enabled():
        for length in range(5, 10):
            logged(trimmed_chain(torch.randn(length)))
        x = torch.randn(9)                                # the last: megamorphic
        logged(trimmed_chain(x))
    [record] = Store(config.CACHE_DIR).records()
    assert record.state == "megamorphic" and record.seen == 2
    assert "shape variants" in record.reason


def scaled(x, scale: int):
    # An integer in the key: a new value is a new key (integers never lift, where a float
    # that changes would: Note [Lifted scalars]).
    return logged(((x * scale + 1).sin() * 3).cos())


def test_keys_seen_once_shrink_yet_turn_hot_when_they_come_back(compiler):
    # Note [Keys seen once]
    x = torch.randn(8)
    others = keys.SEEN_ONCE_KEPT + 40
    with ae.enabled():
        scaled(x, 2)
        for step in range(others):
            scaled(x, 3 + step)
        assert len(engine.shared_table().entries()) <= keys.SEEN_ONCE_KEPT + 1
        assert compiler.count == 0
        again = [scaled(x, 2) for _ in range(3)]
        [hot] = [entry for entry in engine.shared_table().entries() if entry.seen > 1]
        # its second per-op run made it hot: the sighting counted as its first; its structure
        # (dropped with it, a shape seen once) still counts one shape
        assert hot.seen == 2 and hot.state is KeyState.READY and hot.structure.variants == 1
    stats = ae.stats()
    assert stats.keys_seen == others + 1             # the key that came back is not new
    assert compiler.count == 1 and stats.fused_executions == 2
    for out in again:
        assert_equal(out, scaled(x, 2))


def test_a_shape_shrunk_to_a_sighting_is_still_the_variant_it_was(compiler):
    # The first shapes of a structure compile when they come back; those past
    # MAX_SHAPE_VARIANTS stay megamorphic; coming back counts no new variant.
    with config.patch(MAX_SHAPE_VARIANTS=2), ae.enabled():
        for length in range(4, 4 + keys.SEEN_ONCE_KEPT + 8):
            logged(trimmed_chain(torch.randn(length)))      # seen once each, then shrunk
        early, late = torch.randn(4), torch.randn(40)
        outs = [(x, logged(trimmed_chain(x))) for x in (early, late, early, late, early)]
        ae.sync()                        # C++'s runs of known keys counted (Note [Cold plans])
        by_length = {entry.segment.input_metas[0].shape[0]: entry
                     for entry in engine.shared_table().entries()}
        # per-op twice (the sighting is the first), then fused
        assert by_length[4].state is KeyState.READY and by_length[4].seen == 2
        assert by_length[40].state is KeyState.MEGAMORPHIC and by_length[40].seen == 3
        assert by_length[4].structure.variants == keys.SEEN_ONCE_KEPT + 8
    assert compiler.count == 1
    for x, out in outs:
        assert_equal(out, trimmed_chain(x))


def _tracked_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_ever_new_keys_keep_a_bounded_number_of_objects_alive(compiler):
    # Each key kept whole holds ~100-180 GC-tracked objects, and every full collection walks
    # them all: before Note [Keys seen once], 4,000 AdamW steps kept ~1M, and collections
    # stalled training for up to 0.5 s.
    x = torch.randn(8)
    with ae.enabled():
        for step in range(200):
            scaled(x, 3 + step)
        after_200 = _tracked_objects()
        for step in range(200, 1200):
            scaled(x, 3 + step)
        after_1200 = _tracked_objects()
    assert ae.stats().keys_seen == 1200
    assert after_1200 - after_200 < 500, (after_200, after_1200)


def test_enable_takes_the_objects_already_alive_out_of_full_collections():
    # Note [GC stalls]: torch's own ~165k objects cost ~90 ms a full collection here.
    assert gc.get_freeze_count() == 0
    with ae.enabled():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0              # disable() gives them back


def test_objects_the_program_froze_itself_stay_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with ae.enabled():
            pass
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()


def test_a_structure_dropped_with_its_one_shape_keeps_counting_shapes(compiler):
    # Its first shape shrank to a sighting (and its structure to a count) long before the
    # next shapes came: they are still its second and third, so the third is past the limit.
    x = torch.randn(8)
    with config.patch(MAX_SHAPE_VARIANTS=2), ae.enabled():
        logged(trimmed_chain(torch.randn(4)))
        for step in range(keys.SEEN_ONCE_KEPT + 8):
            scaled(x, 3 + step)
        assert ae.stats().fallbacks.get("megamorphic", 0) == 0
        logged(trimmed_chain(torch.randn(5)))
        logged(trimmed_chain(torch.randn(6)))
    assert ae.stats().fallbacks["megamorphic"] == 1


def test_a_kernel_whose_key_stopped_coming_is_on_no_trial():
    """A kernel waiting for its verdict holds off the step judge (Note [Judged by the step])
    only while its key comes: one that stopped coming (a pause shifted the program's cuts)
    held it off for good."""
    x = torch.randn(64)
    with config.patch(KEEP_UNPROFITABLE=False), ae.enabled():
        table, variant = _kernel_of_chain(x)
        ae.sync()
        assert not variant.entry.judged and table.kernels_on_trial
        for _ in range(policy.TRIAL_IDLE_POINTS + 1):
            control.permanent_point()                 # steps that no longer run chain
        assert not table.kernels_on_trial
        chain(x)
        ae.sync()
        assert not variant.entry.judged and table.kernels_on_trial   # it came back
