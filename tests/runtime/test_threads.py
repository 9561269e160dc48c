"""Threads: the runtime is per thread, shared state survives two threads using it at once,
the autograd engine's work is handled, and deferred tensors handed to another thread are
filled first (Note [Handoffs])."""
import concurrent.futures
import queue
import threading

import pytest
import torch

import adaptive_eager as ae
from adaptive_eager.runtime import engine
from helpers import assert_equal


def chain(x):
    return ((x * 2 + 1).sin() * 3).cos()


def other(x):
    return ((x - 1).exp() * 2).tanh()


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
