"""BERT-large's trainable tensors for one optimizer step in-process (from
``bert_ds.devtools.benchmarks.optimizer_step``), scaled down, and the same one-rank ZeRO layout for the frozen
per-tensor LAMB (tests/helpers/lamb_per_tensor.py), so both optimizers step the same partitions. Not a test module.
"""

from __future__ import annotations

import torch

from bert_ds.deepspeed_internals import ZeroPartitionMap
from bert_ds.devtools.benchmarks.optimizer_step import bert_groups, flat_groups, one_rank_zero_map, zero_lamb
from bert_ds.optim import ZeroAwareLamb
from bert_ds.optim.lamb import layout_from_map
from tests.helpers import lamb_per_tensor

__all__ = ["large_groups", "one_rank_zero_optimizer"]


def large_groups(scale: int, seed: int = 0) -> list[dict]:
    """BERT-large's two param groups, every dimension divided by ``scale``, random gradients."""
    return bert_groups("large", scale, seed)


def one_rank_zero_optimizer(cls, scale: int, **kw) -> tuple[torch.optim.Optimizer, ZeroPartitionMap]:
    """``cls`` (ZeroAwareLamb, or the frozen PerTensorLamb) over the one-rank ZeRO partitions of BERT-large's tensors
    (dims / ``scale``), bound to their layout; step it with ``optimizer_step.zero_step``."""
    groups = large_groups(scale)
    if cls is ZeroAwareLamb:
        return zero_lamb(groups, **kw)
    zmap = one_rank_zero_map(groups)
    opt = cls(flat_groups(zmap, groups), lr=1e-3, **kw)
    layout = layout_from_map(zmap)  # the same runs, plus the padding mask the frozen copy used
    opt._layout = lamb_per_tensor.ZeroLayout(
        groups=[lamb_per_tensor._GroupLayout(flat=g.flat, lengths=g.lengths, run_tensor=g.run_tensor,
                                             run_index=g.run_index,
                                             run_is_tensor=torch.tensor([t >= 0 for t in g.run_tensor]),
                                             bit16_partition=g.bit16_partition) for g in layout.groups],
        n_tensors=layout.n_tensors, names=layout.names, split_tensors=layout.split_tensors, process_group=None,
        world_size=1)
    return opt, zmap
