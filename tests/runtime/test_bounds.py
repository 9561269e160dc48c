"""Resource bounds: a long loop of ever-new shapes grows neither memory nor disk without bound,
and disable() gives back the runtime's working memory."""
import logging
import os

import torch

import adaptive_eager as ae
from adaptive_eager.config import config
from adaptive_eager.cache import disk
from adaptive_eager.runtime import decisions, engine
from helpers import assert_equal, chain


def trimmed_chain(x):
    # a size ceil(L / 2): no generic kernel (L - 1 has one, Note [Affine sizes]), each shape
    # compiles alone
    return chain(x)[::2].exp()


def _ever_new_shapes(count: int, start: int = 8, fn=chain):
    for length in range(start, start + count):
        x = torch.randn(length)
        for _ in range(3):                         # hot at each shape: every one a new key
            yield x, fn(x)


def test_key_memory_is_bounded_by_max_keys():
    with config.patch(MAX_KEYS=40, MAX_SHAPE_VARIANTS=4), ae.enabled():
        results = [(x, out) for x, out in _ever_new_shapes(200)]
        table = engine.shared_table()
        assert len(table.entries()) <= 40
        held = 40 + disk.FORGOTTEN_BATCH          # forgotten, waiting for their last write
        assert len(table.disk._described) <= held and len(table.disk._pending) <= held
        assert len(table.kernels) <= 40                   # forgotten shapes leave the trie
    assert ae.stats().keys_seen == 200 and ae.stats().keys_forgotten >= 160
    # two shapes compile alone, the third brings one generic kernel for all the others
    assert ae.stats().compiles == 3 and ae.stats().generic_kernels == 1
    for x, out in results[::50]:
        assert_equal(out, chain(x))


def test_a_forgotten_failed_key_stays_failed():
    """Forgetting drops a key from memory, not what was decided about it."""
    x = torch.randn(16)
    with config.patch(MAX_KEYS=2, COMPILE=False), ae.enabled():
        for _ in range(3):
            chain(x)
    [entry] = engine.shared_table().entries()
    engine.shared_table().mark_failed(entry, "compile_error: for the test")
    engine.shared_table().flush()
    with config.patch(MAX_KEYS=2), ae.enabled():
        for length in range(20, 24):                      # pushes the failed key out
            chain(torch.randn(length))
        assert entry.digest not in {e.digest for e in engine.shared_table().entries()}
        for _ in range(3):
            chain(x)
    again = next(e for e in engine.shared_table().entries() if e.digest == entry.digest)
    assert again.state.value == "failed"


def test_the_buffer_pool_stays_within_its_budget_over_ever_new_shapes():
    with config.patch(BUFFER_POOL_MB=4, MAX_SHAPE_VARIANTS=100), ae.enabled():
        [runtime] = engine.live_runtimes()
        for rows in range(260, 300):
            x = torch.randn(rows, 1024)                   # > 1 MiB: pooled sizes
            for _ in range(4):
                out = chain(x)
            assert runtime.pool.held_bytes <= 4 << 20
        assert len(runtime.pool._slots) <= 4
        assert ae.stats().fused_executions > 0
    assert runtime.pool.held_bytes == 0                  # released on disable()
    assert_equal(out, chain(x))


def test_the_decision_log_forgets_old_keys(caplog):
    with caplog.at_level(logging.DEBUG, logger="adaptive_eager"):
        for number in range(decisions.MAX_REMEMBERED + 500):
            decisions.decide("hot", key=f"{number:016x}", ops=2, seen=3)
    assert len(decisions._last) <= decisions.MAX_REMEMBERED
    decisions.reset()


def test_disk_records_are_trimmed_to_cache_max_entries():
    with config.patch(CACHE_MAX_ENTRIES=10, MAX_SHAPE_VARIANTS=100), ae.enabled():
        for _ in _ever_new_shapes(30, fn=trimmed_chain):
            pass
        table = engine.shared_table()
        table.flush()
        table.disk._trim()
        records = table.disk.store.records()
    kept = {record.digest for record in records}
    assert len(kept) == 10 and table.entries()[-1].digest in kept      # the newest stays
    artifacts = os.listdir(table.disk.store.artifact_dir)
    assert artifacts and all(name.split("-")[0] in kept for name in artifacts)


def test_disable_gives_back_the_kernels_and_enable_loads_them_again(compiler):
    x = torch.randn(64)
    with ae.enabled():
        outs = [chain(x) for _ in range(4)]
        assert len(engine.shared_table().kernels) == 1
    assert len(engine.shared_table().kernels) == 0
    assert not any(root.children for root in engine.shared_table().trie._roots.values())
    with ae.enabled():
        outs = [chain(x) for _ in range(3)]
        assert len(engine.shared_table().kernels) == 1
    stats = ae.stats()
    assert stats.compiles == 1 and stats.cache_hits_disk == 1 and compiler.loads == 1
    for out in outs:
        assert_equal(out, chain(x))
