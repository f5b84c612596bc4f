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
from bert_ds.optim import ZeroAwareLamb, param_groups
from bert_ds.optim.lamb import layout_from_map
from tests.helpers import lamb_per_tensor

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


def one_rank_zero_optimizer(cls, scale: int, **kw) -> tuple[torch.optim.Optimizer, ZeroPartitionMap]:
    """``cls`` (ZeroAwareLamb, or the frozen PerTensorLamb) over the one-rank ZeRO partitions of BERT-large's tensors
    (dims / ``scale``), bound to their layout; step it with :func:`zero_step`."""
    groups = stage0_groups(scale)
    zmap = one_rank_zero_map(groups)
    flat = [{"params": [zg.flat], "weight_decay": g["weight_decay"]} for zg, g in zip(zmap.groups, groups, strict=True)]
    opt = cls(flat, lr=1e-3, **kw)
    layout = layout_from_map(zmap)
    if isinstance(opt, ZeroAwareLamb):
        opt.bind_layout(layout)
    else:  # the frozen copy's layout: the same runs, plus the padding mask it used
        opt._layout = lamb_per_tensor.ZeroLayout(
            groups=[lamb_per_tensor._GroupLayout(flat=g.flat, lengths=g.lengths, run_tensor=g.run_tensor,
                                                 run_index=g.run_index,
                                                 run_is_tensor=torch.tensor([t >= 0 for t in g.run_tensor]),
                                                 bit16_partition=g.bit16_partition) for g in layout.groups],
            n_tensors=layout.n_tensors, names=layout.names, split_tensors=layout.split_tensors,
            process_group=None, world_size=1)
    return opt, zmap
