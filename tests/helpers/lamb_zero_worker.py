"""DeepSpeed CPU ranks (gloo) for the optimizer tests; spawned by ``tests.helpers.lamb_harness.launch`` as
``python -m tests.helpers.lamb_zero_worker``. Not a test module.

One process runs a list of jobs (``--jobs``) so the deepspeed import and process-group setup are paid once. Each job
writes ``<out>/<job>/rank<r>.json`` (and ``params_rank<r>.pt`` for training jobs). Jobs:

  zero0, zero1, zero2, zero2_noclip   -- ZeroAwareLamb, ``--steps`` steps (zero2*: round-robin gradients on)
  zero2_aligned                       -- ZeRO-2 with parameter_alignment (padding gaps between tensors)
  zero1_decay_only, zero2_decay_only  -- trust_ratio="decay_only" (no trust ratio for weight-decay-0 tensors)
  naive                               -- the flat-slice LAMB under ZeRO-2: one trust ratio per rank slice
  zero2_clamped                       -- trust ratios clamped to [0.01, 0.3] (bing_bert's min/max coefficients)
  per_tensor_<job>                    -- any job above stepped by the frozen per-tensor ZeroAwareLamb
                                         (tests.helpers.lamb_per_tensor), the reference of the multi-tensor one
  ckpt      -- ZeRO-2: train, save, train more; a fresh engine loads the checkpoint and must continue identically
  ckpt_elastic    -- the same with zero_optimization.elastic_checkpoint (what bert_ds.runtime.engine configures)
  resume_universal -- load ckpt's checkpoint (``--ckpt_from``), converted by ds_to_universal, on another
                      world size and continue
  unbound   -- ZeRO-2 without bind_optimizer: the first step must refuse
  stage3    -- ZeRO-3: binding must refuse, and an unbound step must refuse too
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import deepspeed
import deepspeed.comm as dist
import torch

from bert_ds.optim import (
    GlobalNormClip,
    UnsupportedZeroSetup,
    ZeroAwareLamb,
    bind_optimizer,
    build_optimizer,
    param_groups,
)
from bert_ds.runtime.distributed import join_gloo_group
from tests.helpers.lamb_harness import BETAS, CLIP, EPS, GLOBAL_BATCH, LR, WEIGHT_DECAY, NaiveLamb, batch, make_model
from tests.helpers.lamb_per_tensor import PerTensorLamb


def ds_config(stage: int, world: int, clip: float, round_robin: bool, aligned: bool = False,
              elastic: bool = False) -> dict:
    zero = {"stage": stage}
    if stage in (1, 2):
        zero["round_robin_gradients"] = round_robin
        zero["parameter_alignment"] = aligned  # pads each tensor to 16 bytes: gaps between segments
        zero["elastic_checkpoint"] = elastic  # optimizer state saved unpadded, re-partitioned on load
    return {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def make_engine(stage: int, optimizer: str = "lamb", clip: float = CLIP, round_robin: bool = False,
                aligned: bool = False, elastic: bool = False, universal: bool = False, seed: int = 0,
                bind: bool = True, trust_ratio: str = "all", **trust_clamp):
    model = make_model(seed)
    if optimizer == "lamb":
        opt = build_optimizer("lamb", model, lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, eps=EPS,
                              zero_stage=min(stage, 2), trust_ratio=trust_ratio, **trust_clamp)
    elif optimizer == "per_tensor":
        opt = PerTensorLamb(param_groups(model, WEIGHT_DECAY), lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, eps=EPS,
                            trust_ratio=trust_ratio, **trust_clamp)
    else:
        opt = NaiveLamb(param_groups(model, WEIGHT_DECAY))
    world = int(os.environ["WORLD_SIZE"])
    # stage 0: bert_ds's clip (fp64 norm, as ZeRO 1/2), not DeepSpeed's fp32-norm one; see bert_ds/optim/clip.py
    config = ds_config(stage, world, 0.0 if stage == 0 else clip, round_robin, aligned, elastic)
    if stage == 0:
        GlobalNormClip(clip).attach(opt)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if bind and isinstance(opt, PerTensorLamb):
        if stage in (1, 2):
            opt.bind_zero(engine.optimizer)  # bind_optimizer only knows ZeroAwareLamb
    elif bind:
        bind_optimizer(engine)
    return engine, opt


def train(engine, first: int, last: int) -> None:
    rank, world = engine.global_rank, engine.world_size
    micro = GLOBAL_BATCH // world
    for step in range(first, last):
        ids, labels = batch(step)
        loss = engine(ids[rank * micro:(rank + 1) * micro], labels[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()


def params_of(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().double().clone() for n, p in engine.module.named_parameters()}


TRAIN_JOBS = {
    "zero0": dict(stage=0),
    "zero1": dict(stage=1),
    "zero2": dict(stage=2, round_robin=True),
    "zero2_noclip": dict(stage=2, round_robin=True, clip=0.0),
    "zero2_aligned": dict(stage=2, aligned=True),
    "zero1_decay_only": dict(stage=1, trust_ratio="decay_only"),
    "zero2_decay_only": dict(stage=2, round_robin=True, trust_ratio="decay_only"),
    "naive": dict(stage=2, round_robin=True, optimizer="naive"),
    "zero2_clamped": dict(stage=2, round_robin=True, min_trust=0.01, max_trust=0.3),
}
TRAIN_JOBS.update({f"per_tensor_{job}": dict(kw, optimizer="per_tensor") for job, kw in list(TRAIN_JOBS.items())
                   if kw.get("optimizer", "lamb") == "lamb"})


def run_job(job: str, steps: int, out: Path, ckpt_from: Path | None = None) -> dict:
    result: dict = {}
    if job in TRAIN_JOBS:
        engine, opt = make_engine(**TRAIN_JOBS[job])
        layout = opt.zero_layout if isinstance(opt, ZeroAwareLamb | PerTensorLamb) else None
        result["split_tensors"] = [layout.names[i] for i in layout.split_tensors] if layout else []
        result["bound"] = layout is not None
        result["gap_runs"] = sum(t < 0 for lay in layout.groups for t in lay.run_tensor[:-1]) if layout else 0
        train(engine, 0, steps)
        result["params"] = params_of(engine)
        if isinstance(opt, ZeroAwareLamb | PerTensorLamb):
            st = next(iter(opt.state.values()))
            result["state_keys"] = sorted(st)
            result["step"] = float(st["step"])
    elif job == "stage3":
        engine, _ = make_engine(stage=3, bind=False)
        try:
            bind_optimizer(engine)
            result["bind_error"] = None
        except UnsupportedZeroSetup as e:
            result["bind_error"] = str(e)
        try:
            train(engine, 0, 1)
            result["step_error"] = None
        except RuntimeError as e:
            result["step_error"] = str(e)
    elif job == "unbound":
        engine, _ = make_engine(stage=2, bind=False)
        try:
            train(engine, 0, 1)
            result["step_error"] = None
        except RuntimeError as e:
            result["step_error"] = str(e)
    elif job in ("ckpt", "ckpt_elastic"):
        # round-robin gradients only for the elastic job: DeepSpeed's universal-checkpoint converter misplaces tensors
        # of a round-robin checkpoint (seen with any optimizer on 0.19.8), and the plain job feeds that converter
        half, elastic = steps // 2, job == "ckpt_elastic"
        engine, _ = make_engine(stage=2, round_robin=elastic, elastic=elastic)
        train(engine, 0, half)
        ckpt_dir = str(out / job / "ckpt")
        engine.save_checkpoint(ckpt_dir, tag="half")
        train(engine, half, steps)
        straight = params_of(engine)
        # a different init: everything must come from disk
        resumed_engine, resumed_opt = make_engine(stage=2, round_robin=elastic, elastic=elastic, seed=123)
        resumed_engine.load_checkpoint(ckpt_dir, tag="half")
        result["loaded_step"] = next(iter(resumed_opt.state.values()))["step"]
        train(resumed_engine, half, steps)
        resumed = params_of(resumed_engine)
        result["max_abs_diff"] = max(float((straight[n] - resumed[n]).abs().max()) for n in straight)
        result["params"] = straight
        if not elastic:  # DeepSpeed's route to another world size (its converter reads the non-elastic layout)
            if dist.get_rank() == 0:
                subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                f"--input_folder={ckpt_dir}/half", f"--output_folder={ckpt_dir}/half_universal",
                                "--inject_missing_state"],
                               check=True, stdout=subprocess.DEVNULL)
            dist.barrier()
    elif job == "resume_universal":  # ckpt's checkpoint, converted to universal, on this number of ranks
        engine, opt = make_engine(stage=2, universal=True, seed=123)
        engine.load_checkpoint(str(ckpt_from / "ckpt" / "ckpt"), tag="half_universal")
        result["loaded_step"] = next(iter(opt.state.values()))["step"]
        train(engine, steps // 2, steps)
        result["params"] = params_of(engine)
    else:
        raise ValueError(f"unknown job {job!r}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", required=True, help="comma-separated job names, run in order")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ckpt_from", type=Path, default=None, help="output folder of an earlier ckpt_elastic job")
    args = ap.parse_args()
    join_gloo_group()
    rank = int(os.environ["RANK"])
    for job in args.jobs.split(","):
        result = run_job(job, args.steps, args.out, args.ckpt_from)
        (args.out / job).mkdir(parents=True, exist_ok=True)
        params = result.pop("params", None)
        if params is not None:
            torch.save(params, args.out / job / f"params_rank{rank}.pt")
        (args.out / job / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    from bert_ds.lifecycle.rank_exit import end_process

    main()
    end_process(0)  # a DeepSpeed rank: no C++ teardown of gloo's threads (see rank_exit)
