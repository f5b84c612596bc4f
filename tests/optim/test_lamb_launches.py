"""Launch budget of one ZeroAwareLamb step over BERT-large's 398 tensors, counted on the CPU
(bert_ds.devtools.launch_count) beside torch's AdamW(foreach=True) on the same tensors: at stage 0 and on the
flat-partition (ZeRO 1/2) path, one rank, in-process.

The optimizer does not branch on the device, so the ops counted are the CUDA path's. The count depends on the number
of param groups and of distinct step counts, not on tensor sizes: the test counts at two scalings of BERT-large's
shapes and requires the same number, so small tensors stand for the real ones. The per-tensor optimizer it replaced
(tests/helpers/lamb_per_tensor.py) is counted too and must fail the budget, so the budget can fail.
"""

from __future__ import annotations

import pytest
import torch

from bert_ds.devtools.benchmarks.optimizer_step import flat_groups, one_rank_zero_map, zero_step
from bert_ds.devtools.launch_count import count_launches, foreach_fast_route
from bert_ds.optim import ZeroAwareLamb
from tests.helpers import lamb_per_tensor
from tests.helpers.bert_large_step import large_groups, one_rank_zero_optimizer

STAGE0_BUDGET = 30
"""Launches of one stage-0 step (measured 26: 9-10 per param group for the moments and update directions, one norm
op, a stack and a host copy, a multiply and an add per group)."""
ZERO_BUDGET = 34
"""Launches of one ZeRO 1/2 step on one rank, ZeRO's two bit16 copies included (measured 32: the stage-0 ops, plus
the per-tensor sums of squares (square, zeros, index_add) and the re-copy of the first group's bit16 partition; an
all-reduce more on several ranks)."""
SCALES = (64, 16)
"""Every dimension of BERT-large divided by these (at least 1); at 64 the no-decay group's partition ends in padding,
at 16 it does not: the counts must agree."""

CASES = {"all": dict(trust_ratio="all"), "decay_only": dict(trust_ratio="decay_only"),
         "clamped": dict(trust_ratio="all", min_trust=0.01, max_trust=0.3)}


def steady_launches(optimizer, step) -> int:
    """Launches of the second step (the first creates the moments)."""
    step(optimizer)
    with count_launches() as count:
        step(optimizer)
    return count.total


def stage0(optimizer) -> int:
    return steady_launches(optimizer, lambda o: o.step())


def zero(cls, scale: int, **kw) -> int:
    opt, zmap = one_rank_zero_optimizer(cls, scale, **kw)
    return steady_launches(opt, lambda o: zero_step(o, zmap))


def adamw(scale: int, zero_path: bool = False) -> int:
    groups = large_groups(scale)
    if not zero_path:
        return stage0(torch.optim.AdamW(groups, lr=1e-3, foreach=True))
    zmap = one_rank_zero_map(groups)
    opt = torch.optim.AdamW(flat_groups(zmap, groups), lr=1e-3, foreach=True)
    return steady_launches(opt, lambda o: zero_step(o, zmap))


def test_bert_large_has_398_tensors():
    assert sum(len(g["params"]) for g in large_groups(64)) == 398


@pytest.mark.parametrize("case", sorted(CASES))
def test_stage0_step_launches(case):
    lamb = {s: stage0(ZeroAwareLamb(large_groups(s), lr=1e-3, **CASES[case])) for s in SCALES}
    reference = adamw(SCALES[0])
    assert len(set(lamb.values())) == 1, f"the count depends on tensor sizes: {lamb}"
    assert lamb[SCALES[0]] <= STAGE0_BUDGET
    assert lamb[SCALES[0]] <= 2 * reference, (lamb, reference)


@pytest.mark.parametrize("case", sorted(CASES))
def test_zero_step_launches(case):
    """Against AdamW on the 398 tensors and against AdamW stepping the same flat partitions under the same ZeRO step."""
    lamb = {s: zero(ZeroAwareLamb, s, **CASES[case]) for s in SCALES}
    reference = {"tensors": adamw(SCALES[0]), "partitions": adamw(SCALES[0], zero_path=True)}
    assert len(set(lamb.values())) == 1, f"the count depends on tensor sizes: {lamb}"
    assert lamb[SCALES[0]] <= ZERO_BUDGET
    assert lamb[SCALES[0]] <= 2 * min(reference.values()), (lamb, reference)


def test_per_tensor_lamb_fails_the_budget():
    """The optimizer this replaced: one op per tensor per line of the math (thousands of launches at stage 0; on
    the ZeRO path a float64 norm per run on the CPU and a per-run multiply on CUDA's slow route)."""
    per_tensor = (stage0(lamb_per_tensor.PerTensorLamb(large_groups(64), lr=1e-3)),
                  zero(lamb_per_tensor.PerTensorLamb, 64))
    assert per_tensor[0] > 20 * STAGE0_BUDGET and per_tensor[1] > 10 * ZERO_BUDGET, per_tensor


def test_counter_follows_cuda_foreach_routes():
    """Views, allocations and read-backs launch nothing; a foreach op over tensor lists CUDA cannot run as
    multi-tensor kernels (0-dim scale tensors beside full ones, a transposed tensor) counts once per tensor."""
    flat = torch.randn(10)
    views = list(torch.split(flat, [3, 3, 4]))
    scales = torch.tensor([2.0, 3.0, 4.0])
    assert foreach_fast_route([views]) and foreach_fast_route([views, views])
    assert not foreach_fast_route([views, list(scales.unbind())])
    assert not foreach_fast_route([[torch.randn(2, 3)], [torch.randn(3, 2).t()]])
    with count_launches() as count:
        torch._foreach_mul_(views, list(scales.unbind()))
    assert count.total == 3
    with count_launches() as count:
        torch._foreach_mul_(views, scales.tolist())
        flat.view(2, 5).t()
        torch.empty(3)
        flat[0].item()
    assert count.total == 1 and count.reads == 1
