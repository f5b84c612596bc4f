"""The one owner of the run directory: layout, atomic ``latest`` pointer, retention, run state, consolidation.

Everything else asks this module: the exporter (:mod:`bert_ds.export`) and evaluation (:mod:`bert_ds.evaluate`) read
checkpoints through :func:`open_checkpoint` and :func:`consolidated_state_dict`, never by globbing the files. Layout::

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
            rng_rank00000.pt ...         python / numpy / torch RNG states of each rank

ZeRO 1/2 run with ``elastic_checkpoint`` so the optimizer partitions are merged and re-cut by DeepSpeed when the
number of ranks changes between save and resume. Tags are ``phaseN-stepNNNNNN``; a tag is complete once its
``run_state.json`` exists (written last); ``<tag>.tmp`` (a save in progress) and ``.<tag>.old`` (the tag being replaced)
never parse as tags, so they are never listed, resumed or exported. deepspeed is imported only inside the functions
that need it, so reading a run directory (export, evaluation) does not import it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bert_ds.config import BertConfig
from bert_ds.data.tokenizer import META_NAME, load_tokenizer, read_lowercase

__all__ = ["CHECKPOINT_DIR", "RUN_STATE_NAME", "MODEL_CONFIG_NAME", "TOKENIZER_DIR_NAME", "CheckpointError",
           "CheckpointRef", "resolve_tag", "read_model_config", "tokenizer_dir", "open_checkpoint",
           "checkpoint_dir", "tag_for", "parse_tag", "list_tags", "read_latest",
           "read_run_state", "save_checkpoint", "prune_checkpoints", "save_rng_state", "load_rng_state",
           "write_run_metadata", "consolidated_state_dict"]

CHECKPOINT_DIR = "checkpoints"
RUN_STATE_NAME = "run_state.json"
MODEL_CONFIG_NAME = "model_config.json"
TOKENIZER_DIR_NAME = "tokenizer"
_TAG = re.compile(r"^phase(\d+)-step(\d+)$")
_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json")


class CheckpointError(ValueError):
    """A run directory that cannot be read as asked; the message names the path and what is missing."""


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


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, path)


def load_rng_state(path: Path) -> None:
    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(engine, run_dir: str | Path, tag: str, run_state: dict, keep_last_k: int) -> Path:
    """Save on every rank; ``latest`` moves to ``tag`` only after all ranks finished writing.

    DeepSpeed writes its files into a fresh ``<tag>.tmp`` directory with ``save_latest=False`` (a tag directory left
    by an earlier, possibly larger, run would otherwise keep its extra ``zero_pp_rank_*`` files and break
    consolidation); each rank adds its RNG state; after a barrier rank 0 writes ``run_state.json``, renames the
    directory to ``tag`` (replacing an older one) and then writes ``latest`` (temp file + rename), so a crash at any
    point leaves ``latest`` naming a complete checkpoint. Older tags beyond ``keep_last_k`` are pruned afterwards.
    """
    import deepspeed.comm as dist

    ckpt = checkpoint_dir(run_dir)
    rank = dist.get_rank()
    tmp_tag = f"{tag}.tmp"  # parse_tag ignores it, so a half-written one is never listed or resumed
    if rank == 0:
        shutil.rmtree(ckpt / tmp_tag, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(ckpt), tag=tmp_tag, client_state={"bert_ds": run_state}, save_latest=False)
    save_rng_state(ckpt / tmp_tag / f"rng_rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        _atomic_write(ckpt / tmp_tag / RUN_STATE_NAME, json.dumps(run_state, indent=1) + "\n")
        old = ckpt / f".{tag}.old"
        if (ckpt / tag).exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(ckpt / tag, old)
        os.replace(ckpt / tmp_tag, ckpt / tag)
        _atomic_write(ckpt / "latest", tag)
        shutil.rmtree(old, ignore_errors=True)
        prune_checkpoints(ckpt, keep_last_k)
    dist.barrier()
    return ckpt / tag


def prune_checkpoints(ckpt_dir: str | Path, keep_last_k: int) -> list[str]:
    """Delete all but the newest ``keep_last_k`` tags; never the one ``latest`` names. Returns the deleted tags."""
    tags = list_tags(ckpt_dir)
    latest = read_latest(ckpt_dir)
    keep = set(tags[-max(keep_last_k, 1):]) | {latest}
    deleted = [t for t in tags if t not in keep]
    for tag in deleted:
        shutil.rmtree(Path(ckpt_dir) / tag, ignore_errors=True)
    return deleted


def consolidated_state_dict(ckpt_dir: str | Path, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 model weights of a checkpoint, whatever its ZeRO stage and rank count (phase hand-off, export,
    evaluation).

    ZeRO 1-3 keep the fp32 master weights in ``zero_pp_rank_*_optim_states.pt`` partitions, which DeepSpeed's own
    ``zero_to_fp32`` merges. Stage 0 writes no partitions: the module weights in ``mp_rank_00_model_states.pt`` are the
    full model (the fp32 weights when training in fp32; the half-precision copies, upcast, with fp16/bf16)."""
    tag_dir = Path(ckpt_dir) / tag
    if any(tag_dir.glob("zero_pp_rank_*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    else:
        model_states = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
        if len(model_states) != 1:
            raise CheckpointError(f"{tag_dir}: expected one mp_rank_*_model_states.pt without ZeRO partitions, found "
                                  f"{[p.name for p in model_states]} (tensor/pipeline-parallel checkpoints are not "
                                  f"supported)")
        state = torch.load(model_states[0], map_location="cpu", weights_only=False)["module"]
    return {name: tensor.float() for name, tensor in state.items()}
