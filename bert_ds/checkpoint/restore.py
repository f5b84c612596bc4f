"""Restoring a run: a mid-phase resume, a phase hand-off, and full fp32 weights for export and evaluation.

This module reads a tag once (its ``run_state.json``, its DeepSpeed files through :mod:`bert_ds.safe_load`, each
rank's RNG file) and hands the trainer what it needs. DeepSpeed 0.19 cannot load its own elastic ZeRO checkpoints into
a client optimizer without a ``step`` entry in its param groups (``_restore_step_from_elastic_checkpoint`` asserts;
ZeroAwareLamb keeps the step in its state), and refuses a checkpoint from another data-parallel size outright,
although the elastic format (flat per-rank partitions with the padding stripped) holds everything needed. So under
ZeRO 1/2 DeepSpeed loads the module, scheduler and client state without optimizer state, and the saved partitions
are re-cut for this rank by :func:`bert_ds.deepspeed_internals.recut_zero_partitions`, the one step that
needs DeepSpeed's private helpers. On the same rank count this reproduces each partition bit for bit.
deepspeed is imported only inside the functions that need it, so reading weights (export, evaluation) does not.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bert_ds.checkpoint.layout import RunState, read_run_state, rng_file
from bert_ds.deepspeed_internals import MODEL_STATES_NAME, ZERO_PARTITION_FILE
from bert_ds.errors import BadInput
from bert_ds.optim.schedule import keep_group_lrs, sync_groups_to_schedule
from bert_ds.safe_load import CheckpointError, deepspeed_loads_weights_only, load_tensor_file

__all__ = ["Handoff", "RestoredRun", "consolidated_state_dict", "load_rng_state", "open_handoff", "restore_run",
           "zero_partition_files"]

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class RestoredRun:
    """What a mid-phase resume hands back to the trainer."""

    run_state: RunState
    """The tag's run state: recipe, phase, step, consumed samples, loader state, world size."""
    rng_restored: bool
    """This rank's random generators were restored (same rank count); otherwise the caller seeds them afresh."""


def restore_run(engine, ckpt_dir: str | Path, tag: str, rank: int) -> RestoredRun:
    """Mid-phase resume of ``tag`` into ``engine``: module weights, optimizer state (re-cut for this rank count under
    ZeRO 1/2), scheduler, and this rank's random generators when the rank count is unchanged (per-rank streams
    cannot carry over to another count; dropout does not need them, see ``bert_ds.runtime.trainer.DropoutKey``)."""
    import deepspeed.comm as dist

    ckpt_dir = Path(ckpt_dir)
    state = read_run_state(ckpt_dir, tag)
    saved_world = state.world_size
    _load_engine(engine, ckpt_dir, tag, saved_world, dist.get_world_size())
    rng = rng_file(ckpt_dir / tag, rank)
    same = saved_world == dist.get_world_size() and rng.is_file()
    if same:
        load_rng_state(rng)
    return RestoredRun(run_state=state, rng_restored=same)


def _load_engine(engine, ckpt_dir: Path, tag: str, saved_world: int, world: int) -> None:
    stage = engine.zero_optimization_stage()
    if stage == 0 and saved_world != world:
        raise BadInput(f"checkpoint {tag!r} was written by {saved_world} ranks without ZeRO partitions of its own; "
                       f"resume it on {saved_world} ranks or use ZeRO stage 1/2")
    if stage not in (0, 1, 2):
        raise BadInput(f"checkpoint {tag!r}: resuming needs ZeRO stage 0, 1 or 2 (deepspeed.zero_stage is {stage})")
    with deepspeed_loads_weights_only(ckpt_dir / tag):
        load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=stage == 0)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
    if stage in (1, 2):
        from bert_ds.deepspeed_internals import recut_zero_partitions

        recut_zero_partitions(engine.optimizer, _zero_partitions(ckpt_dir / tag, saved_world), weights=True)
    if engine.lr_scheduler is not None:
        sync_groups_to_schedule(engine.lr_scheduler)


@dataclass(frozen=True)
class Handoff:
    """A phase starting from the previous phase's final checkpoint: its weights (before the engine is built), then
    its optimizer moments (after), with the step count reset to 0 (the recipe's ``handoff.optimizer_step``
    ``reset``: what NVIDIA's ``run_pretraining.py --phase2`` does, see :mod:`bert_ds.runtime.pretrain`) or continued
    (``continue``: one optimizer over both phases). The schedule is the new phase's either way."""

    ckpt_dir: Path
    tag: str
    run_state: RunState

    def weights(self) -> dict[str, torch.Tensor]:
        return consolidated_state_dict(self.ckpt_dir, self.tag)

    def load_moments(self, engine, optimizer_step: str = "reset") -> None:
        """The optimizer state of the tag (Adam/LAMB moments), re-cut for this rank count; ``optimizer_step``
        ``reset`` sets its ``step`` to 0 (bias correction starts again over the carried moments), ``continue``
        keeps the count the tag saved (:class:`bert_ds.recipe.HandoffConfig`)."""
        if optimizer_step not in ("reset", "continue"):
            raise ValueError(f"load_moments: optimizer_step must be 'reset' or 'continue', got {optimizer_step!r}")
        tag_dir = self.ckpt_dir / self.tag
        if engine.zero_optimization_stage() == 0:
            optimizer = engine.optimizer
            with keep_group_lrs(optimizer):  # the new phase's schedule, not the old phase's last lr
                optimizer.load_state_dict(load_tensor_file(tag_dir / MODEL_STATES_NAME)["optimizer"])
            states = list(optimizer.state.values())
        else:
            from bert_ds.deepspeed_internals import recut_zero_partitions

            saved = _zero_partitions(tag_dir, self.run_state.world_size)
            client = recut_zero_partitions(engine.optimizer, saved, weights=False)
            states = [client.state[group["params"][0]] for group in client.param_groups]
        if optimizer_step == "continue":
            return
        for state in states:
            if "step" in state:
                state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0


def open_handoff(ckpt_dir: str | Path, tag: str, phase_index: int) -> Handoff:
    """The hand-off into phase ``phase_index`` from ``tag``, refused unless the tag ended the previous phase."""
    state = read_run_state(ckpt_dir, tag)
    if not state.phase_done:
        raise BadInput(f"phase {phase_index + 1} cannot start from {tag!r}: its run_state.json has phase_done "
                       f"false (phase {phase_index} did not finish there)")
    return Handoff(ckpt_dir=Path(ckpt_dir), tag=tag, run_state=state)


def _zero_partitions(tag_dir: Path, saved_world_size: int) -> list[dict]:
    """The ZeRO optimizer files of every saved rank, loaded, in rank order; refused unless they are elastic."""
    from bert_ds.deepspeed_internals import is_elastic_zero_state

    files = zero_partition_files(tag_dir)
    if len(files) != saved_world_size:
        raise BadInput(f"checkpoint {tag_dir.name!r}: {len(files)} ZeRO partition files for {saved_world_size} "
                       f"saved ranks")
    saved = [load_tensor_file(f) for f in files]
    if not is_elastic_zero_state(saved[0]):
        raise BadInput(f"checkpoint {tag_dir.name!r} was not saved with zero_optimization.elastic_checkpoint; it can "
                       f"only be resumed on {saved_world_size} ranks")
    return saved


def zero_partition_files(tag_dir: str | Path) -> list[Path]:
    """The ZeRO 1/2 optimizer partition files of a tag (fp32/fp16 or bf16 naming), in saved-rank order."""
    found = [(int(m.group(1)), f) for f in Path(tag_dir).iterdir() if (m := ZERO_PARTITION_FILE.match(f.name))]
    return [f for _, f in sorted(found)]


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


def consolidated_state_dict(ckpt_dir: str | Path, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 model weights of a checkpoint, whatever its ZeRO stage and rank count (phase hand-off, export,
    evaluation).

    ZeRO 1-3 keep the fp32 master weights in ``[bf16_]zero_pp_rank_*_optim_states.pt`` partitions, which DeepSpeed's own
    ``zero_to_fp32`` merges. Stage 0 writes no partitions: the module weights in ``mp_rank_00_model_states.pt`` are the
    full model (the fp32 weights when training in fp32; the half-precision copies, upcast, with fp16/bf16)."""
    tag_dir = Path(ckpt_dir) / tag
    if zero_partition_files(tag_dir):
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
