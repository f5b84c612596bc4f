"""Allow-listed unpickling of checkpoint files: every ``.pt`` file bert_ds reads goes through here.

``torch.load`` runs with ``weights_only=True`` (no code of the file runs while unpickling) and an explicit
allow-list of the non-tensor types DeepSpeed 0.19 and the RNG files hold (:data:`ALLOWED_GLOBALS`); DeepSpeed's own
loads (``engine.load_checkpoint``, ``zero_to_fp32``) are forced to ``weights_only`` too
(:func:`deepspeed_loads_weights_only`). A file referencing anything else is refused before it is unpickled, naming
the file. A leaf module: the run directory's owner (:mod:`bert_ds.checkpoint`) and the DeepSpeed internals module
both use it, and it imports neither.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from bert_ds.deepspeed_internals import PICKLED_CLASSES
from bert_ds.errors import BadInput

__all__ = ["ALLOWED_GLOBALS", "CheckpointError", "UnsafeCheckpointError", "deepspeed_loads_weights_only",
           "load_tensor_file"]


class CheckpointError(BadInput):
    """A run directory that cannot be read as asked; the message names the path and what is missing."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that references a type outside :data:`ALLOWED_GLOBALS`: refused before it is unpickled."""


ALLOWED_GLOBALS = (
    # rng_rank*.pt: numpy's MT19937 state (np.random.get_state()) is a uint32 ndarray; numpy 2 pickles its rebuild
    # function as numpy._core..., numpy 1 as numpy.core...; the uint32 dtype's class is never named in the file, but
    # restoring the dtype's state needs it allowed
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    # DeepSpeed's own classes in its checkpoint files (bert_ds.deepspeed_internals.PICKLED_CLASSES)
    *PICKLED_CLASSES,
)
"""Every non-tensor, non-builtin type a bert_ds checkpoint file may reference (found by saving real checkpoints at
ZeRO 0, 1, 2 and 3 in fp32 and bf16 and listing ``torch.serialization.get_unsafe_globals_in_checkpoint``; the fp16
loss scaler read from DeepSpeed's source). All are plain data holders whose unpickling runs no code of the file's."""

_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
"""torch >= 2.4 (torch/serialization.py ``load``): when set, every ``torch.load`` is ``weights_only=True`` even where
the caller passed ``weights_only=False``, as DeepSpeed 0.19 does in its checkpoint engine and in ``zero_to_fp32``."""


def _resolve_global(name: str):
    if name.endswith("multiarray._reconstruct"):
        return np.empty(0).__reduce__()[0]  # the same function under either numpy's module name
    if name == "numpy.dtypes.UInt32DType":
        return type(np.dtype(np.uint32))  # numpy 1 has no numpy.dtypes module
    module, attr = name.rsplit(".", 1)
    return getattr(importlib.import_module(module), attr)


def _referenced_globals(path: Path) -> list[str]:
    """The allow-listed globals ``path`` references; UnsafeCheckpointError naming the file for any other.

    Reads only the pickle inside the zip (no tensor data). weights_only loading is the guard; this check names the
    culprit and keeps deepspeed unimported for files that do not reference its types."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: missing") from exc
    except Exception:  # a legacy (non-zip) or damaged file: weights_only loading below still decides
        # DeepSpeed's types only when deepspeed is already imported (it is the one loading, or the caller is)
        return [n for n in ALLOWED_GLOBALS if not n.startswith("deepspeed.") or "deepspeed" in sys.modules]
    refused = sorted(set(names) - set(ALLOWED_GLOBALS))
    if refused:
        raise UnsafeCheckpointError(f"{path}: refused to load: it references {', '.join(refused)}, which no bert_ds "
                                    f"or DeepSpeed checkpoint holds (a tampered or foreign file; unpickling it could "
                                    f"run code)")
    return names


def _safe_globals(names: Iterable[str]) -> list:
    names = set(names)
    if "numpy.dtype" in names:
        names.add("numpy.dtypes.UInt32DType")
    return [(_resolve_global(n), n) for n in sorted(names)]


def _unpickler_reason(exc: Exception) -> str:
    """The line of torch's weights_only error that says what was refused (it opens with generic advice)."""
    generic = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.strip().startswith(generic)]
    return next((ln for ln in lines if ln != "WeightsUnpickler error:"), str(exc)[:200])


def load_tensor_file(path: str | Path, map_location="cpu", mmap: bool = False):
    """``torch.load`` of a checkpoint file with ``weights_only=True`` and only the allow-listed types it references.
    ``mmap``: map the tensors' storage instead of reading it (for a reader that wants the small entries of a big
    file)."""
    path = Path(path)
    names = _referenced_globals(path)
    try:
        with torch.serialization.safe_globals(_safe_globals(names)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{path}: refused to load with weights_only=True: "
                                    f"{_unpickler_reason(exc)}") from exc
    except (RuntimeError, EOFError) as exc:
        raise CheckpointError(f"{path}: cannot be read ({str(exc).splitlines()[0]}); the file is damaged or "
                              f"truncated") from exc


@contextlib.contextmanager
def deepspeed_loads_weights_only(tag_dir: str | Path) -> Iterator[None]:
    """Check every ``.pt`` file of ``tag_dir`` against the allow-list, then force DeepSpeed's own ``torch.load``
    calls inside the block to ``weights_only=True`` with the allow-listed types."""
    files = sorted(Path(tag_dir).glob("*.pt"))
    names = sorted({n for f in files for n in _referenced_globals(f)})
    previous = os.environ.get(_FORCE_WEIGHTS_ONLY)
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(_safe_globals(names)):
            yield
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{tag_dir}: refused to load with weights_only=True: "
                                    f"{_unpickler_reason(exc)}") from exc
    finally:
        if previous is None:
            os.environ.pop(_FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[_FORCE_WEIGHTS_ONLY] = previous
