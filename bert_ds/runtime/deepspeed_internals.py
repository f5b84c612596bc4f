"""Every use of a private DeepSpeed attribute or function in bert_ds, in one module.

Written against DeepSpeed 0.19.x (checked on 0.19.8): ``runtime/zero/stage_1_and_2.py`` (``DeepSpeedZeroOptimizer``)
for the ZeRO 1/2 partition map that :class:`bert_ds.optim.ZeroAwareLamb` binds to, and for re-cutting elastic
checkpoints on resume. DeepSpeed has no public API for either, so an upgrade may move what is read here; the version
check refuses other releases before any compute, and ``tests/test_deepspeed_internals.py`` inspects the installed
classes for every name listed in the ``ZERO_*`` tables below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import torch

from bert_ds.checkpoint import deepspeed_loads_weights_only, load_tensor_file

__all__ = ["SUPPORTED_DEEPSPEED", "ZERO3_OPTIMIZER_ATTRIBUTES", "ZERO_CHECKPOINT_KEYS", "ZERO_OPTIMIZER_ATTRIBUTES",
           "ZERO_OPTIMIZER_METHODS", "ZeroGroupPartition", "ZeroPartitionMap", "check_deepspeed_version",
           "is_zero3_optimizer", "load_checkpoint", "load_optimizer_moments", "zero_partition_map"]

SUPPORTED_DEEPSPEED = ((0, 19), (0, 20))
"""Supported DeepSpeed releases: ``>= 0.19, < 0.20`` (the internals below are those of 0.19.x)."""

ZERO_OPTIMIZER_ATTRIBUTES = (
    "bit16_groups", "round_robin_bit16_groups", "round_robin_bit16_meta", "round_robin_bit16_offsets",
    "single_partition_of_fp32_groups", "partition_size", "parallel_partitioned_bit16_groups",
    "real_dp_process_group", "dp_process_group", "cpu_offload", "torch_autocast_gradscaler", "zenflow",
)
"""Instance attributes of ``DeepSpeedZeroOptimizer`` read here (set in its ``__init__``)."""

ZERO_OPTIMIZER_METHODS = {
    "_load_global_state": ("sd",),
    "_restore_from_elastic_fp32_weights": ("all_state_dict",),
    "_partition_base_optimizer_state": ("state_key", "all_partition_states", "group_id"),
    "update_lp_params": (),
}
"""Methods of ``DeepSpeedZeroOptimizer`` called on resume (the first three are private), with the leading parameters
they are called with, positionally and in this order."""

ZERO3_OPTIMIZER_ATTRIBUTES = ("fp32_partitioned_groups_flat",)
"""Instance attributes of ``DeepSpeedZeroOptimizer_Stage3`` that :func:`is_zero3_optimizer` looks for."""

ZERO_CHECKPOINT_KEYS = ("optimizer_state_dict", "base_optimizer_state")
"""Keys of DeepSpeed's ``zero_pp_rank_*_optim_states.pt`` files read on resume."""


def _supported_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_DEEPSPEED
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def check_deepspeed_version(version: str | None = None) -> str:
    """Return the installed DeepSpeed version, or raise ValueError naming it and the supported range."""
    if version is None:
        version = deepspeed.__version__
    match = re.match(r"(\d+)\.(\d+)", str(version))
    lo, hi = SUPPORTED_DEEPSPEED
    if match is None or not lo <= (int(match[1]), int(match[2])) < hi:
        raise ValueError(f"deepspeed {version} is installed, but bert_ds relies on DeepSpeed internals of "
                         f"deepspeed{_supported_range()} (bert_ds/runtime/deepspeed_internals.py); install a "
                         f"version in that range, e.g. pip install 'deepspeed{_supported_range()}'")
    return str(version)


# ---------------------------------------------------------------------------------------------- ZeRO 1/2 layout
@dataclass
class ZeroGroupPartition:
    """One ZeRO param group as this rank sees it."""

    flat: torch.Tensor
    """This rank's flat fp32 partition (the only param ZeRO leaves in the client optimizer's group)."""
    start: int
    """Offset of the partition in the group's flat buffer (``rank * partition_size``)."""
    tensors: list[tuple[int, int, int]]
    """Every tensor of the group as (global index, offset in the flat buffer, numel), in buffer order."""
    bit16_partition: torch.Tensor | None
    """ZeRO's bit16 view of this partition, all-gathered into the model after the step."""


@dataclass
class ZeroPartitionMap:
    groups: list[ZeroGroupPartition]
    shapes: list[tuple[int, ...]]
    """Shapes of all tensors by global index (the order of ``bit16_groups``)."""
    process_group: object
    world_size: int


def is_zero3_optimizer(optimizer) -> bool:
    return type(optimizer).__name__ == "DeepSpeedZeroOptimizer_Stage3" or any(
        hasattr(optimizer, a) for a in ZERO3_OPTIMIZER_ATTRIBUTES)


def zero_partition_map(zero_optimizer) -> ZeroPartitionMap:
    """Where each tensor of a ``DeepSpeedZeroOptimizer`` (stage 1/2) lies in this rank's flat partitions.

    ``stage_1_and_2.py`` lays tensors out in ``round_robin_bit16_groups`` order at ``round_robin_bit16_offsets``
    (alignment padding after each tensor), pads the flat group to a multiple of ``2 * world_size`` and cuts it into
    equal partitions of ``partition_size[i]``. Raises for setups whose layout differs (offload, autocast, ZenFlow,
    MoE expert groups); :class:`bert_ds.optim.UnsupportedZeroSetup` is a ValueError.
    """
    from bert_ds.optim.lamb import UnsupportedZeroSetup  # bert_ds.optim imports this module lazily

    zo = zero_optimizer
    missing = [a for a in ZERO_OPTIMIZER_ATTRIBUTES if not hasattr(zo, a)]
    if missing:
        raise TypeError(f"{type(zo).__name__} has no {missing}: only DeepSpeed's ZeRO stage 1/2 optimizer "
                        f"(DeepSpeedZeroOptimizer of deepspeed{_supported_range()}) is supported")
    if zo.cpu_offload:
        raise UnsupportedZeroSetup("ZeroAwareLamb under ZeRO offload_optimizer is not supported (untested); "
                                   "drop zero_optimization.offload_optimizer")
    if zo.torch_autocast_gradscaler is not None or zo.zenflow:
        raise UnsupportedZeroSetup("ZeroAwareLamb does not support torch_autocast or ZenFlow under ZeRO")
    world_size = dist.get_world_size(group=zo.dp_process_group)
    for i, pg in enumerate(zo.real_dp_process_group):
        if dist.get_world_size(group=pg) != world_size:
            raise UnsupportedZeroSetup(f"ZeroAwareLamb: param group {i} uses a different data-parallel group "
                                       "(MoE expert groups are not supported)")
    index_of, shapes = {}, []
    for group in zo.bit16_groups:
        for p in group:
            index_of[id(p)] = len(shapes)
            shapes.append(tuple(p.shape))
    groups = []
    for i, rr_tensors in enumerate(zo.round_robin_bit16_groups):
        rank = dist.get_rank(group=zo.real_dp_process_group[i])
        psize = int(zo.partition_size[i])
        flat = zo.single_partition_of_fp32_groups[i]
        if flat.numel() != psize:
            raise RuntimeError(f"ZeRO group {i}: fp32 partition has {flat.numel()} elements, expected {psize}")
        # shape metadata, not the params: it survives ZeRO releasing the params' storage
        numels = [int(m.numel()) for m in zo.round_robin_bit16_meta[i]]
        offsets = [int(o) for o in zo.round_robin_bit16_offsets[i]]
        tensors = sorted(((index_of[id(p)], off, n) for p, off, n in zip(rr_tensors, offsets, numels, strict=True)),
                         key=lambda t: t[1])
        groups.append(ZeroGroupPartition(flat=flat, start=rank * psize, tensors=tensors,
                                         bit16_partition=zo.parallel_partitioned_bit16_groups[i][rank]))
    return ZeroPartitionMap(groups=groups, shapes=shapes, process_group=zo.dp_process_group, world_size=world_size)


# ---------------------------------------------------------------------------------------------- resume
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
        with deepspeed_loads_weights_only(ckpt_dir / tag):
            load_path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {ckpt_dir / tag}")
        _apply_scheduler_lr(engine)
        return client
    if stage not in (1, 2):
        raise ValueError(f"checkpoint {tag!r}: resuming needs ZeRO stage 0, 1 or 2 (deepspeed.zero_stage is {stage})")
    with deepspeed_loads_weights_only(ckpt_dir / tag):
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
    NVIDIA's ``run_pretraining.py --phase2`` does (see :mod:`bert_ds.runtime.pretrain`)."""
    tag_dir = Path(ckpt_dir) / tag
    if engine.zero_optimization_stage() == 0:
        optimizer = engine.optimizer
        lrs = [group["lr"] for group in optimizer.param_groups]
        saved = load_tensor_file(tag_dir / "mp_rank_00_model_states.pt")
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
    state_key, base_key = ZERO_CHECKPOINT_KEYS
    saved = [load_tensor_file(f)[state_key] for f in files]
    if not isinstance(saved[0][base_key], list):
        raise ValueError(f"checkpoint {tag_dir.name!r} was not saved with zero_optimization.elastic_checkpoint; it can "
                         f"only be resumed on {saved_world_size} ranks")
    return saved


def _restore_zero_optimizer_state(zero, saved: list[dict]) -> None:
    """Merge each state tensor of the client optimizer (LAMB's ``exp_avg``/``exp_avg_sq``) from all saved partitions
    and cut this rank's partition out of it."""
    for i, group in enumerate(zero.optimizer.param_groups):
        flat = group["params"][0]
        parts = [sd[ZERO_CHECKPOINT_KEYS[1]][i] for sd in saved]
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
