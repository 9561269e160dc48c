"""The decision log: one fixed-format line per runtime decision, on the 'adaptive_eager' logger.

    decision=compiled key=3f9a1c0d2e4b5a69 ops=8 seconds=1.21
    decision=fallback reason=host_sync op=aten._local_scalar_dense.default

Fields are ``name=value`` pairs in a fixed order per decision, so logs can be grepped and
parsed. NEURON_ADAPTIVE_EAGER_LOG=info shows key decisions (hot, compiled, loaded, failed,
unfusible, verify_mismatch); =debug adds the frequent ones (divergence, fallback). Repeats of
the same decision for the same key or reason are rate-limited: at most one line per
``REPEAT_INTERVAL_S``, and the next line says how many were suppressed.
"""
from __future__ import annotations

import logging
import threading
import time

from adaptive_eager.fork_safety import reinit_in_child

log = logging.getLogger("adaptive_eager")

REPEAT_INTERVAL_S = 10.0
MAX_REMEMBERED = 4096       # (decision, key) pairs kept for rate limiting: ever-new keys must
                            # not grow it without bound
# decision -> (level, the field that identifies "the same decision again")
DECISIONS = {
    "hot": (logging.INFO, "key"),
    "compile_waits": (logging.INFO, "key"),
    "compiling": (logging.INFO, "key"),
    "compiled": (logging.INFO, "key"),
    "loaded": (logging.INFO, "key"),
    "failed": (logging.WARNING, "key"),
    "unfusible": (logging.INFO, "key"),
    "compile_disabled": (logging.INFO, "key"),
    "disabled": (logging.INFO, "key"),
    "verify_mismatch": (logging.WARNING, "key"),
    "profit_retimed": (logging.INFO, "key"),
    "unprofitable": (logging.INFO, "key"),
    "megamorphic": (logging.INFO, "key"),
    "generic_kernel": (logging.DEBUG, "key"),
    "not_generic": (logging.INFO, "key"),
    "evicted": (logging.DEBUG, "key"),
    "divergence": (logging.DEBUG, "key"),
    "fallback": (logging.DEBUG, "reason"),
    "pause_requested": (logging.INFO, None),
    "paused": (logging.INFO, None),
    "paused_without_kernels": (logging.INFO, None),
    "paused_kernels_judged": (logging.INFO, None),
    "resumed": (logging.INFO, None),
    "backend_switched": (logging.INFO, None),
    "first_step_plain": (logging.INFO, "optimizer"),
    "thread_lent": (logging.INFO, None),
    "thread_given_back": (logging.INFO, None),
}

_lock = threading.Lock()
reinit_in_child(_lock)   # Note [Fork] (runtime/engine.py)
_last: dict[tuple, list] = {}       # (decision, identity) -> [last time, suppressed count]


def logged(decision: str) -> bool:
    """Would ``decide(decision, ...)`` write a line? For fields that cost to compute (a key's
    digest) in decisions made for keys that may never need one."""
    return log.isEnabledFor(DECISIONS[decision][0])


def decide(decision: str, **fields) -> None:
    """Log one decision (if its level is enabled and it is not a too-recent repeat)."""
    level, identity_field = DECISIONS[decision]
    if not log.isEnabledFor(level):
        return
    identity = (decision, fields.get(identity_field))
    now = time.monotonic()
    with _lock:
        last = _last.get(identity)
        if last is not None and now - last[0] < REPEAT_INTERVAL_S:
            last[1] += 1
            return
        suppressed = last[1] if last is not None else 0
        _last[identity] = [now, 0]
        if len(_last) > MAX_REMEMBERED:
            _forget_older_than(now - REPEAT_INTERVAL_S)
            if len(_last) > MAX_REMEMBERED:     # a storm of new keys: start over
                _last.clear()
    text = " ".join(f"{name}={_format(value)}" for name, value in fields.items())
    if suppressed:
        text += f" repeats_suppressed={suppressed}"
    log.log(level, "decision=%s %s", decision, text)


def _forget_older_than(moment: float) -> None:
    """Drop rate-limit entries last logged before ``moment`` (they would log again anyway)."""
    for identity in [i for i, (logged, _) in _last.items() if logged < moment]:
        del _last[identity]


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text.replace(" ", "_") if len(text) < 120 else text[:117].replace(" ", "_") + "..."


def reset() -> None:
    with _lock:
        _last.clear()
