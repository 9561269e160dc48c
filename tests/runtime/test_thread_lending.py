"""Note [Lending a thread]: one intra-op thread fewer while a compile runs, where the program's
threads leave no core for the worker; the program's own choices win."""
import threading

import pytest
import torch

from adaptive_eager.runtime import thread_lending
from adaptive_eager.runtime.thread_lending import ThreadLender


@pytest.fixture
def cores(monkeypatch):
    """Set the usable cores; the thread count comes back after the test."""
    threads = torch.get_num_threads()

    def usable(count):
        monkeypatch.setattr(thread_lending, "_usable_cores", lambda: count)
    yield usable
    torch.set_num_threads(threads)


def test_a_thread_is_lent_while_compiling_and_given_back(cores):
    cores(2)
    torch.set_num_threads(2)
    lender = ThreadLender()
    lender.lend()
    assert lender.lent and torch.get_num_threads() == 1 and lender.program_threads() == 2
    lender.lend()                                   # a second compile: still one lent
    assert torch.get_num_threads() == 1
    lender.give_back()
    assert not lender.lent and torch.get_num_threads() == 2 and lender.program_threads() == 2


@pytest.mark.parametrize("threads,usable", [(1, 2), (1, 1), (2, 4)])
def test_nothing_is_lent_where_a_core_is_free_or_one_thread_runs(cores, threads, usable):
    cores(usable)
    torch.set_num_threads(threads)
    lender = ThreadLender()
    lender.lend()
    assert not lender.lent and torch.get_num_threads() == threads
    lender.give_back()
    assert torch.get_num_threads() == threads


def test_a_thread_count_the_program_set_meanwhile_is_kept(cores):
    cores(4)
    torch.set_num_threads(4)
    lender = ThreadLender()
    lender.lend()
    torch.set_num_threads(2)                        # the program's own choice
    lender.give_back()
    assert not lender.lent and torch.get_num_threads() == 2


def test_only_the_lending_thread_gives_it_back(cores):
    """A thread count is each thread's own: another thread's give_back would set its own."""
    cores(2)
    torch.set_num_threads(2)
    lender = ThreadLender()
    lender.lend()
    other = threading.Thread(target=lender.give_back)
    other.start()
    other.join()
    assert lender.lent and torch.get_num_threads() == 1
    lender.give_back()
    assert torch.get_num_threads() == 2
