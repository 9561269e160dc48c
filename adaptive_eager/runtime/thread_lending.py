"""One intra-op thread lent to the compile worker while a compile runs.

# Note [Lending a thread]
The compile worker is a process beside the program (Note [Why a process] in worker.py). Where
the program's intra-op threads already cover every core the process may use (torch's default),
a compile takes one of those cores, and each parallel region of the program then waits at its
join for the thread the OS gave to the compiler. That costs far more than the thread: beside a
CPU-bound process on this 2-core machine, steps took 5.3x eager's time (an MLP training
step), 18x (a transformer block) and 21x (GPT-2 training); with one thread fewer, 1.6-1.8x.
Beside the worker itself a training step ran at 5.2x for the 16 s its three compiles took;
lending, at 2.2x for 12 s. A niced worker spares the program but starves: beside a loop that
keeps both cores busy, an 8-op chain's compile had not landed after 22 s (8 s lent).

So while compiles are in flight, the thread that started them runs its parallel regions on
one thread fewer, and gets it back when the last one is answered (or the runtime closes).
The program's own choice wins: a thread count it set meanwhile is left as it is (unless it set
the very count lent, which cannot be told apart). Kernels are still compiled for the program's
own count (``program_threads``).
"""
from __future__ import annotations

import os
import threading

from adaptive_eager.runtime.decisions import decide


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):      # not Linux
        return os.cpu_count() or 1


class ThreadLender:
    """The one thread of one runtime's compiles (a key table's)."""

    def __init__(self) -> None:
        self._own: int | None = None       # the program's count while one is lent
        self._lender: int | None = None    # the Python thread that lent it

    @property
    def lent(self) -> bool:
        return self._own is not None

    def program_threads(self) -> int:
        """The program's own intra-op thread count (not the lending one)."""
        import torch
        return self._own if self._own is not None else torch.get_num_threads()

    def lend(self) -> None:
        """A compile starts: lend a thread if the program's threads leave no core free."""
        import torch
        threads = torch.get_num_threads()
        if self.lent or threads <= 1 or threads < _usable_cores():
            return
        self._own, self._lender = threads, threading.get_ident()
        torch.set_num_threads(threads - 1)
        decide("thread_lent", threads=threads - 1)

    def give_back(self) -> None:
        """No compile in flight: the thread comes back. Only on the thread that lent it: a
        thread count is each thread's own (another thread's closing leaves it to the next
        segment end of the lender)."""
        if not self.lent or threading.get_ident() != self._lender:
            return
        import torch
        own, self._own, self._lender = self._own, None, None
        if torch.get_num_threads() == own - 1:      # else the program set its own meanwhile
            torch.set_num_threads(own)
            decide("thread_given_back", threads=own)
