"""One optimizer step over BERT's trainable tensors, in one process: its launches (counted on the CPU with
:func:`bert_ds.devtools.launch_count.count_launches`) and its CPU time, at stage 0 and on ZeRO 1/2's flat-partition
path, beside torch's ``AdamW(foreach=True)`` on the same tensors (``tools/bench_lamb.py launches``).

The tensors have the shapes of ``BertForPreTraining`` at a preset (built on the meta device, grouped by
``bert_ds.optim.param_groups``), every dimension divided by ``scale``; the ZeRO path is one rank's layout built as
``stage_1_and_2.py`` builds it on one rank (each group flattened in order, padded to a multiple of 2), stepped as
``DeepSpeedZeroOptimizer`` steps it, its per-group bit16 copies included (any optimizer under ZeRO pays those two).
Tests use the same pieces (``tests/optim/test_lamb_launches.py``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from bert_ds.config import model_preset
from bert_ds.deepspeed_internals import ZeroGroupPartition, ZeroPartitionMap
from bert_ds.devtools.launch_count import count_launches
from bert_ds.model import BertForPreTraining
from bert_ds.optim import ZeroAwareLamb, param_groups
from bert_ds.optim.lamb import layout_from_map

__all__ = ["bert_groups", "measure_step", "one_rank_zero_map", "zero_lamb", "zero_step"]

WEIGHT_DECAY = 0.01


def bert_groups(preset: str = "large", scale: int = 1, seed: int = 0) -> list[dict]:
    """The engine's two param groups of BERT at ``preset`` (dims divided by ``scale``), each tensor with a random
    gradient."""
    with torch.device("meta"):
        model = BertForPreTraining(model_preset(preset))
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for group in param_groups(model, WEIGHT_DECAY):
        params = []
        for meta in group["params"]:
            p = torch.nn.Parameter(0.02 * torch.randn([max(1, d // scale) for d in meta.shape], generator=gen))
            p.grad = 1e-3 * torch.randn(p.shape, generator=gen)
            params.append(p)
        groups.append({"params": params, "weight_decay": group["weight_decay"]})
    return groups


def one_rank_zero_map(groups: list[dict]) -> ZeroPartitionMap:
    """ZeRO 1/2's partition map on one rank: each group's tensors (and gradients) flattened into one fp32 partition,
    padded to a multiple of 2 (``2 * world_size``), with a separate buffer as the model's bit16 partition."""
    zgroups, shapes = [], []
    for group in groups:
        params = group["params"]
        flat = torch.nn.Parameter(torch.zeros(math.ceil(sum(p.numel() for p in params) / 2) * 2))
        flat.grad = torch.zeros_like(flat)
        tensors, offset = [], 0
        for p in params:
            flat.data[offset:offset + p.numel()] = p.detach().flatten()
            flat.grad[offset:offset + p.numel()] = p.grad.flatten()
            tensors.append((len(shapes), offset, p.numel()))
            shapes.append(tuple(p.shape))
            offset += p.numel()
        zgroups.append(ZeroGroupPartition(flat=flat, start=0, tensors=tensors, bit16_partition=flat.detach().clone()))
    return ZeroPartitionMap(groups=zgroups, shapes=shapes, process_group=None, world_size=1)


def flat_groups(zmap: ZeroPartitionMap, groups: list[dict]) -> list[dict]:
    """The client optimizer's param groups under ZeRO: one flat partition each, the groups' settings kept."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [zg.flat]}
            for zg, g in zip(zmap.groups, groups, strict=True)]


def zero_lamb(groups: list[dict], **lamb_kw) -> tuple[ZeroAwareLamb, ZeroPartitionMap]:
    """ZeroAwareLamb over the one-rank ZeRO partitions of ``groups``, bound to their layout."""
    zmap = one_rank_zero_map(groups)
    opt = ZeroAwareLamb(flat_groups(zmap, groups), lr=1e-3, **lamb_kw)
    opt.bind_layout(layout_from_map(zmap))
    return opt, zmap


def zero_step(optimizer: torch.optim.Optimizer, zmap: ZeroPartitionMap) -> None:
    """One ZeRO 1/2 optimizer step as ``DeepSpeedZeroOptimizer.step`` makes it: per param group, ``step()`` with
    ``param_groups`` narrowed to that group, then the group's fp32 partition copied to its bit16 partition."""
    groups = optimizer.param_groups
    try:
        for group, zg in zip(groups, zmap.groups, strict=True):
            optimizer.param_groups = [group]
            optimizer.step()
            zg.bit16_partition.copy_(zg.flat.detach())
    finally:
        optimizer.param_groups = groups


def measure_step(optimizer: torch.optim.Optimizer, step: Callable[[torch.optim.Optimizer], None],
                 repeats: int = 3) -> dict:
    """Launches (and every non-view op, and ``.item()`` reads) of one steady-state step, and the median CPU time of
    ``repeats`` more; the first step, which creates the optimizer state, is not measured."""
    step(optimizer)
    with count_launches() as count:
        step(optimizer)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(optimizer)
        times.append(time.perf_counter() - start)
    return {"launches": count.total, "ops": count.ops, "reads": count.reads, "ms": 1e3 * statistics.median(times)}
