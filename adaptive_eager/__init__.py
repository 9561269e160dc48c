"""adaptive-eager: unchanged PyTorch eager programs, with hot op sequences fused by Inductor.

    import adaptive_eager as ae
    with ae.enabled():
        train()

Importing this package does not import torch (the startup hook relies on that); the API
below loads on first use.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["enable", "disable", "enabled", "paused", "is_enabled", "is_paused", "sync", "stats",
           "reset", "Stats", "config", "ConfigError"]


def __getattr__(name: str):
    # importlib, not ``from adaptive_eager import ...``: that form asks this very function for
    # the name first, and recursed without end when ``config`` was the first thing imported.
    if name in ("config", "ConfigError"):
        config_module = importlib.import_module("adaptive_eager.config")
        return config_module if name == "config" else config_module.ConfigError
    if name in __all__:
        api = importlib.import_module("adaptive_eager.api")
        stats = importlib.import_module("adaptive_eager.runtime.stats")
        value = stats.Stats if name == "Stats" else getattr(api, name)
        globals()[name] = value        # found once: ``ae.sync()`` in a loop costs no import
        return value
    raise AttributeError(f"module 'adaptive_eager' has no attribute {name!r}")
