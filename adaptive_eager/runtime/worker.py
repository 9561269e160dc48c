"""Background compilation in a separate process.

Note [Why a process]: compiling on a thread of the user's process starves it of the GIL (~20%
throughput lost), two compile threads crash Inductor, and it breaks the user's own
torch.compile (docs/design.md, "Compile worker"). So hot segments go to one worker process,
started with
``python -m adaptive_eager.runtime.worker`` (not multiprocessing's spawn, which would re-run the
user's main module), at the program's priority, on a core the program lends it (Note [Lending
a thread] in thread_lending.py): a niced worker (nice 10) on a machine whose
cores the program keeps busy got a tenth of a core, and a training loop's first compile had
not landed after four minutes. It compiles one graph at a time (for the program's
intra-op thread count: Inductor bakes it into CPU kernels), saves the artifact into the shared
cache directory (or a private temporary one when that cannot be written), and answers with its
path; the runtime loads it (~7 ms) and swaps the kernel in at a segment boundary. Meanwhile the
program goes on per-op.

Protocol: length-prefixed pickles over the worker's stdin/stdout. The worker's own prints go to
stderr, which is ``worker.log`` in the cache directory. It exits when its stdin closes, so it
never outlives the program. A worker that dies or overruns COMPILE_TIMEOUT_S fails its request
with a reason and is restarted on the next one.
"""
from __future__ import annotations

import atexit
import dataclasses
import importlib
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import tempfile
import time
from typing import Any, BinaryIO

from adaptive_eager import faults
from adaptive_eager.cache import inductor_dir, trust
from adaptive_eager.config import config

_HEADER = struct.Struct("<Q")
WORKER_LOG = "worker.log"      # in the cache directory: the worker's stderr
TRANSFER_PREFIX = "adaptive-eager-transfer-"   # temporary directories of unpersisted kernels


def is_transfer_file(path: str) -> bool:
    """Was ``path`` shipped through a temporary directory (to be removed once loaded)?"""
    return os.path.basename(os.path.dirname(path)).startswith(TRANSFER_PREFIX)


def _send(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None                                   # the other side closed the pipe
    size = _HEADER.unpack(header)[0]
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    request_id: int
    digest: str
    segment: tuple                                    # runtime.segment.to_wire(segment)
    input_metas: tuple                                # TensorMeta per placeholder
    compiler: tuple                                   # (module, qualified name) to instantiate
    threads: int                                      # the program's intra-op threads: CPU
                                                      # kernels are generated for that many
    variants: tuple = ()                              # to_wire of recorded shapes: compile one
                                                      # generic kernel (runtime.generic) instead


@dataclasses.dataclass(frozen=True)
class CompileResult:
    request_id: int
    digest: str
    ok: bool
    artifact: tuple | None = None                     # (path, size, checksum)
    seconds: float = 0.0
    error: str | None = None
    generic: tuple | None = None                      # runtime.generic.to_wire, for variants


# --------------------------------------------------------------------- the worker process

def _instantiate(reference: tuple, cache: dict):
    if reference not in cache:
        module, name = reference
        target = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        cache[reference] = target()
    return cache[reference]


def _compile(request: CompileRequest, store, compilers: dict) -> CompileResult:
    import torch
    started = time.perf_counter()
    try:
        faults.check_compile(in_worker=True)
        torch.set_num_threads(request.threads)
        compiler = _instantiate(request.compiler, compilers)
        generic = None
        if request.variants:
            kernel, generic = _compile_generic(request.variants, compiler)
            shipped = _ship_temporarily(kernel, compiler)    # a kernel of this process only
        else:
            example_inputs = [meta.empty() for meta in request.input_metas]
            kernel = compiler.compile(_graph_of(request.segment), example_inputs)
            shipped = _ship(request.digest, kernel, compiler, store)
    except Exception as err:  # reported to the runtime, which runs the segment per-op
        return CompileResult(request.request_id, request.digest, False,
                             error=f"compile_error: {type(err).__name__}: {err}"[:500])
    if shipped is None:
        return CompileResult(request.request_id, request.digest, False,
                             error="compile_error: the kernel cannot be saved for shipping")
    return CompileResult(request.request_id, request.digest, True, shipped,
                         time.perf_counter() - started, generic=generic)


def _compile_generic(variants: tuple, compiler) -> tuple:
    """(kernel, generic wire) for recorded shapes of one structure; NotGeneric says why not."""
    from adaptive_eager.runtime import generic as generic_segments
    from adaptive_eager.runtime.segment import from_wire
    generic = generic_segments.generalize([from_wire(w) for w in variants], symbolic=False)
    kernel, generic = compiler.compile_generic(generic)
    return kernel, generic_segments.to_wire(generic)


def _graph_of(wire: tuple):
    from adaptive_eager.runtime.graph import build_graph
    from adaptive_eager.runtime.segment import from_wire
    segment = from_wire(wire)
    return build_graph(segment, segment.live_refs)


def _ship(digest: str, kernel, compiler, store) -> tuple | None:
    """Save ``kernel`` where the program can load it: (path, size, checksum), or None if it
    cannot be saved. Into the cache directory; where that cannot be written (read-only, disk
    full) or must not be loaded from (Note [Trusted cache]), into a private temporary
    directory the runtime removes after loading."""
    if trust.distrusted_dir(store.directory):
        return _ship_temporarily(kernel, compiler)
    write = lambda path: compiler.save(kernel, path)  # noqa: E731
    try:
        saved = store.save_artifact(digest, write)
        return None if saved is None else (store.artifact_file(saved[0]), *saved[1:])
    except OSError:
        return _ship_temporarily(kernel, compiler)


def _ship_temporarily(kernel, compiler) -> tuple | None:
    """Save ``kernel`` into a private temporary directory the runtime removes after loading."""
    from adaptive_eager.cache.store import file_digest
    path = os.path.join(tempfile.mkdtemp(prefix=TRANSFER_PREFIX), "kernel.bin")
    if not compiler.save(kernel, path):
        return None
    os.chmod(path, trust.ARTIFACT_MODE)                    # not the umask's: Note [Trusted cache]
    with open(path, "rb") as handle:
        data = handle.read()
    return path, len(data), file_digest(data)


def _die_with_parent() -> None:
    """Linux: be killed when the program dies, even mid-compile and even by kill -9."""
    parent = os.getppid()
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)                 # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return                                        # elsewhere: stdin EOF ends the loop
    if os.getppid() != parent:                        # it died before prctl took effect
        os._exit(0)


def _use_cache_dir(cache_dir: str, shared: bool) -> None:
    """This process compiles for the program's cache directory, as the program sees it (it
    may have set it with config.patch rather than its environment), and, being ours, keeps
    Inductor's cache there throughout (Note [Our Inductor cache] in cache/inductor_dir.py)."""
    os.environ["NEURON_ADAPTIVE_EAGER_CACHE_DIR"] = cache_dir
    os.environ["NEURON_ADAPTIVE_EAGER_CACHE_SHARED"] = str(int(shared))
    config.reload()
    inductor_dir.use_for_process(cache_dir)


def serve() -> None:
    """The worker's main loop: requests on stdin, results on (the original) stdout."""
    _die_with_parent()
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                                     # stray prints must not corrupt replies
    protocol_in = sys.stdin.buffer
    hello = _receive(protocol_in)
    if hello is None:
        return
    sys.path[:] = hello["sys_path"]                   # import what the parent can import
    _use_cache_dir(hello["cache_dir"], hello.get("cache_shared", False))
    from adaptive_eager.cache.store import Store
    store = Store(hello["cache_dir"])
    compilers: dict = {}
    while True:
        request = _receive(protocol_in)
        if request is None:
            return
        result = _compile(request, store, compilers)
        try:
            _send(protocol_out, result)
        except BrokenPipeError:                       # the program is gone: so are we
            return


# --------------------------------------------------------------------- the runtime's side

class CompileWorker:
    """The handle the runtime holds: submit requests, collect results, never block."""

    def __init__(self, cache_dir: str, timeout_s: float) -> None:
        self.cache_dir = cache_dir
        self.timeout_s = timeout_s
        self._process: subprocess.Popen | None = None
        self._results: queue.Queue = queue.Queue()
        self._deadlines: dict[int, tuple[float, str]] = {}   # request id -> (deadline, digest)
        self._lock = threading.RLock()
        self._starts = 0
        self.restarts = 0
        atexit.register(self.close)               # never outlive, nor hold up, the program

    def submit(self, request: CompileRequest) -> None:
        with self._lock:
            process = self._ensure_started()
            self._deadlines[request.request_id] = (time.monotonic() + self.timeout_s,
                                                   request.digest)
            try:
                _send(process.stdin, request)
            except (BrokenPipeError, OSError):
                pass                                  # the reader thread reports the crash

    def _ensure_started(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        self.restarts += self._starts > 0
        self._starts += 1
        if self._process is not None:                 # died: what it held is lost
            for request_id, (_, digest) in self._deadlines.items():
                self._results.put(("result", CompileResult(
                    request_id, digest, False, error="worker_crashed: the compile worker "
                    f"exited with status {self._process.poll()}")))
            self._deadlines.clear()
        env = dict(os.environ)
        env.pop("NEURON_ADAPTIVE_EAGER", None)        # the worker must not run under us
        # The worker's warnings and tracebacks go to a log beside the cache, not into the
        # program's stderr: the program must not show that we are there.
        with self._log() as log:
            process = subprocess.Popen([sys.executable, "-m", "adaptive_eager.runtime.worker"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=log, env=env, cwd=os.getcwd())
        _send(process.stdin, {"sys_path": list(sys.path), "cache_dir": self.cache_dir,
                              "cache_shared": config.CACHE_SHARED})
        threading.Thread(target=self._read, args=(process,), daemon=True,
                         name="adaptive-eager-compile-results").start()
        self._process = process
        return process

    def _log(self):
        try:
            trust.make_dirs(self.cache_dir)
            return open(os.path.join(self.cache_dir, WORKER_LOG), "ab")
        except OSError:                               # nowhere to write: drop it
            return open(os.devnull, "wb")

    def _read(self, process: subprocess.Popen) -> None:
        while True:
            try:
                result = _receive(process.stdout)
            except Exception:  # a garbled reply: treat the worker as dead
                result = None
                process.kill()
            if result is None:
                self._results.put(("exited", process))
                return
            self._results.put(("result", result))

    def has_news(self) -> bool:
        """Would poll() return something? (No lock: a paused program asks at every control
        point; a dict changed under the check just says yes.)"""
        if not self._results.empty():
            return True
        try:
            return any(deadline < time.monotonic() for deadline, _ in self._deadlines.values())
        except RuntimeError:              # another thread submitted meanwhile
            return True

    def poll(self) -> list[CompileResult]:
        """Results that arrived, and failures for requests whose worker died or overran."""
        results = []
        with self._lock:                  # another thread may be submitting (_deadlines)
            while True:
                try:
                    kind, payload = self._results.get_nowait()
                except queue.Empty:
                    break
                if kind == "result":
                    self._deadlines.pop(payload.request_id, None)
                    results.append(payload)
                elif payload is self._process:
                    results += self._fail_all("worker_crashed: the compile worker exited "
                                              f"with status {payload.wait()}")
            if self._deadlines and \
                    min(d for d, _ in self._deadlines.values()) < time.monotonic():
                self._kill()
                results += self._fail_all(f"compile_timeout: no kernel after "
                                          f"{self.timeout_s:g} s")
        return results

    def _fail_all(self, reason: str) -> list[CompileResult]:
        with self._lock:
            failed = [CompileResult(request_id, digest, False, error=reason)
                      for request_id, (_, digest) in self._deadlines.items()]
            self._deadlines.clear()
            self._process = None
        return failed

    def wait(self, timeout_s: float) -> list[CompileResult]:
        """Block until every request is answered (tests, benchmarks, sync(wait_compiles))."""
        deadline = time.monotonic() + timeout_s
        results = self.poll()
        while self._deadlines and time.monotonic() < deadline:
            time.sleep(0.01)
            results += self.poll()
        return results

    def _kill(self) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def disown(self) -> None:
        """A forked child's copy (Note [Fork] in runtime/engine.py): the worker is the
        parent's, so the child's exit must not stop it."""
        atexit.unregister(self.close)

    def close(self) -> None:
        """Stop the worker without making the program wait: an idle worker exits when its
        stdin closes; one still compiling is killed (its work would be lost anyway)."""
        atexit.unregister(self.close)
        with self._lock:
            process, self._process = self._process, None
            busy = bool(self._deadlines)
            self._deadlines.clear()
        if process is None:
            return
        try:
            process.stdin.close()
            process.wait(timeout=0 if busy else 2)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()


if __name__ == "__main__":
    # Serve from the module imported under its own name, so the results pickle as
    # adaptive_eager.runtime.worker.CompileResult, not __main__.CompileResult.
    from adaptive_eager.runtime import worker
    worker.serve()
