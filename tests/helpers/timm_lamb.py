"""timm's pure-PyTorch ``Lamb`` (``timm/optim/lamb.py``), loaded without importing the ``timm`` package.

timm is installed with ``--no-deps`` (the Makefile pins ``timm==1.0.31``): ``import timm`` needs torchvision, which
bert_ds does not. ``timm/optim/lamb.py`` itself only needs torch and its siblings ``_helpers.py`` / ``_types.py``, so
empty stand-in modules for ``timm`` and ``timm.optim`` whose ``__path__`` points at the installed directories let
Python import ``timm.optim.lamb`` alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

__all__ = ["timm_lamb_class"]


def timm_lamb_class() -> type:
    """``timm.optim.lamb.Lamb``; raises ImportError naming the fix when timm is not installed."""
    loaded = sys.modules.get("timm.optim.lamb")
    if loaded is not None:
        return loaded.Lamb
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("timm is not installed; run `pip install --no-deps timm==1.0.31` (see the Makefile)")
    timm_dir = Path(next(iter(spec.submodule_search_locations)))
    for name, path in (("timm", timm_dir), ("timm.optim", timm_dir / "optim")):
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [str(path)]  # a package, so its submodules are found in the installed directory
            sys.modules[name] = stub
    return importlib.import_module("timm.optim.lamb").Lamb
