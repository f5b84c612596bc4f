"""The one owner of the run directory: layout, atomic ``latest`` pointer, retention, run state, consolidation.

Everything else asks this module: the exporter (:mod:`bert_ds.export`) and evaluation (:mod:`bert_ds.evaluate`) read
checkpoints through :func:`open_checkpoint` and :func:`consolidated_state_dict`, never by globbing the files. Layout::

    RUN_DIR/.lock                        flock of the live run: host, pid, start time (one run per directory)
    RUN_DIR/recipe.json                  the resolved recipe of the run
    RUN_DIR/tensorboard/                 metrics
    RUN_DIR/checkpoints/                 DeepSpeed's save dir
        latest                           tag of the newest *complete* checkpoint (written last, atomically)
        model_config.json                BertConfig.save
        tokenizer/                       vocab.txt, tokenizer_meta.json (the casing training used, always written)
                                         (+ tokenizer.json, tokenizer_config.json when present)
        phase1-step000040/               one DeepSpeed tag: mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt
            run_state.json               recipe, phase, step, consumed samples, loader state, world size (readable
                                         without torch; the same dict is DeepSpeed's client state)
            rng_rank00000.pt ...         python / numpy / torch CPU (+ CUDA) RNG states of each rank

ZeRO 1/2 run with ``elastic_checkpoint`` so the optimizer partitions are merged and re-cut by DeepSpeed when the
number of ranks changes between save and resume. Tags are ``phaseN-stepNNNNNN``; a tag is complete once its
``run_state.json`` exists (written last); ``<tag>.tmp`` (a save in progress) and ``.<tag>.old`` (the tag being replaced)
never parse as tags, so they are never listed, resumed or exported. deepspeed is imported only inside the functions
that need it, so reading a run directory (export, evaluation) does not import it.

Safety and durability:

* Every ``.pt`` file is loaded with ``weights_only=True`` (no code runs while unpickling) and an explicit allow-list of
  the non-tensor types DeepSpeed 0.19 and the RNG files hold (:data:`ALLOWED_GLOBALS`); DeepSpeed's own loads
  (``engine.load_checkpoint``, ``zero_to_fp32``) are forced to ``weights_only`` too
  (:func:`deepspeed_loads_weights_only`). A file referencing anything else is refused before it is unpickled, naming
  the file (exit 2).
* ``RUN_DIR/.lock`` (``flock``, held by rank 0 for the run's life, :func:`hold_run_dir`) refuses a second run on the
  same ``--output``, naming the holder; the kernel drops the lock of a dead process, so a stale one is taken over.
* A save that fails on any rank (disk full: ``OSError`` / torch's ``RuntimeError``) is agreed on by all ranks, its
  ``<tag>.tmp`` removed, ``latest`` and the previous tags left as they were, and one :class:`CheckpointSaveError`
  naming the directory and the space needed is raised (a ValueError: ``bert_ds.runtime.pretrain`` exits 2).
* Files of a tag, then the tag directory, then ``latest`` (temp file, fsync, rename, fsync of the directory) reach the
  disk in that order, so after a power loss ``latest`` never names data that was not written.
* Pruning renames a tag to ``.<tag>.deleting`` before deleting it; :func:`remove_debris` (start of every save, and when
  the run takes its lock) deletes leftover ``.*.deleting``, ``*.tmp`` and ``.*.old`` (an ``.<tag>.old`` whose ``<tag>``
  is missing is renamed back: it is the only copy). Phase-end checkpoints (``phase_done``) are never pruned.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bert_ds.config import BertConfig
from bert_ds.data.tokenizer import META_NAME, load_tokenizer, read_lowercase

__all__ = ["ALLOWED_GLOBALS", "BYTES_PER_PARAMETER", "CHECKPOINT_DIR", "LOCK_NAME", "RUN_STATE_NAME",
           "MODEL_CONFIG_NAME", "TOKENIZER_DIR_NAME", "CheckpointError", "CheckpointSaveError", "RunLockedError",
           "UnsafeCheckpointError", "CheckpointRef", "RunLock", "acquire_run_lock", "hold_run_dir",
           "check_free_space", "parameter_count", "remove_debris", "load_tensor_file",
           "deepspeed_loads_weights_only", "resolve_tag", "read_model_config", "tokenizer_dir", "open_checkpoint",
           "checkpoint_dir", "tag_for", "parse_tag", "list_tags", "read_latest", "read_run_state", "save_checkpoint",
           "prune_checkpoints", "save_rng_state", "load_rng_state", "write_run_metadata", "consolidated_state_dict"]

CHECKPOINT_DIR = "checkpoints"
RUN_STATE_NAME = "run_state.json"
MODEL_CONFIG_NAME = "model_config.json"
TOKENIZER_DIR_NAME = "tokenizer"
_TAG = re.compile(r"^phase(\d+)-step(\d+)$")
_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json")


class CheckpointError(ValueError):
    """A run directory that cannot be read as asked; the message names the path and what is missing."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that references a type outside :data:`ALLOWED_GLOBALS`: refused before it is unpickled."""


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank (disk full, quota, I/O error); the partial tag is gone, ``latest`` is intact."""


class RunLockedError(CheckpointError):
    """Another live process holds the run directory's lock."""


log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
BYTES_PER_PARAMETER = 16
"""Checkpoint bytes per model parameter when no checkpoint exists yet to measure: fp32 ZeRO 1/2 writes the module's
weights (4) + the fp32 master partition (4) + two optimizer moments (8); fp16/bf16 write 2 + 4 + 8."""

ALLOWED_GLOBALS = (
    # rng_rank*.pt: numpy's MT19937 state (np.random.get_state()) is a uint32 ndarray; numpy 2 pickles its rebuild
    # function as numpy._core..., numpy 1 as numpy.core...; the uint32 dtype's class is never named in the file, but
    # restoring the dtype's state needs it allowed
    "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
    "numpy.dtypes.UInt32DType",
    # zero_pp_rank_*_optim_states.pt of DeepSpeed 0.19 (runtime/zero/stage_1_and_2.py ``state_dict``): the loss scaler
    # object (static for fp32/bf16, dynamic for fp16), the ZeRO stage enum and the param-slice map's addresses
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
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


def load_tensor_file(path: str | Path, map_location="cpu"):
    """``torch.load`` of a checkpoint file with ``weights_only=True`` and only the allow-listed types it references."""
    path = Path(path)
    names = _referenced_globals(path)
    try:
        with torch.serialization.safe_globals(_safe_globals(names)):
            return torch.load(path, map_location=map_location, weights_only=True)
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


@dataclass(frozen=True)
class CheckpointRef:
    """A resolved, complete checkpoint: everything needed to rebuild the model and its tokenizer."""

    checkpoint_dir: Path
    tag: str
    config: BertConfig
    tokenizer_dir: Path


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def tag_for(phase_index: int, step: int) -> str:
    """``phase1-step000040``: 1-based phase, step within the phase (optimizer steps done)."""
    return f"phase{phase_index + 1}-step{step:06d}"


def parse_tag(tag: str) -> tuple[int, int] | None:
    """(phase_index, step) of a bert_ds tag, or None for anything else."""
    m = _TAG.match(tag)
    return (int(m.group(1)) - 1, int(m.group(2))) if m else None


def list_tags(ckpt_dir: str | Path) -> list[str]:
    """bert_ds tags under ``ckpt_dir`` that hold a run state, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and parse_tag(p.name) and (p / RUN_STATE_NAME).is_file()]
    return sorted(tags, key=parse_tag)


def read_latest(ckpt_dir: str | Path) -> str | None:
    """The tag ``latest`` names, None without a ``latest`` file; a CheckpointError if that tag is incomplete."""
    path = Path(ckpt_dir) / "latest"
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if not (Path(ckpt_dir) / tag / RUN_STATE_NAME).is_file():
        raise CheckpointError(f"{path} names tag {tag!r} but {Path(ckpt_dir) / tag / RUN_STATE_NAME} is missing")
    return tag


def read_run_state(ckpt_dir: str | Path, tag: str) -> dict:
    return json.loads((Path(ckpt_dir) / tag / RUN_STATE_NAME).read_text())


def resolve_tag(ckpt_dir: str | Path, tag: str | None = None) -> str:
    """``tag`` (or the one ``latest`` names) after checking it is a complete checkpoint of ``ckpt_dir``."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: not a directory")
    tags = list_tags(ckpt_dir)
    if tag is None:
        tag = read_latest(ckpt_dir)
        if tag is None:
            if tags:
                raise CheckpointError(f"{ckpt_dir}: no 'latest' file (the newest save may not have finished); pass a "
                                      f"tag, complete ones: {tags}")
            raise CheckpointError(f"{ckpt_dir}: no bert_ds checkpoint here (no 'latest' file, no complete tag)")
        return tag
    if tag in tags:
        return tag
    if parse_tag(tag) is not None and (ckpt_dir / tag).is_dir():
        raise CheckpointError(f"{ckpt_dir / tag}: no {RUN_STATE_NAME}, so this checkpoint is incomplete (a save that "
                              f"did not finish); pick a complete tag: {tags}")
    raise CheckpointError(f"{ckpt_dir}: checkpoint tag {tag!r} not found; available: {tags or 'none'}")


def read_model_config(ckpt_dir: str | Path) -> BertConfig:
    path = Path(ckpt_dir) / MODEL_CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (training saves the model config beside the checkpoint tags)")
    try:
        return BertConfig.load(path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc


def tokenizer_dir(ckpt_dir: str | Path) -> Path:
    """The tokenizer copied beside the tags: a directory :func:`bert_ds.data.tokenizer.load_tokenizer` reads."""
    path = Path(ckpt_dir) / TOKENIZER_DIR_NAME
    if not (path / "vocab.txt").is_file():
        raise CheckpointError(f"{path / 'vocab.txt'}: missing (training copies the tokenizer beside the checkpoint "
                              f"tags)")
    return path


def open_checkpoint(ckpt_dir: str | Path, tag: str | None = None) -> CheckpointRef:
    """Resolve ``tag`` (``latest`` unless given) and check the model config and the tokenizer agree on the
    vocabulary, before anything reads tensors."""
    ckpt_dir = Path(ckpt_dir)
    tag = resolve_tag(ckpt_dir, tag)
    config = read_model_config(ckpt_dir)
    tok_dir = tokenizer_dir(ckpt_dir)
    try:
        size = load_tokenizer(tok_dir).vocab_size
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{tok_dir}: cannot load the tokenizer: {exc}") from exc
    if size != config.vocab_size:
        raise CheckpointError(f"{ckpt_dir / MODEL_CONFIG_NAME}: vocab_size={config.vocab_size} but "
                              f"{tok_dir / 'vocab.txt'} has {size} tokens")
    return CheckpointRef(ckpt_dir, tag, config, tok_dir)


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _atomic_write(path: Path, text: str) -> None:
    """Temp file, fsync, rename, fsync of the directory: after a crash ``path`` holds the old or the new text."""
    tmp = path.with_name(f".{path.name}.tmp")
    _write_synced(tmp, text)
    os.replace(tmp, path)
    _fsync(path.parent)


def write_run_metadata(run_dir: str | Path, recipe, model_config, tokenizer_dir: str | Path | None) -> None:
    """Rank 0: recipe.json in the run dir; model_config.json and the tokenizer beside the checkpoint tags.

    The copied tokenizer always gets a ``tokenizer_meta.json`` holding the casing training resolved
    (:func:`bert_ds.data.tokenizer.load_tokenizer`: the meta file, else a Hugging Face ``tokenizer_config.json``'s
    ``do_lower_case``, else uncased), so the export carries that casing whatever the source directory held."""
    run_dir = Path(run_dir)
    ckpt = checkpoint_dir(run_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    _atomic_write(run_dir / "recipe.json", json.dumps(recipe.to_dict(), indent=2) + "\n")
    model_config.save(ckpt / MODEL_CONFIG_NAME)
    if tokenizer_dir is not None:
        lowercase = read_lowercase(tokenizer_dir)
        out = ckpt / TOKENIZER_DIR_NAME
        out.mkdir(exist_ok=True)
        for name in _TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copyfile(src, out / name)
        _atomic_write(out / META_NAME, json.dumps({"lowercase": lowercase}) + "\n")


def save_rng_state(path: Path) -> None:
    """This rank's Python, NumPy, torch CPU and (with CUDA) every CUDA device's generator state, in types
    ``weights_only`` loading accepts (the CUDA states are uint8 tensors)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(state, path)


def load_rng_state(path: Path) -> None:
    """Restore what :func:`save_rng_state` saved (same rank count: the caller checks). CUDA states are restored when
    this process sees as many devices as the saving one did; otherwise a warning names the file."""
    state = load_tensor_file(path)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning("%s holds %d CUDA generator states but %d devices are visible: CUDA random streams start "
                        "afresh", path, len(cuda), torch.cuda.device_count())


def _any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (an all-reduce, so also a barrier)."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([float(flag)], device=get_accelerator().current_device_name())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


_RANK_IN_NAME = re.compile(r"(?:pp_rank_|rng_rank)(\d+)")


def _fsync_own_files(tag_dir: Path, rank: int) -> None:
    """fsync the files this rank wrote (``zero_pp_rank_<r>_*``, ``rng_rank<r>``; rank 0 also the rest, e.g.
    ``mp_rank_00_model_states.pt``): on a shared filesystem only the writer's fsync flushes its client cache."""
    for f in tag_dir.iterdir():
        m = _RANK_IN_NAME.search(f.name)
        if f.is_file() and (int(m.group(1)) == rank if m else rank == 0):
            _fsync(f)


def _write_tag(engine, ckpt: Path, tmp_tag: str, tag: str, run_state: dict, rank: int) -> Exception | None:
    """Everything that needs disk space, on this rank; returns the error instead of raising so all ranks can agree."""
    import deepspeed.comm as dist

    from bert_ds.data.loader import LoaderWorkerError

    try:
        engine.save_checkpoint(str(ckpt), tag=tmp_tag, client_state={"bert_ds": run_state}, save_latest=False)
    except LoaderWorkerError:
        raise  # a worker died while we saved (SIGCHLD): not a failed save; the partial tag is debris for next start
    except (OSError, RuntimeError) as exc:  # torch.save on a full disk: RuntimeError "basic_ios::clear" / "file write"
        # DeepSpeed 0.19 (runtime/engine.py save_checkpoint) writes every file between its tag-validation all-reduce
        # and one closing barrier, where the other ranks now wait: stand in for it before agreeing.
        dist.barrier()
        return exc
    try:
        save_rng_state(ckpt / tmp_tag / f"rng_rank{rank:05d}.pt")
        _fsync_own_files(ckpt / tmp_tag, rank)
        if rank == 0:
            _write_synced(ckpt / tmp_tag / RUN_STATE_NAME, json.dumps(run_state, indent=1) + "\n")
            _fsync(ckpt / tmp_tag)
            _write_synced(ckpt / ".latest.tmp", tag)  # the pointer's bytes need space too: written before agreeing
    except LoaderWorkerError:
        raise
    except (OSError, RuntimeError) as exc:
        return exc
    return None


def _publish(ckpt: Path, tmp_tag: str, tag: str) -> None:
    """Rank 0, all files on disk: rename ``<tag>.tmp`` to ``tag`` (replacing an older one), then move ``latest``."""
    old = ckpt / f".{tag}.old"
    if (ckpt / tag).exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(ckpt / tag, old)
    os.replace(ckpt / tmp_tag, ckpt / tag)
    _fsync(ckpt)  # the tag's new name is durable before ``latest`` names it
    os.replace(ckpt / ".latest.tmp", ckpt / "latest")
    _fsync(ckpt)
    shutil.rmtree(old, ignore_errors=True)


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _save_failure(ckpt: Path, tag: str, error: Exception | None, num_parameters: int) -> CheckpointSaveError:
    tags = list_tags(ckpt)
    needed = int(1.1 * (_tree_bytes(ckpt / tags[-1]) if tags else BYTES_PER_PARAMETER * num_parameters))
    free = shutil.disk_usage(ckpt).free
    cause = "the save failed on another rank"
    if error is not None:
        cause = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    kept = f"'latest' still names {read_latest(ckpt)}" if (ckpt / "latest").is_file() else "no earlier checkpoint"
    return CheckpointSaveError(f"cannot save checkpoint {tag} in {ckpt} ({cause}): {free / 2**20:,.1f} MiB free there, "
                               f"a checkpoint of this run needs about {needed / 2**20:,.1f} MiB; the partial "
                               f"{tag}.tmp was removed and {kept}. Free space, then resume with --resume auto")


def save_checkpoint(engine, run_dir: str | Path, tag: str, run_state: dict, keep_last_k: int) -> Path:
    """Save on every rank; ``latest`` moves to ``tag`` only after all ranks finished writing.

    DeepSpeed writes its files into a fresh ``<tag>.tmp`` directory with ``save_latest=False`` (a tag directory left
    by an earlier, possibly larger, run would otherwise keep its extra ``zero_pp_rank_*`` files and break
    consolidation); each rank adds its RNG state and fsyncs its files; rank 0 adds ``run_state.json``. All ranks then
    agree whether every write succeeded: if not, the partial ``<tag>.tmp`` is removed and every rank raises
    :class:`CheckpointSaveError` (``latest`` and the older tags untouched). Otherwise rank 0 renames the directory to
    ``tag`` (replacing an older one) and then moves ``latest``, so a crash at any point leaves ``latest`` naming a
    complete checkpoint. Older tags beyond ``keep_last_k`` (phase ends excepted) are pruned afterwards.
    """
    from bert_ds.runtime.distributed import sigchld_deferred

    with sigchld_deferred():
        return _save_checkpoint(engine, run_dir, tag, run_state, keep_last_k)


def _save_checkpoint(engine, run_dir: str | Path, tag: str, run_state: dict, keep_last_k: int) -> Path:
    import deepspeed.comm as dist

    ckpt = checkpoint_dir(run_dir)
    rank = dist.get_rank()
    tmp_tag = f"{tag}.tmp"  # parse_tag ignores it, so a half-written one is never listed or resumed
    if rank == 0:
        remove_debris(ckpt)
    dist.barrier()
    error = _write_tag(engine, ckpt, tmp_tag, tag, run_state, rank)
    if _any_rank(error is not None):
        if rank == 0:
            shutil.rmtree(ckpt / tmp_tag, ignore_errors=True)
            (ckpt / ".latest.tmp").unlink(missing_ok=True)
        dist.barrier()
        raise _save_failure(ckpt, tag, error, sum(p.numel() for p in engine.module.parameters()))
    if rank == 0:
        _publish(ckpt, tmp_tag, tag)
        prune_checkpoints(ckpt, keep_last_k)
    dist.barrier()
    return ckpt / tag


def _phase_done(ckpt_dir: Path, tag: str) -> bool:
    try:
        return bool(read_run_state(ckpt_dir, tag).get("phase_done", False))
    except (OSError, ValueError):
        return False


def prune_checkpoints(ckpt_dir: str | Path, keep_last_k: int) -> list[str]:
    """Delete all but the newest ``keep_last_k`` tags; never the one ``latest`` names, never a phase's final
    checkpoint (``phase_done``: the hand-off point and the export a user wants from that phase). A tag is renamed to
    ``.<tag>.deleting`` before it is deleted, so a kill mid-way leaves debris :func:`remove_debris` recognises, not a
    half-deleted tag. Returns the deleted tags."""
    ckpt_dir = Path(ckpt_dir)
    tags = list_tags(ckpt_dir)
    latest = read_latest(ckpt_dir)
    keep = set(tags[-max(keep_last_k, 1):]) | {latest} | {t for t in tags if _phase_done(ckpt_dir, t)}
    deleted = [t for t in tags if t not in keep]
    for tag in deleted:
        doomed = ckpt_dir / f".{tag}.deleting"
        os.replace(ckpt_dir / tag, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return deleted


_DEBRIS = re.compile(r"^(?:phase\d+-step\d+\.tmp|\.phase\d+-step\d+\.deleting|\.latest\.tmp)$")
_REPLACED = re.compile(r"^\.(phase\d+-step\d+)\.old$")


def remove_debris(ckpt_dir: str | Path) -> list[str]:
    """Delete what killed saves and prunes left in ``ckpt_dir``: ``<tag>.tmp`` (unfinished save), ``.<tag>.deleting``
    (unfinished prune), ``.latest.tmp``, ``.<tag>.old`` (a replaced tag). An ``.<tag>.old`` whose ``<tag>`` is missing
    (killed between the two renames of a re-save) is renamed back instead: it is the only copy. Only the process
    holding the run's lock may call this. Returns the names removed or restored."""
    ckpt_dir = Path(ckpt_dir)
    done = []
    for path in sorted(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []:
        replaced = _REPLACED.match(path.name)
        if replaced and not (ckpt_dir / replaced.group(1)).exists():
            os.replace(path, ckpt_dir / replaced.group(1))
        elif replaced or _DEBRIS.match(path.name):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        else:
            continue
        done.append(path.name)
    if done:
        _fsync(ckpt_dir)
        log.info("%s: removed the debris of interrupted saves/prunes: %s", ckpt_dir, done)
    return done


def parameter_count(config: BertConfig) -> int:
    """Parameters of :class:`bert_ds.model.BertForPreTraining` for ``config`` (decoder weight tied to the word
    embeddings), without building the model."""
    h, i, v = config.hidden_size, config.intermediate_size, config.padded_vocab_size
    embeddings = (v + config.max_position_embeddings + config.type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h  # q, k, v, out; FFN in, out; two LayerNorms
    heads = (h * h + h) + (h * h + h) + 2 * h + v + (2 * h + 2)  # pooler; MLM transform + LayerNorm + bias; NSP
    return embeddings + config.num_hidden_layers * layer + heads


def check_free_space(run_dir: str | Path, model_config: BertConfig) -> int:
    """Pre-flight: the run directory's filesystem must hold one more checkpoint (1.1 x the newest complete tag, or
    :data:`BYTES_PER_PARAMETER` x the model's parameters before the first). Returns the bytes needed; raises
    CheckpointError naming the directory, what is free and what is needed."""
    ckpt = checkpoint_dir(run_dir)
    tags = list_tags(ckpt)
    params = parameter_count(model_config)
    needed = int(1.1 * (_tree_bytes(ckpt / tags[-1]) if tags else BYTES_PER_PARAMETER * params))
    existing = Path(run_dir).absolute()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < needed:
        basis = f"1.1 x checkpoint {tags[-1]}" if tags else f"{BYTES_PER_PARAMETER} B x {params:,} parameters"
        raise CheckpointError(f"{ckpt}: {free / 2**20:,.1f} MiB free on its filesystem, but a checkpoint needs about "
                              f"{needed / 2**20:,.1f} MiB ({basis}); free space or choose another --output")
    return needed


@dataclass
class RunLock:
    """``RUN_DIR/.lock`` held with ``flock`` until :meth:`release` or the process ends (the kernel then drops it)."""

    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock; the file stays (deleting it would race)
            self.fd = None


def acquire_run_lock(run_dir: str | Path) -> RunLock:
    """Lock ``run_dir`` for this process, recording host, pid and start time in the lock file; RunLockedError naming
    the holder when a live process holds it. A lock file left by a dead process is not held (flock dies with its
    holder) and is taken over silently. On NFS, Linux maps flock to POSIX locks, which the server arbitrates."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        try:
            h = json.loads(holder)
            who = f"pid {h['pid']} on host {h['host']}, started {h['started']}"
        except (ValueError, KeyError, TypeError):
            who = "a process that is still starting"
        raise RunLockedError(f"{run_dir} is in use by another bert_ds run ({who}; lock file {path}): two runs on one "
                             f"--output would overwrite each other's checkpoints. Wait for it to end or choose "
                             f"another --output") from None
    info = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return RunLock(path, fd)


def hold_run_dir(run_dir: str | Path, rank: int) -> RunLock | None:
    """Every rank calls this before the run writes anything: rank 0 takes :func:`acquire_run_lock` and removes the
    debris of interrupted saves; all ranks agree, so when the lock is held elsewhere every rank raises
    RunLockedError (exit 2, nothing computed). Returns rank 0's lock (release it when the run ends), None elsewhere."""
    lock, refusal = None, None
    if rank == 0:
        try:
            lock = acquire_run_lock(run_dir)
        except RunLockedError as exc:
            refusal = exc
    if _any_rank(refusal is not None):
        raise refusal or RunLockedError(f"{run_dir}: rank 0 could not lock it (another run holds it; see rank 0's "
                                        f"error)")
    if lock is not None:
        remove_debris(checkpoint_dir(run_dir))
    return lock


def consolidated_state_dict(ckpt_dir: str | Path, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 model weights of a checkpoint, whatever its ZeRO stage and rank count (phase hand-off, export,
    evaluation).

    ZeRO 1-3 keep the fp32 master weights in ``zero_pp_rank_*_optim_states.pt`` partitions, which DeepSpeed's own
    ``zero_to_fp32`` merges. Stage 0 writes no partitions: the module weights in ``mp_rank_00_model_states.pt`` are the
    full model (the fp32 weights when training in fp32; the half-precision copies, upcast, with fp16/bf16)."""
    tag_dir = Path(ckpt_dir) / tag
    if any(tag_dir.glob("zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with deepspeed_loads_weights_only(tag_dir):
            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    else:
        model_states = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
        if len(model_states) != 1:
            raise CheckpointError(f"{tag_dir}: expected one mp_rank_*_model_states.pt without ZeRO partitions, found "
                                  f"{[p.name for p in model_states]} (tensor/pipeline-parallel checkpoints are not "
                                  f"supported)")
        state = load_tensor_file(model_states[0])["module"]
    return {name: tensor.float() for name, tensor in state.items()}
