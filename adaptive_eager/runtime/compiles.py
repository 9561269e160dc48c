"""Compiling hot keys: when each compile starts, and the protocol with the compile worker.

A hot key waits until its per-op runs have banked what its compile costs, and due keys
compile one at a time (Note [When to compile], runtime/scheduling.py). With ASYNC and a disk
cache, compiles run in the worker process (Note [Why a process], runtime/worker.py), whose
kernels are swapped in at segment boundaries (``poll``); otherwise in the program's thread,
at once. A compile that fails marks its key failed for good.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from typing import Callable

from adaptive_eager.cache.disk import DiskCache
from adaptive_eager.config import config
from adaptive_eager.runtime import clock, scheduling
from adaptive_eager.runtime.compiler import compile_segment, current_compiler
from adaptive_eager.runtime.decisions import decide
from adaptive_eager.runtime.entries import KeyEntry, KeyState
from adaptive_eager.runtime.kernels import LoadedKernels, prepare_loading
from adaptive_eager.runtime.records import Records
from adaptive_eager.runtime.scheduling import CompileQueue
from adaptive_eager.runtime.segment import to_wire
from adaptive_eager.runtime.stats import counters
from adaptive_eager.runtime.thread_lending import ThreadLender
from adaptive_eager.runtime.worker import CompileRequest, CompileWorker, is_transfer_file

NOT_LOADED = "compile_error: the worker's artifact did not load"
BANK_INTERVAL_S = 0.01   # banking and starting what is due walk the waiting keys (~15 us):
                         # 3% of a 1 ms step at each of its 2 control points. Banking credits
                         # elapsed time, so banking less often banks the same.


class Compiles:
    def __init__(self, lock: threading.RLock, disk: DiskCache | None, loaded: LoadedKernels,
                 records: Records, start: Callable[[KeyEntry], None]) -> None:
        """``start(entry)`` starts a due key's compile: its structure's generic kernel, or
        its own (``compile``), unless its runs since it turned hot show it unfusible."""
        self._lock = lock                 # the key table's
        self._disk = disk
        self._loaded = loaded
        self._records = records
        self._start = start
        self.worker: CompileWorker | None = None
        # request id -> what to do with its result (finish a key's compile, or a generic one)
        self._compiling: dict[int, Callable] = {}
        self._queue = CompileQueue()     # hot keys waiting to compile (Note [When to compile])
        self._banked_at = -math.inf       # monotonic time of the last bank_while_paused credit
        self.answered = 0                 # worker results handled (kernels or failures)
        self._next_request = 0
        self.threads = ThreadLender()     # Note [Lending a thread]

    @property
    def in_background(self) -> bool:
        """Do compiles go to the worker (else they run at once, in this thread)?"""
        return config.ASYNC and self._disk is not None

    # ------------------------------------------------------------------ when to compile

    def wait(self, entry: KeyEntry) -> bool:
        """Note [When to compile] (runtime/scheduling.py): a background compile waits until
        the key's per-op runs have banked COMPILE_COST_MS of predicted savings, and starts
        when no other compile is in flight; the key runs per-op meanwhile. Synchronous
        compiles (ASYNC=0: tests, debugging) never wait."""
        if not self.in_background:
            return False
        entry.state = KeyState.WAITING
        for dropped in self._queue.add(entry):
            dropped.state = KeyState.COLD         # turns hot again if it comes back
        if not scheduling.is_due(entry):
            decide("compile_waits", key=entry.digest, banked_ms=round(entry.banked_s * 1e3, 3))
        self.start_due()
        return True

    def bank(self, entry: KeyEntry, runs: int = 1) -> None:
        """``runs`` more per-op runs of a waiting ``entry``; start what is due."""
        self._queue.bank(entry, runs)
        self.start_due()

    def discard(self, entry: KeyEntry) -> None:
        """``entry`` is forgotten: it waits no more."""
        self._queue.discard(entry)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def bank_while_paused(self) -> None:
        """Note [When to compile]: at a control point of a paused program, credit each
        waiting key that recurs across steps with what its runs since its last credit would
        have saved (at the rate it was seen running), and start what is due."""
        now = clock.monotonic()
        if not self._queue or now < self._banked_at + BANK_INTERVAL_S:
            return
        self._banked_at = now
        with self._lock:
            self._queue.bank_elapsed(now)
        self.start_due()

    @property
    def due(self) -> int:
        """Waiting compiles that paid for themselves: they start as the worker frees up."""
        return self._queue.due_count()

    def start_due(self, everything: bool = False) -> None:
        """Start the due compile that banked the most, if none is in flight (every waiting
        one: ``everything``, for ``sync(wait_compiles=...)``). Cheap when none waits: called
        at every segment end."""
        if not self._queue or not everything and (self._compiling or self._queue.none_due()):
            return
        with self._lock:
            while everything or not self._compiling:
                entry = self._queue.pop_next(everything)
                if entry is None:
                    return
                if entry.state is KeyState.WAITING:
                    self._start(entry)

    # ------------------------------------------------------------------ compiling

    def compile(self, entry: KeyEntry) -> None:
        """Compile ``entry``'s own kernel: in the worker, or here and now."""
        compiler = current_compiler()
        if self.in_background:
            self._submit(entry, compiler)
            return
        try:
            kernel, seconds = compile_segment(entry.segment, compiler)
        except Exception as err:  # any compiler error: this key runs per-op for good
            counters.add("compile_failures")
            self._records.mark_failed(entry, f"compile_error: {type(err).__name__}: {err}"[:500])
            return
        entry.compile_seconds = seconds
        counters.add("compiles")
        counters.add("compile_seconds", seconds)
        self._loaded.install(entry, kernel)
        artifact = self._disk.save_kernel(entry.digest, kernel, compiler) if self._disk else {}
        if artifact:
            entry.saved_artifact = self._disk.store.artifact_file(artifact["artifact"])
        self._records.note(entry, state=entry.state.value, reason=None, compile_seconds=seconds,
                           **artifact)
        self._records.flush()              # a decision other processes can use right away
        decide("compiled", key=entry.digest, ops=len(entry.segment.ops), seconds=seconds,
               compiler=compiler.name)

    # ------------------------------------------------------------------ the worker

    def _submit(self, entry: KeyEntry, compiler) -> None:
        """Hand ``entry`` to the compile worker; it runs per-op until the kernel arrives."""
        segment = entry.segment
        metas = segment.input_metas + tuple(segment.out_meta(ref) for ref in segment.live_refs)
        entry.state = KeyState.COMPILING
        self.send(functools.partial(self._finish, entry), compiler, entry.digest,
                  to_wire(segment), metas, largest_numel=scheduling.fused_numel(segment))
        decide("compiling", key=entry.digest, ops=len(segment.ops))

    def send(self, finish: Callable, compiler, digest: str, segment: tuple, metas: tuple,
             variants: tuple = (), largest_numel: int = 0) -> None:
        """A compile request to the worker; ``finish(result)`` handles its result (a key's
        kernel, or a structure's generic one). ``largest_numel``: what the segment's (or its
        variants') fused ops touch (Note [Serial kernels] in runtime/scheduling.py)."""
        if self.worker is None:
            self.worker = CompileWorker(self._disk.store.directory, config.COMPILE_TIMEOUT_S)
            prepare_loading(compiler)
        self._next_request += 1
        request = CompileRequest(self._next_request, digest, segment, metas,
                                 (type(compiler).__module__, type(compiler).__qualname__),
                                 scheduling.kernel_threads(largest_numel,
                                                           self.threads.program_threads()),
                                 variants)
        self._compiling[request.request_id] = finish
        self.worker.submit(request)
        self.threads.lend()                # Note [Lending a thread]

    def poll(self, wait_s: float = 0.0) -> None:
        """Start the waiting compiles that are due (all of them when ``wait_s``: the caller
        wants kernels now) and swap in the kernels the worker finished (at a segment
        boundary: never mid-run)."""
        self.start_due(everything=wait_s > 0)
        self._collect(wait_s)

    def _collect(self, wait_s: float = 0.0) -> None:
        if self.worker is None or not self._compiling:
            self.threads.give_back()
            return
        results = self.worker.wait(wait_s) if wait_s else self.worker.poll()
        for result in results:
            with self._lock:
                finish = self._compiling.pop(result.request_id, None)
                if finish is not None:
                    finish(result)
                    self.answered += 1
        if results:
            self.start_due()
        if not self._compiling:
            self.threads.give_back()

    def has_news(self) -> bool:
        """Has the worker finished (or overrun) a compile that poll() would collect?"""
        return self.worker is not None and bool(self._compiling) and self.worker.has_news()

    @property
    def in_flight(self) -> int:
        return len(self._compiling)

    def stop_idle_worker(self) -> None:
        self._collect()
        with self._lock:
            if self.worker is not None and not self._compiling:
                self.worker.close()
                self.worker = None

    def _finish(self, entry: KeyEntry, result) -> None:
        if not result.ok:
            counters.add("compile_failures")
            self._records.mark_failed(entry, result.error)
            return
        path, size, checksum = result.artifact
        persisted = not is_transfer_file(path)
        kernel = self._loaded.load_shipped(path)
        if kernel is None:
            counters.add("compile_failures")
            self._records.mark_failed(entry, NOT_LOADED)
            return
        entry.compile_seconds = result.seconds
        counters.add("compiles")
        counters.add("compile_seconds", result.seconds)
        self._loaded.install(entry, kernel)
        artifact = {}
        if persisted:
            entry.saved_artifact = path
            artifact = {"artifact": os.path.basename(path), "artifact_bytes": size,
                        "artifact_xxh": checksum}
        self._records.note(entry, state=entry.state.value, reason=None,
                           compile_seconds=result.seconds, **artifact)
        self._records.flush()
        decide("compiled", key=entry.digest, ops=len(entry.segment.ops),
               seconds=result.seconds, compiler="worker")

    def disown(self) -> None:
        if self.worker is not None:
            self.worker.disown()
        self.threads.give_back()          # a forked child has no compile in flight

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.threads.give_back()
        self._queue.clear()
