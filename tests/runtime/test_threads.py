"""Threads: the runtime is per thread, shared state survives two threads using it at once,
the autograd engine's work is handled, and deferred tensors handed to another thread are
filled first (Note [Handoffs])."""
import concurrent.futures
import contextlib
import queue
import sys
import threading
import time

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.cache.disk import DiskCache
from adaptive_eager.config import config
from adaptive_eager.runtime import engine
from adaptive_eager.runtime.worker import CompileRequest, CompileResult, CompileWorker
from helpers import assert_equal, chain, other


def _in_thread(target, *args):
    """Run ``target`` in a new thread; re-raise what it raised."""
    outcome = {}

    def run():
        try:
            outcome["value"] = target(*args)
        except BaseException as err:  # surfaced in the test's thread
            outcome["error"] = err
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def test_enabling_in_one_thread_does_not_reach_another():
    x = torch.randn(64)
    with ae.enabled():
        outs = _in_thread(lambda: [chain(x) for _ in range(5)])
        assert ae.stats().ops_seen == 0
        assert not _in_thread(ae.is_enabled)
    for out in outs:
        assert_equal(out, chain(x), bitwise=True)


def test_two_threads_running_the_runtime_at_once():
    inputs = {"chain": torch.randn(256), "other": torch.randn(256)}
    steps = {"chain": chain, "other": other}
    start = threading.Barrier(2)

    def work(name):
        results = []
        with ae.enabled():
            start.wait(timeout=30)
            for _ in range(40):
                results.append(steps[name](inputs[name]))
                results.append(chain(inputs[name]))       # a key both threads run
        return results

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = dict(zip(steps, pool.map(work, steps)))
    for name, outs in results.items():
        for index, out in enumerate(outs):
            expected = (steps[name] if index % 2 == 0 else chain)(inputs[name])
            assert_equal(out, expected)
    stats = ae.stats()
    assert stats.fused_executions > 40 and stats.compile_failures == 0
    digests = [entry.digest for entry in engine.shared_table().entries()]
    assert len(digests) == len(set(digests)) == stats.keys_seen


def _train(model, data, steps, hook_calls):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        hidden = model[0](data)
        hidden.register_hook(lambda grad: hook_calls.append(1) or grad * 0.5)
        out = torch.utils.checkpoint.checkpoint(model[1:], hidden, use_reentrant=True)
        loss = out.square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("in_thread", [False, True], ids=["main", "thread"])
def test_backward_hooks_and_reentrant_checkpoint_match_eager(in_thread):
    """The autograd engine runs hooks and reentrant backward passes itself; under the runtime
    they give eager's gradients, whichever thread trains."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    data = torch.randn(16, 32, requires_grad=True)
    twin = torch.nn.Sequential(*[torch.nn.Linear(32, 32), torch.nn.GELU(),
                                 torch.nn.Linear(32, 8)])
    twin.load_state_dict(model.state_dict())
    eager_hooks, adaptive_hooks = [], []
    expected = _train(model, data, 5, eager_hooks)

    def adaptive():
        with ae.enabled():
            return _train(twin, data, 5, adaptive_hooks)
    got = _in_thread(adaptive) if in_thread else adaptive()
    assert_equal(got, expected)
    assert len(adaptive_hooks) == len(eager_hooks) == 5
    assert ae.stats().fused_executions > 0


def _deferred_result(x):
    """Under the runtime: make ``chain`` hot, then return a run of it still deferred."""
    for _ in range(3):
        chain(x)
    out = chain(x)
    [runtime] = engine.live_runtimes()
    assert runtime.has_deferred()
    return out


@pytest.mark.parametrize("handoff", ["queue", "thread", "executor"])
def test_a_deferred_tensor_handed_to_another_thread_is_filled_first(handoff):
    x = torch.randn(4096)
    with ae.enabled():
        out = _deferred_result(x)
        if handoff == "queue":
            channel = queue.Queue()
            channel.put(out)
            seen = _in_thread(lambda: channel.get().sum())
        elif handoff == "thread":
            box = []
            thread = threading.Thread(target=lambda t: box.append(t.sum()), args=(out,))
            thread.start()
            thread.join()
            seen = box[0]
        else:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                seen = pool.submit(torch.sum, out).result()
    assert_equal(seen, chain(x).sum())


# Note [Stress tests]: two threads hammer one piece of shared state, with the interpreter
# switching threads every microsecond (instead of every 5 ms), for a bounded time. Without
# the locks each test fails on almost every run (lost counts, or an error from a container
# changed while it was read); with them the counts come out exact. Each thread stops at its
# deadline, so the assertions count what was actually done, not a fixed amount.
STRESS_S = 1.5


@contextlib.contextmanager
def _switching_often():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


def _hammer(work, threads: int = 2) -> list[int]:
    """Run ``work(index, deadline)`` on ``threads`` threads at once; each returns how many
    rounds it did. Re-raises the first error a thread raised."""
    start = threading.Barrier(threads)

    def run(index):
        start.wait(timeout=30)
        return work(index, time.monotonic() + STRESS_S)
    with _switching_often(), concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(run, index) for index in range(threads)]
        return [future.result(timeout=60) for future in futures]


def third(x):
    return ((x + 3).cos() * 2).sin()


def fourth(x):
    return ((x * x).sigmoid() - 1).abs()


def test_two_threads_touching_kernels_while_the_lru_evicts():
    """KeyTable.touch moves a kernel to the front of the LRU while another thread's install
    evicts; every fused run is counted."""
    x = torch.randn(64)
    with config.patch(CACHE_SIZE=2), ae.enabled():
        for step in (chain, other, third, fourth):
            for _ in range(3):
                step(x)
    table = engine.shared_table()
    entries = [entry for entry in table.entries() if len(entry.segment.ops) >= 2][:4]
    assert len(entries) == 4
    variants = []
    for entry in entries:
        with table._lock:
            table.loaded.install(entry, lambda *args: None)
            variants.append(table.kernels[entry.digest])
    runs_before = sum(entry.fused_runs for entry in entries)

    def work(index, deadline):
        rounds = 0
        while time.monotonic() < deadline:
            if index == 0:                    # the program's fused runs
                table.touch(variants[rounds % 4], 1e-4)
                table.touch_eager(variants[(rounds + 1) % 4], 1e-4)
            else:                             # kernels arriving, evicting others
                with table._lock:             # as every install does
                    table.loaded.install(entries[rounds % 4], lambda *args: None)
            rounds += 1
        return rounds
    touched, _ = _hammer(work)
    assert sum(entry.fused_runs for entry in entries) - runs_before == touched
    assert len(table.kernels) == 2


def test_two_threads_noting_and_flushing_the_disk_cache(tmp_path):
    """DiskCache.note from one thread while another flushes: no counted sighting is lost."""
    disk = DiskCache(str(tmp_path / "cache"))
    written = {}

    def write(updates):
        for update in updates:
            written[update["digest"]] = written.get(update["digest"], 0) + update["seen"]
    disk.store.write = write
    digests = [f"{index:016x}" for index in range(8)]
    for digest in digests:
        disk.register(digest, lambda: (["op"], {"context": {"torch_version": "t"}}), "counting")

    def work(index, deadline):
        rounds = 0
        while time.monotonic() < deadline:
            if index == 0:
                disk.note(digests[rounds % 8], seen=1, eager_ms=0.1)
            else:
                disk.flush()
            rounds += 1
        return rounds
    noted, _ = _hammer(work)
    disk.flush()
    pending = sum(fields["seen"] for fields in disk._pending.values())
    assert sum(written.values()) + pending == noted
    disk.close()


class _Sink:
    """A worker's stdin that takes every request and answers none."""

    def write(self, data):
        return len(data)

    def flush(self):
        pass


def test_two_threads_submitting_and_polling_the_compile_worker(tmp_path):
    """CompileWorker.poll scans the deadlines while another thread submits: every request
    is answered once, and none is failed for a worker that never died."""
    worker = CompileWorker(str(tmp_path / "cache"), timeout_s=600)
    process = type("Process", (), {"stdin": _Sink(), "poll": lambda self: None})()
    worker._ensure_started = lambda: process
    answered = []
    submitted = []
    behind = 64                    # requests kept in flight, so that poll has deadlines to scan

    def work(index, deadline):
        rounds = 0
        while time.monotonic() < deadline:
            if index == 0:
                worker.submit(CompileRequest(rounds, f"{rounds:016x}", (), (), ("m", "n"), 1))
                submitted.append(rounds)
                if rounds >= behind:
                    answer = rounds - behind
                    worker._results.put(("result", CompileResult(answer, f"{answer:016x}",
                                                                  True)))
            else:
                answered.extend(worker.poll())
            rounds += 1
        return rounds
    _hammer(work)
    for answer in submitted[-behind:]:
        worker._results.put(("result", CompileResult(answer, f"{answer:016x}", True)))
    answered.extend(worker.poll())
    assert all(result.ok for result in answered)
    assert sorted(result.request_id for result in answered) == submitted
    assert not worker._deadlines
    worker.close()
