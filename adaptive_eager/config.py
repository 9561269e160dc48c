"""Every setting of adaptive-eager, declared once, read once from the environment.

Each setting names its environment variable, type, default and help. None changes what a
compiled kernel computes: what does (dtype defaults, grad mode, autocast...) is ambient torch
state, part of every segment key (dispatch/signature.py, ``key_context``).

Tests override values with ``config.patch(NAME=value)``; nothing else reads ``os.environ``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Any, Callable, Iterator

ENV_PREFIX = "NEURON_ADAPTIVE_EAGER"


class ConfigError(ValueError):
    """A setting has a value we cannot use; the message names the variable and what it accepts."""


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise ValueError(f"expected an integer >= {minimum}")
        return value
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _log_level(text: str) -> str:
    lowered = text.strip().lower()
    if lowered not in ("off", "warning", "info", "debug"):
        raise ValueError("expected one of off, warning, info, debug")
    return lowered


def _verify_mode(text: str) -> str:
    lowered = text.strip().lower()
    if lowered in ("0", "off", "false", "no", ""):
        return "off"
    if lowered in ("1", "on", "true", "yes"):
        return "on"
    if lowered == "strict":
        return "strict"
    raise ValueError("expected 0 (off), 1 (log, demote and go on) or strict (raise)")


def _report_target(text: str) -> str:
    lowered = text.strip().lower()
    if lowered in ("0", "off", "false", "no", ""):
        return ""
    if lowered in ("1", "on", "true", "yes", "stderr"):
        return "stderr"
    if not lowered.endswith(".json"):
        raise ValueError("expected 0, 1 (stderr) or a path ending in .json")
    return text.strip()


def _key_prefixes(text: str) -> tuple:
    prefixes = tuple(part.strip().lower() for part in text.split(",") if part.strip())
    for prefix in prefixes:
        if any(c not in "0123456789abcdef" for c in prefix):
            raise ValueError(f"{prefix!r} is not a key prefix: expected comma-separated "
                             "hexadecimal digest prefixes, as `adaptive-eager cache ls` shows")
    return prefixes


def _backend(text: str) -> str:
    lowered = text.strip().lower()
    if lowered not in ("auto", "cpp", "python"):
        raise ValueError("expected one of auto, cpp, python")
    return lowered


def _directory(text: str) -> str:
    path = os.path.abspath(os.path.expanduser(text.strip()))
    if not text.strip():
        raise ValueError("expected a directory path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} exists and is not a directory")
    return path


SMALL_MACHINE_CORES = 4   # at most this many cores: a compile competes with the program


def small_machine() -> bool:
    return (os.cpu_count() or 1) <= SMALL_MACHINE_CORES


def _percent(text: str) -> int:
    value = _non_negative_int(text)
    if value > 100:
        raise ValueError("an integer from 0 to 100")
    return value


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "adaptive_eager")


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str                      # attribute name, e.g. HOT_THRESHOLD
    parse: Callable[[str], Any]    # str -> typed value; raises ValueError with what it accepts
    default: Callable[[], Any]     # called lazily so defaults can depend on the machine
    help: str

    @property
    def env_var(self) -> str:
        return ENV_PREFIX if self.name == "ENABLE" else f"{ENV_PREFIX}_{self.name}"


SETTINGS: tuple[Setting, ...] = (
    Setting("ENABLE", _parse_bool, lambda: False,
            "Run every Python process that imports torch under the runtime (the startup hook)."),
    # auto: every parity test passes on cpp (tests/runtime, both backends), and a machine
    # without the extension built starts at once on python (dispatch/native.py).
    Setting("BACKEND", _backend, lambda: "auto",
            "How ops are intercepted: cpp (a C++ dispatcher fallback, ~0.2 us per op passed "
            "through; built with the system compiler on first use, in the background, into "
            "CACHE_DIR/ext), python (a TorchDispatchMode, ~4.4 us per op), or auto: cpp once "
            "built, python until then and where it cannot be built. With cpp, a failed build "
            "is one warning and python."),
    Setting("COMPILE", _parse_bool, lambda: True,
            "0 = record and key segments but never compile: the debugging switch. Results are "
            "then bitwise identical to eager."),
    Setting("HOT_THRESHOLD", _positive_int, lambda: 2,
            "How many times a segment key must be seen before it is compiled."),
    Setting("MAX_SEGMENT_OPS", _positive_int, lambda: 64,
            "Longest segment, in aten ops; longer runs are cut."),
    Setting("ASYNC", _parse_bool, lambda: True,
            "1: compile hot segments in a background worker process while the program goes "
            "on per-op; 0: compile synchronously, in the program's thread (tests, debugging)."),
    Setting("COMPILE_TIMEOUT_S", _positive_int, lambda: 600,
            "A background compile taking longer than this (seconds) is abandoned: the worker "
            "is restarted and the segment runs per-op for good."),
    Setting("COMPILE_COST_MS", _non_negative_int, lambda: 2000 if small_machine() else 0,
            "What one background compile is taken to cost the program (milliseconds). A hot "
            "segment's compile starts once the time its per-op runs would have saved fused "
            "(predicted from its ops) adds up to this, so a program that ends sooner never "
            "pays for kernels it could not use (ae.sync(wait_compiles=...) starts it at once). "
            "Default 2000 on machines with at most 4 cores, where a compile competes with the "
            "program; 0 on larger ones."),
    Setting("PAUSE", _parse_bool, lambda: True,
            "1: where the runtime keeps finding nothing worth fusing (PAUSE_WINDOW segments "
            "in a row), stop intercepting, and re-probe after a growing interval at the next "
            "optimizer step, backward(), DataLoader batch or ae.sync()."),
    Setting("PAUSE_WINDOW", _positive_int, lambda: 256,
            "Segments without anything profitable before the runtime pauses itself."),
    Setting("MIN_SEGMENT_US", _non_negative_int, lambda: 100,
            "Segments whose ops compute for less than this (microseconds per run, measured "
            "per-op) are never compiled: fusion could not repay its own overhead."),
    Setting("MIN_US_PER_OP", _non_negative_int, lambda: 20,
            "Also never compiled: segments whose ops compute for less than MIN_SEGMENT_US plus "
            "this much per op (microseconds). The Python mode's hot path costs more than this "
            "per op, and per-op timings under the runtime include its dispatch, so such a "
            "kernel could never beat plain eager. Where the C++ hot path runs kernels (about "
            "1 us per op), at most 2 is used."),
    Setting("MAX_EXTERN_PERCENT", _percent, lambda: 90,
            "Segments spending more than this share (percent) of their time in matmuls or "
            "convolutions, which a kernel calls as they are, are never compiled: fusing the "
            "ops around them cannot save much. 100: no such limit."),
    Setting("KEEP_UNPROFITABLE", _parse_bool, lambda: False,
            "1: keep every compiled kernel even when its runs are no faster than per-op "
            "(normally such keys go back to per-op for good, as 'unprofitable')."),
    Setting("MAX_SHAPE_VARIANTS", _positive_int, lambda: 8,
            "Compiled shape variants per segment structure; past that, new shapes of it run "
            "per-op (megamorphic), so a loop of ever-new shapes compiles a bounded number of "
            "times."),
    Setting("BUFFER_POOL_MB", _non_negative_int, lambda: 1024,
            "CPU memory (MiB) kept to reuse for large deferred outputs (saves page faults); "
            "0 disables the pool."),
    Setting("MALLOC_TUNING", _parse_bool, lambda: False,
            "1 (opt-in): on glibc, the first enable() sets the process's malloc thresholds to "
            "32/64 MiB, where glibc's own adaptation ends, so large CPU tensors freed and "
            "allocated again each step are not page-faulted back in; up to 64 MiB of freed "
            "memory stays with the process, and disable() cannot undo it. Skipped where "
            "MALLOC_*_ or GLIBC_TUNABLES malloc settings are set. 0: leave malloc alone."),
    Setting("CACHE_DIR", _directory, _default_cache_dir,
            "Where compiled kernels and segment records are kept (shared by processes)."),
    Setting("EXT_DIR", _directory, lambda: os.path.join(_default_cache_dir(), "ext"),
            "Where the C++ interception extension is built: once per user, torch version and "
            "source, for every cache directory (private, like the cache directory)."),
    Setting("CACHE_SHARED", _parse_bool, lambda: False,
            "1: the cache directory is shared with other users on purpose: create it with the "
            "umask's permissions and load its artifacts whoever owns or can write them. 0: "
            "create it private (0700) and never load compiled code from a cache directory or "
            "artifact that another user owns or can write (one warning; compiled afresh)."),
    Setting("CACHE_SIZE", _positive_int, lambda: 256,
            "Compiled kernels kept loaded in memory; the least recently used are evicted."),
    Setting("MAX_KEYS", _positive_int, lambda: 10000,
            "Segment keys remembered in memory (with their recorded ops, but for keys seen once "
            "only the last 64); past this the least recently seen keys without a kernel are "
            "forgotten (their decisions stay on disk)."),
    Setting("CACHE_MAX_ENTRIES", _positive_int, lambda: 50000,
            "Segment records kept in the cache directory; past this the least recently used "
            "are removed with their artifacts, so disk use stays bounded."),
    Setting("LOG", _log_level, lambda: None,
            "Decision log on the 'adaptive_eager' logger: off, warning, info (each key "
            "decision) or debug (also divergences and per-op fallbacks). Unset: the program's "
            "logging configuration decides (warnings show)."),
    Setting("VERIFY", _verify_mode, lambda: "off",
            "1: also run every fused segment per-op on copies of its inputs and compare; a "
            "mismatch is logged, the key demoted to per-op, the per-op result kept. strict: "
            "raise instead. Slow: for debugging."),
    Setting("REPORT", _report_target, lambda: "",
            "1: print a report at exit (counters, top segments by time saved, fallbacks by "
            "reason, compile time) to stderr; a path ending in .json: write it there."),
    Setting("DISABLE_KEYS", _key_prefixes, lambda: (),
            "Comma-separated key prefixes never to fuse (bisecting a numerical difference "
            "without clearing the cache)."),
)
_BY_NAME = {setting.name: setting for setting in SETTINGS}


def _read(setting: Setting) -> Any:
    raw = os.environ.get(setting.env_var)
    if raw is None:
        return setting.default()
    try:
        return setting.parse(raw)
    except ValueError as err:
        raise ConfigError(f"{setting.env_var}={raw!r} is not valid: {err}. "
                          f"({setting.help})") from None


class _Config:
    """Attribute access to settings; each is read from the environment once, on first use.

    A value read is kept as an instance attribute too, so later reads are plain attribute
    lookups: the runtime reads settings on its hot Python paths (a control point reads
    several), and ``__getattr__``, which Python calls only after a lookup failed, cost
    ~0.4 us a read."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        setting = _BY_NAME.get(name)
        if setting is None:
            raise AttributeError(f"adaptive_eager.config has no setting {name!r}")
        with self._lock:
            value = self._values.setdefault(name, _read(setting))
            self.__dict__[name] = value
        return value

    def _replace_values(self, values: dict[str, Any]) -> None:
        """Settings read so far become ``values`` (the rest are read again on first use)."""
        for name in self._values:
            self.__dict__.pop(name, None)
        self._values.clear()
        self._values.update(values)
        self.__dict__.update(values)

    def validate_all(self) -> None:
        """Read every setting now so a bad value fails at start-up, not mid-run."""
        for setting in SETTINGS:
            getattr(self, setting.name)

    def reload(self) -> None:
        """Forget values read so far (tests that change os.environ)."""
        with self._lock:
            self._replace_values({})

    @contextlib.contextmanager
    def patch(self, **overrides: Any) -> Iterator[None]:
        """Temporarily set settings by name (tests)."""
        unknown = set(overrides) - set(_BY_NAME)
        if unknown:
            raise AttributeError(f"unknown settings: {sorted(unknown)}")
        with self._lock:
            saved = dict(self._values)
            self._replace_values({**saved, **overrides})
        try:
            yield
        finally:
            with self._lock:
                self._replace_values(saved)

    def describe(self) -> list[dict]:
        """Every setting with its variable, current value and help (for docs and the CLI)."""
        return [{"env": s.env_var, "value": getattr(self, s.name), "help": s.help}
                for s in SETTINGS]


config = _Config()


def __getattr__(name: str) -> Any:
    # ``adaptive_eager.config`` is this module once anything has imported it, so the module
    # answers like the settings object: ``ae.config.HOT_THRESHOLD``, ``ae.config.patch(...)``.
    return getattr(config, name)
