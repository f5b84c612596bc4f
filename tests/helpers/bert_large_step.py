"""BERT-large's trainable tensors for one optimizer step, in-process: at stage 0 (the tensors in the engine's two
param groups) and as ZeRO 1/2 lays them out on one rank (one flat fp32 partition per group, padded as DeepSpeed
pads, stepped once per group the way ``DeepSpeedZeroOptimizer._optimizer_step`` narrows ``param_groups``).

The shapes come from ``BertForPreTraining(model_preset("large"))`` built on the meta device (no memory), grouped
by ``bert_ds.optim.param_groups``; every dimension is divided by ``scale`` (at least 1) so a step is cheap. Not a
test module.
"""

from __future__ import annotations

import math

import torch

from bert_ds.config import model_preset
from bert_ds.deepspeed_internals import ZeroGroupPartition, ZeroPartitionMap
from bert_ds.model import BertForPreTraining
from bert_ds.optim import param_groups

WEIGHT_DECAY = 0.01


def large_shapes() -> list[tuple[float, list[tuple[int, ...]]]]:
    """(weight decay, shapes) of each param group of BERT-large, in the engine's order."""
    with torch.device("meta"):
        model = BertForPreTraining(model_preset("large"))
    return [(g["weight_decay"], [tuple(p.shape) for p in g["params"]]) for g in param_groups(model, WEIGHT_DECAY)]


def stage0_groups(scale: int, seed: int = 0) -> list[dict]:
    """Param groups of BERT-large's tensors (dims divided by ``scale``), each with a random gradient."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for wd, shapes in large_shapes():
        params = []
        for shape in shapes:
            p = torch.nn.Parameter(0.02 * torch.randn([max(1, d // scale) for d in shape], generator=gen))
            p.grad = 1e-3 * torch.randn(p.shape, generator=gen)
            params.append(p)
        groups.append({"params": params, "weight_decay": wd})
    return groups


def one_rank_zero_map(groups: list[dict]) -> ZeroPartitionMap:
    """The partition map DeepSpeed's ZeRO 1/2 builds on one rank for ``groups``: each group's tensors flattened into
    one buffer in order, padded to a multiple of 2 (``2 * world_size``); the flat buffer is the fp32 partition,
    with the gradients flattened the same way, and a separate buffer stands in for the model's bit16 partition."""
    zgroups, shapes, index = [], [], 0
    for group in groups:
        params = group["params"]
        numel = sum(p.numel() for p in params)
        padded = math.ceil(numel / 2) * 2
        flat = torch.nn.Parameter(torch.zeros(padded))
        flat.grad = torch.zeros(padded)
        tensors, offset = [], 0
        for p in params:
            flat.data[offset:offset + p.numel()] = p.detach().flatten()
            flat.grad[offset:offset + p.numel()] = p.grad.flatten()
            tensors.append((index, offset, p.numel()))
            shapes.append(tuple(p.shape))
            offset += p.numel()
            index += 1
        zgroups.append(ZeroGroupPartition(flat=flat, start=0, tensors=tensors, bit16_partition=flat.detach().clone()))
    return ZeroPartitionMap(groups=zgroups, shapes=shapes, process_group=None, world_size=1)


def zero_step(optimizer: torch.optim.Optimizer) -> None:
    """One ZeRO 1/2 optimizer step: ``step()`` once per param group with ``param_groups`` narrowed to that group."""
    groups = optimizer.param_groups
    try:
        for group in groups:
            optimizer.param_groups = [group]
            optimizer.step()
    finally:
        optimizer.param_groups = groups
