"""Checkpoint layout, atomic ``latest`` pointer, retention, and the run state saved with every checkpoint.

Layout (the exporter in :mod:`bert_ds.export` reads exactly this)::

    RUN_DIR/recipe.json                  the resolved recipe of the run
    RUN_DIR/tensorboard/                 metrics
    RUN_DIR/checkpoints/                 DeepSpeed's save dir
        latest                           tag of the newest *complete* checkpoint (written last, atomically)
        model_config.json                BertConfig.save
        tokenizer/                       vocab.txt (+ tokenizer.json, tokenizer_meta.json when present)
        phase1-step000040/               one DeepSpeed tag: mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt
            run_state.json               recipe, phase, step, consumed samples, loader state, world size (readable
                                         without torch; the same dict is DeepSpeed's client state)
            rng_rank00000.pt ...         python / numpy / torch RNG states of each rank

ZeRO 1/2 run with ``elastic_checkpoint`` so the optimizer partitions are merged and re-cut by DeepSpeed when the
number of ranks changes between save and resume.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import deepspeed.comm as dist
import numpy as np
import torch

__all__ = ["CHECKPOINT_DIR", "RUN_STATE_NAME", "checkpoint_dir", "tag_for", "parse_tag", "list_tags", "read_latest",
           "read_run_state", "save_checkpoint", "prune_checkpoints", "save_rng_state", "load_rng_state",
           "write_run_metadata", "consolidated_state_dict", "load_checkpoint", "load_optimizer_moments"]

CHECKPOINT_DIR = "checkpoints"
RUN_STATE_NAME = "run_state.json"
_TAG = re.compile(r"^phase(\d+)-step(\d+)$")
_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_meta.json", "tokenizer_config.json")


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
    path = Path(ckpt_dir) / "latest"
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if not (Path(ckpt_dir) / tag / RUN_STATE_NAME).is_file():
        raise ValueError(f"{path} names tag {tag!r} but {Path(ckpt_dir) / tag / RUN_STATE_NAME} is missing")
    return tag


def read_run_state(ckpt_dir: str | Path, tag: str) -> dict:
    return json.loads((Path(ckpt_dir) / tag / RUN_STATE_NAME).read_text())


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_run_metadata(run_dir: str | Path, recipe, model_config, tokenizer_dir: str | Path | None) -> None:
    """Rank 0: recipe.json in the run dir; model_config.json and the tokenizer beside the checkpoint tags."""
    run_dir = Path(run_dir)
    ckpt = checkpoint_dir(run_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    _atomic_write(run_dir / "recipe.json", json.dumps(recipe.to_dict(), indent=2) + "\n")
    model_config.save(ckpt / "model_config.json")
    if tokenizer_dir is not None:
        out = ckpt / "tokenizer"
        out.mkdir(exist_ok=True)
        for name in _TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copyfile(src, out / name)


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


def load_checkpoint(engine, ckpt_dir: str | Path, tag: str, saved_world_size: int) -> dict:
    """Load ``tag`` into ``engine`` and return DeepSpeed's client state, on any number of ranks under ZeRO 1/2.

    DeepSpeed 0.19 cannot load its own elastic ZeRO checkpoints into a client optimizer without a ``step`` entry in
    its param groups (``_restore_step_from_elastic_checkpoint`` asserts; ZeroAwareLamb keeps the step in its state),
    and refuses a checkpoint from another data-parallel size outright, although the elastic format (flat per-rank
    partitions with the padding stripped) holds everything needed. So for ZeRO 1/2 DeepSpeed loads the module,
    scheduler and client state without optimizer state, and the fp32 master weights and every optimizer state tensor
    (LAMB's ``exp_avg``/``exp_avg_sq``) are merged from all saved partitions and re-cut for this rank with the ZeRO
    optimizer's own helpers. On the same rank count this reproduces each partition bit for bit.
    """
    ckpt_dir = Path(ckpt_dir)
    world_size = dist.get_world_size()
    stage = engine.zero_optimization_stage()
    if stage == 0:
        if saved_world_size != world_size:
            raise ValueError(f"checkpoint {tag!r} was written by {saved_world_size} ranks without ZeRO partitions "
                             f"of its own; resume it on {saved_world_size} ranks or use ZeRO stage 1/2")
        load_path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
        _apply_scheduler_lr(engine)
        return client
    if stage not in (1, 2):
        raise ValueError(f"checkpoint {tag!r}: resuming needs ZeRO stage 0, 1 or 2 (deepspeed.zero_stage is {stage})")
    load_path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=False)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    saved = _zero_partitions(ckpt_dir / tag, saved_world_size)
    zero = engine.optimizer
    zero._load_global_state(saved[0])  # loss scaler, clip setting
    zero._restore_from_elastic_fp32_weights(saved)
    _restore_zero_optimizer_state(zero, saved)
    zero.update_lp_params()  # bf16/fp16 model copies from the restored fp32 master (a plain copy in fp32)
    _apply_scheduler_lr(engine)
    return client


def load_optimizer_moments(engine, ckpt_dir: str | Path, tag: str, saved_world_size: int) -> None:
    """Phase hand-off: the optimizer state of ``tag`` (Adam/LAMB moments) with the step count reset to 0.

    The weights come with the model (``consolidated_state_dict``) and the schedule stays the new phase's; this is what
    NVIDIA's ``run_pretraining.py --phase2`` does (see :mod:`bert_ds.pretrain`)."""
    tag_dir = Path(ckpt_dir) / tag
    if engine.zero_optimization_stage() == 0:
        optimizer = engine.optimizer
        lrs = [group["lr"] for group in optimizer.param_groups]
        saved = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        optimizer.load_state_dict(saved["optimizer"])
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr  # the new phase's schedule, not the old phase's last lr
        states = optimizer.state.values()
    else:
        zero = engine.optimizer
        _restore_zero_optimizer_state(zero, _zero_partitions(tag_dir, saved_world_size))
        states = [zero.optimizer.state[group["params"][0]] for group in zero.optimizer.param_groups]
    for state in states:
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0


def _zero_partitions(tag_dir: Path, saved_world_size: int) -> list[dict]:
    """The ZeRO optimizer state dicts of every saved rank, in rank order."""
    files = sorted(tag_dir.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=lambda f: int(f.name.split("_")[3]))
    if len(files) != saved_world_size:
        raise ValueError(f"checkpoint {tag_dir.name!r}: {len(files)} ZeRO partition files for {saved_world_size} "
                         f"saved ranks")
    saved = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"] for f in files]
    if not isinstance(saved[0]["base_optimizer_state"], list):
        raise ValueError(f"checkpoint {tag_dir.name!r} was not saved with zero_optimization.elastic_checkpoint; it can "
                         f"only be resumed on {saved_world_size} ranks")
    return saved


def _restore_zero_optimizer_state(zero, saved: list[dict]) -> None:
    """Merge each state tensor of the client optimizer (LAMB's ``exp_avg``/``exp_avg_sq``) from all saved partitions
    and cut this rank's partition out of it."""
    for i, group in enumerate(zero.optimizer.param_groups):
        flat = group["params"][0]
        parts = [sd["base_optimizer_state"][i] for sd in saved]
        for key, first in parts[0].items():
            if torch.is_tensor(first) and first.dim() > 0:
                merged = zero._partition_base_optimizer_state(key, [part[key] for part in parts], i)
                zero.optimizer.state[flat][key] = merged.to(device=flat.device, dtype=torch.float32).clone()
            else:  # scalars such as LAMB's step count are the same on every rank
                zero.optimizer.state[flat][key] = first.clone() if torch.is_tensor(first) else first


def _apply_scheduler_lr(engine) -> None:
    """``LambdaLR.load_state_dict`` restores the step count but leaves the optimizer's lr at the fresh schedule's first
    value until the next ``scheduler.step()``; the first resumed step must use the saved next lr."""
    scheduler = engine.lr_scheduler
    if scheduler is not None:
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr


def consolidated_state_dict(ckpt_dir: str | Path, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 model weights of a checkpoint, whatever its ZeRO stage and rank count (phase hand-off)."""
    tag_dir = Path(ckpt_dir) / tag
    if any(tag_dir.glob("*optim_states.pt")) and any(tag_dir.glob("zero_pp_rank_*")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    states = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {k: v.float() for k, v in states["module"].items()}
