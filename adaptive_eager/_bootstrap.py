"""Start-up hook for ``NEURON_ADAPTIVE_EAGER=1``: enable the runtime when torch is imported.

The installed ``adaptive_eager_startup.pth`` imports this module only when the variable is set,
so an unset variable costs one ``os.environ`` lookup. This module must not import torch: it
arms a meta-path finder, and the runtime is enabled right after ``import torch`` completes,
whenever (and if ever) the program does it.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys

class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps torch's loader so the runtime starts after torch loads."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_enable(module):
            exec_module(module)
            _enable_for_process()

        spec.loader.exec_module = exec_then_enable
        return spec


def _enable_for_process() -> None:
    import atexit

    from adaptive_eager import api
    from adaptive_eager.config import ConfigError
    try:
        api.enable()
    except ConfigError as err:
        # Inside the program's `import torch`: a traceback there would point at torch. One
        # line saying what to fix, and the program runs as plain eager PyTorch.
        print(f"adaptive-eager: {err} Running without adaptive-eager.", file=sys.stderr)
        return
    atexit.register(api.disable)


def arm() -> None:
    """Enable when torch is imported (now, if it already was)."""
    if "torch" in sys.modules:
        _enable_for_process()
    elif not any(isinstance(finder, _TorchImportHook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportHook())
