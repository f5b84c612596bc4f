"""One rank of the bf16 gradient-sum runs (``tests/optim/test_grad_accum_bf16.py``): ``python -m
tests.helpers.grad_accum_worker`` on each of N CPU ranks (gloo), started by :func:`launch`.

A job ``<fp32|bf16>-z<1|2>[-overlap|-bf16comm]`` builds the engine the way ``bert_ds.runtime.engine.build_engine``
does (``deepspeed_config`` from a bf16 tiny_cpu recipe with ``deepspeed.grad_accum_dtype`` set, then
``initialize_deepspeed``; ``bf16comm`` drops the config's ``communication_data_type``, so ranks reduce in DeepSpeed's
default bf16) around the lamb tests' TinyNet, whose odd shapes make ZeRO cut tensors at rank boundaries,
and runs one optimizer step of ``GAS`` micro batches without gradient clipping. Beside the engine, a bf16 copy of the
model takes the same micro batches (its loss must equal the engine's bit for bit, so its gradients are the ones the
engine produced) and sums their gradients in float64.

Each rank saves ``<out>/<job>/rank<r>.pt``: ``wrapper`` (DeepSpeed's optimizer wrapper class), ``grad_accum_dtype``
and ``comm_dtype`` (what the ZeRO optimizer was built with), ``bound`` (ZeroAwareLamb bound to the ZeRO layout),
``loss_mismatches`` (micro batches whose engine loss differs from the copy's), ``seen`` (tensor name -> (offset,
float64 slice) of the gradient ZeroAwareLamb received at the step, this rank's part of it), ``sum``/``abs_sum``
(tensor name -> float64 sum over this rank's micro batches of the bf16 gradient and of its absolute value), ``w0``
and ``w1`` (the full fp32 master weights before and after the step, float64), ``decay`` (tensor name -> weight decay).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from tests.helpers.lamb_harness import SEQ, VOCAB, make_model
from tests.helpers.ranks import run_module_ranks

GAS = 64
"""Micro batches summed per optimizer step (the issue's 64)."""
MICRO = 4
LR = 1e-2
TINY_CPU = Path(__file__).resolve().parents[2] / "ds_configs" / "tiny_cpu.json"


def parse_job(job: str) -> tuple[str, int, bool, bool]:
    """``<fp32|bf16>-z<1|2>[-overlap|-bf16comm]`` -> (grad_accum_dtype, ZeRO stage, overlap_comm, bf16 reduction)."""
    dtype, stage, *flags = job.split("-")
    if dtype not in ("fp32", "bf16") or stage not in ("z1", "z2") or flags not in ([], ["overlap"], ["bf16comm"]):
        raise ValueError(f"job {job!r}: expected <fp32|bf16>-z<1|2>[-overlap|-bf16comm]")
    return dtype, int(stage[1:]), flags == ["overlap"], flags == ["bf16comm"]


def job_recipe(job: str, world_size: int):
    """tiny_cpu in bf16 with the job's grad_accum_dtype, stage and overlap_comm, no clipping, and one phase of
    ``GAS`` micro batches of ``MICRO`` per rank and step."""
    from bert_ds.recipe import Recipe

    dtype, stage, overlap, _ = parse_job(job)
    data = json.loads(TINY_CPU.read_text())
    data["deepspeed"] = {**data["deepspeed"], "precision": "bf16", "zero_stage": stage, "grad_accum_dtype": dtype,
                         "gradient_clipping": 0.0, "overlap_comm": overlap}
    data["phases"] = [{**data["phases"][0], "micro_batch_size": MICRO, "global_batch_size": MICRO * GAS * world_size,
                       "lr": LR}]
    return Recipe.from_dict(data, source=f"{TINY_CPU} ({job})")


def micro_batch(rank: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + m)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g), torch.randint(0, 3, (MICRO,), generator=g)


def run_job(job: str, out: Path) -> None:
    from deepspeed.utils import safe_get_full_fp32_param

    from bert_ds.deepspeed_internals import zero_partition_map, zero_setup
    from bert_ds.optim import build_optimizer
    from bert_ds.runtime.engine import deepspeed_config, initialize_deepspeed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    recipe = job_recipe(job, world)
    phase = recipe.phases[0]
    model = make_model()
    twin = copy.deepcopy(model).to(torch.bfloat16)
    optimizer = build_optimizer("lamb", model, phase.lr, weight_decay=recipe.optimizer.weight_decay,
                                zero_stage=recipe.deepspeed.zero_stage)
    ds_config = deepspeed_config(recipe, phase, world, "bf16")
    if parse_job(job)[3]:
        del ds_config["communication_data_type"]
    engine = initialize_deepspeed(model, optimizer, ds_config)
    assert engine.gradient_accumulation_steps() == GAS
    zero = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    ordered = [names[id(p)] for group in zero.bit16_groups for p in group]  # the map's global tensor order
    decay = {names[id(p)]: group["weight_decay"]  # ZeRO keeps the client's param groups in order
             for group, bit16 in zip(optimizer.param_groups, zero.bit16_groups, strict=True) for p in bit16}
    w0 = {n: safe_get_full_fp32_param(p).double() for n, p in engine.module.named_parameters()}

    seen: dict[int, torch.Tensor] = {}

    def keep_gradient(opt, args, kwargs):  # ZeRO steps one param group (one flat partition) per call
        for group in opt.param_groups:
            flat = group["params"][0]
            seen[id(flat)] = flat.grad.detach().double().clone()

    optimizer.register_step_pre_hook(keep_gradient)
    sums = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in twin.named_parameters()}
    abs_sums = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in twin.named_parameters()}
    loss_mismatches = 0
    for m in range(GAS):
        ids, labels = micro_batch(rank, m)
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        twin.zero_grad()
        twin_loss = twin(ids, labels)
        (twin_loss / GAS).backward()  # DeepSpeed scales each micro batch's loss by 1/GAS (exact: a power of 2)
        loss_mismatches += int(not torch.equal(loss.detach(), twin_loss.detach()))
        for n, p in twin.named_parameters():
            sums[n] += p.grad.double()
            abs_sums[n] += p.grad.double().abs()

    slices = {}
    for group in zero_partition_map(zero).groups:
        grad, start, end = seen[id(group.flat)], group.start, group.start + group.flat.numel()
        for index, offset, numel in group.tensors:
            lo, hi = max(offset, start), min(offset + numel, end)
            if lo < hi:
                slices[ordered[index]] = (lo - offset, grad[lo - start:hi - start])
    setup = zero_setup(zero)
    record = {"wrapper": type(zero).__name__, "grad_accum_dtype": str(setup.grad_accum_dtype),
              "comm_dtype": str(setup.comm_dtype), "bound": optimizer.zero_layout is not None,
              "loss_mismatches": loss_mismatches, "seen": slices, "sum": sums, "abs_sum": abs_sums, "w0": w0,
              "w1": {n: safe_get_full_fp32_param(p).double() for n, p in engine.module.named_parameters()},
              "decay": decay}
    d = out / job
    d.mkdir(parents=True, exist_ok=True)
    torch.save(record, d / f"rank{rank}.pt")
    engine.destroy()


def launch(world_size: int, out_dir: Path, jobs: list[str]) -> dict[str, list[dict]]:
    """Run ``jobs`` on ``world_size`` CPU ranks; ``{job: [rank records]}`` (see the module docstring)."""
    for job in jobs:
        parse_job(job)
    run_module_ranks(world_size, out_dir, "tests.helpers.grad_accum_worker", [f"--out={out_dir}",
                                                                               f"--jobs={','.join(jobs)}"])
    return {job: [torch.load(out_dir / job / f"rank{r}.pt") for r in range(world_size)] for job in jobs}


def _main() -> None:
    import argparse

    from bert_ds.runtime.distributed import join_gloo_group

    ap = argparse.ArgumentParser(description="bf16 gradient-sum jobs, one rank per process")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", required=True, help="comma-separated jobs (module docstring), run in order")
    args = ap.parse_args()
    join_gloo_group()
    for job in args.jobs.split(","):
        run_job(job, args.out)


if __name__ == "__main__":
    from bert_ds.lifecycle.rank_exit import end_process

    _main()
    end_process(0)  # a DeepSpeed rank: no C++ teardown of gloo's threads (see rank_exit)
