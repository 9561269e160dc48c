"""adaptive-eager: unchanged PyTorch eager programs, with hot op sequences fused by Inductor.

    import adaptive_eager as ae
    with ae.enabled():
        train()

Importing this package does not import torch (the startup hook relies on that); the API
below loads on first use.
"""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["enable", "disable", "enabled", "paused", "is_enabled", "is_paused", "sync", "stats",
           "reset", "Stats", "config", "ConfigError"]


def __getattr__(name: str):
    if name in ("config", "ConfigError"):
        from adaptive_eager import config as config_module
        return getattr(config_module, name)
    if name in __all__:
        from adaptive_eager import api
        from adaptive_eager.runtime.stats import Stats
        return Stats if name == "Stats" else getattr(api, name)
    raise AttributeError(f"module 'adaptive_eager' has no attribute {name!r}")
