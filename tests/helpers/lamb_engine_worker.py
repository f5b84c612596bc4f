"""One LAMB step at a time through bert_ds's real engine, checked against a float64 LAMB given the same inputs; one
DeepSpeed CPU rank (gloo) per process, spawned by ``tests.helpers.lamb_harness.launch_engine_runs``. Not a test module.

A job ``z<stage>-<trust_ratio>[-overlap][-<bug>]`` is ``ds_configs/tiny_cpu.json`` phase 1 (real text, global batch
16, so the data is the same for any number of ranks) with dropout 0, no warm-up (every compared step has a large lr,
so an update is far above the fp32 resolution of its weights), ``gradient_clipping`` 1.0, ZeRO ``stage`` and
``optimizer.trust_ratio``; ``overlap`` turns on ZeRO's ``overlap_comm`` with buckets small enough that reductions
overlap the backward pass. ``<bug>`` re-creates a known bug in this process only (``BUGS``), to show the checks fail.

For every step the worker records what went into the optimizer and what came out: the model's weights before and
after ``engine.step()``, the gradient each rank's partition handed LAMB (after clipping; all-gathered into full
tensors), the lr and the engine's reported gradient norm. Rank 0 then runs a float64 LAMB step per tensor from the
same weights and the same gradient (its moments accumulated in float64 from the same gradients) and writes
``<out>/<job>/result.json``: per step the norm, the clip error (:func:`clip_error`), each tensor's update error
(:func:`update_error`) and, at ZeRO 1/2, each rank-boundary tensor's slice ratio error (:func:`slice_ratio_error`);
and ``<out>/<job>/grad_step1.pt``: the unclipped gradient of step 1 (full tensors, fp32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

import torch

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask", "masked_lm_positions", "masked_lm_ids",
                "next_sentence_label")
TINY_CPU = Path(__file__).resolve().parents[2] / "ds_configs" / "tiny_cpu.json"
CLIP = 1.0
BUGS = {
    "fp32clip": "stage 0 clipped by DeepSpeed's clip_grad_norm_ (fp32 per-tensor norms) instead of bert_ds's "
                "GlobalNormClip (fp64): the path bert_ds used before it clipped stage 0 itself",
    "nocopy": "ZeroAwareLamb's re-copy of each group's fp32 partition to the model's copy after its deferred update "
              "skipped (ZeRO 1/2): the model keeps the weights of before the step for every group but the last",
    "convention": "the engine's LAMB given the other trust-ratio convention than the recipe's",
    "noreduce": "ZeroAwareLamb's all-reduce of the per-tensor partial norms skipped (ZeRO 1/2): tensors cut by a rank "
                "boundary get one trust ratio per slice (DeepSpeed issues #88, #490, #1217)",
}
"""Known bugs a job can re-create in its own processes (``-<bug>`` suffix)."""
OVERLAP_BUCKET = 50_000
"""Elements per ZeRO reduce/all-gather bucket with ``overlap``: several buckets for tiny_cpu (~1.1M parameters)."""


def job_recipe(job: str):
    """The tiny_cpu recipe for ``z<stage>-<clip|noclip>-<trust_ratio>``: dropout 0, phase 1 only, the given ZeRO stage,
    ``gradient_clipping`` 1.0 or 0 and trust-ratio convention (also used by ``lamb_harness``'s precision runs)."""
    from bert_ds.recipe import Recipe

    stage, clip, trust_ratio = job.split("-")
    data = json.loads(TINY_CPU.read_text())
    data["model_overrides"] = {**data.get("model_overrides", {}), "hidden_dropout_prob": 0.0,
                               "attention_probs_dropout_prob": 0.0}
    data["optimizer"] = {**data["optimizer"], "trust_ratio": trust_ratio}
    data["deepspeed"] = {**data["deepspeed"], "zero_stage": int(stage.removeprefix("z")),
                         "gradient_clipping": {"clip": CLIP, "noclip": 0.0}[clip]}
    data["phases"] = data["phases"][:1]
    return Recipe.from_dict(data, source=f"{TINY_CPU} ({job})")


def parse_job(job: str) -> tuple[int, str, bool, str | None]:
    """``z<stage>-<trust_ratio>[-overlap][-<bug>]`` -> (stage, trust_ratio, overlap, bug)."""
    stage, trust_ratio, *flags = job.split("-")
    overlap = "overlap" in flags
    bugs = [f for f in flags if f != "overlap"]
    if stage not in ("z0", "z1", "z2") or trust_ratio not in ("all", "decay_only") or len(bugs) > 1 or (
            bugs and bugs[0] not in BUGS) or (overlap and stage == "z0"):
        raise ValueError(f"job {job!r}: expected z<0|1|2>-<all|decay_only>[-overlap (ZeRO 1/2)][-<bug in "
                         f"{sorted(BUGS)}>]")
    return int(stage[1:]), trust_ratio, overlap, (bugs[0] if bugs else None)


def exactness_recipe(job: str):
    stage, trust_ratio, overlap, _ = parse_job(job)
    recipe = job_recipe(f"z{stage}-clip-{trust_ratio}")
    phase = dataclasses.replace(recipe.phases[0], warmup_fraction=0.0)
    ds = recipe.deepspeed
    if overlap:
        ds = dataclasses.replace(ds, overlap_comm=True, contiguous_gradients=True,
                                 reduce_bucket_size=OVERLAP_BUCKET, allgather_bucket_size=OVERLAP_BUCKET)
    return dataclasses.replace(recipe, phases=[phase], deepspeed=ds)


# ------------------------------------------------------------------------------------------------- the reference
def clip_coefficient(norm: float) -> float:
    """DeepSpeed's global-norm clip factor (``min(1, max_norm / (norm + 1e-6))``), in float64."""
    return min(1.0, CLIP / (norm + 1e-6))


def clip_error(received_norm: float, reported_norm: float) -> float:
    """``| ||g_received|| / (c(N) * N) - 1 |`` for the reported pre-clip norm ``N``: 0 up to rounding iff LAMB received
    a gradient whose norm before clipping was N, clipped by N. A wrong N shows even when clipping by it is
    self-consistent, because ``||g_received|| / c(N)`` is the true pre-clip norm."""
    return abs(received_norm / (clip_coefficient(reported_norm) * reported_norm) - 1.0)


class Float64Lamb:
    """LAMB (You et al. 2019, Algorithm 2) per tensor in float64, fed the engine's weights and received gradients.

    Written apart from ``bert_ds.optim.lamb``: decay for 2-D tensors only (biases and LayerNorm are the 1-D ones),
    ``trust_ratio="decay_only"`` gives r = 1 to tensors without decay (apex FusedLAMB's default), r = 1 when a norm
    is 0, optional clamp of r.
    """

    def __init__(self, betas, eps: float, weight_decay: float, trust_ratio: str, bias_correction: bool,
                 trust_clamp) -> None:
        self.b1, self.b2 = betas
        self.eps, self.wd, self.trust_ratio = eps, weight_decay, trust_ratio
        self.bias_correction, self.trust_clamp = bias_correction, trust_clamp
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.t = 0

    def updates(self, w: dict[str, torch.Tensor], g: dict[str, torch.Tensor], lr: float) -> dict[str, torch.Tensor]:
        """The step ``w_after - w_before`` for every tensor (float64), advancing the moments."""
        self.t += 1
        b1, b2, t = self.b1, self.b2, self.t
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if self.bias_correction else (1.0, 1.0)
        out = {}
        for name, w32 in w.items():
            wn, gn = w32.double(), g[name].double()
            self.m[name] = b1 * self.m.get(name, torch.zeros_like(wn)) + (1 - b1) * gn
            self.v[name] = b2 * self.v.get(name, torch.zeros_like(wn)) + (1 - b2) * gn * gn
            decay = self.wd if wn.ndim >= 2 else 0.0
            u = (self.m[name] / bc1) / ((self.v[name] / bc2).sqrt() + self.eps) + decay * wn
            w_norm, u_norm = float(wn.norm()), float(u.norm())
            if self.trust_ratio == "decay_only" and decay == 0.0:
                r = 1.0
            elif w_norm > 0 and u_norm > 0:
                r = w_norm / u_norm
                if self.trust_clamp is not None:
                    r = min(max(r, self.trust_clamp[0]), self.trust_clamp[1])
            else:
                r = 1.0
            out[name] = -lr * r * u
        return out


def update_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (float64): the update's error relative to the update itself."""
    want_norm = float(want.norm())
    diff = float((got - want).norm())
    return diff / want_norm if want_norm > 0 else (0.0 if diff == 0 else math.inf)


# ------------------------------------------------------------------------------------------------- the engine run
def _tensor_names(te) -> tuple[object, list[str]]:
    """The client optimizer, and at ZeRO 1/2 the model's name of every tensor by ZeRO's global index."""
    module, zo = te.engine.module, te.engine.optimizer
    name_of = {id(p): n for n, p in module.named_parameters()}
    if te.engine.zero_optimization_stage() == 0:
        return zo, []
    return zo.optimizer, [name_of[id(p)] for group in zo.bit16_groups for p in group]


def slice_ratio_error(got: torch.Tensor, want: torch.Tensor, cut: int) -> float:
    """For a tensor cut by a rank boundary at flat element ``cut``: ``|r_a - r_b| / max(|r_a|, |r_b|)``, ``r_s`` the
    least-squares factor between the update and the reference update on slice ``s``. LAMB scales a whole tensor by one
    trust ratio, so the factors agree up to elementwise rounding; the error of the fp32 norms in the trust ratio is
    common to both slices and cancels."""
    g, w = got.flatten(), want.flatten()
    fits = [float(g[s] @ w[s]) / float(w[s] @ w[s]) for s in (slice(0, cut), slice(cut, None))]
    scale = max(abs(fits[0]), abs(fits[1]))
    return abs(fits[0] - fits[1]) / scale if scale > 0 else 0.0


def _cut_tensors(te, names: list[str]) -> dict[str, int]:
    """Tensors cut by a partition boundary at ZeRO 1/2: name -> flat offset of the (first) cut inside the tensor."""
    from bert_ds.deepspeed_internals import zero_partition_map

    zmap = zero_partition_map(te.engine.optimizer)
    cuts = {}
    for zg in zmap.groups:
        size = zg.flat.numel()
        for index, off, n in zg.tensors:
            inside = [k * size - off for k in range(1, zmap.world_size) if off < k * size < off + n]
            if inside:
                cuts[names[index]] = inside[0]
    return cuts


def _full_gradients(te, received: list[torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Full per-tensor gradients from each group's received partition gradient (all-gathered over the ranks)."""
    import deepspeed.comm as dist

    from bert_ds.deepspeed_internals import zero_partition_map

    zmap = zero_partition_map(te.engine.optimizer)
    out = {}
    for zg, part in zip(zmap.groups, received, strict=True):
        parts = [torch.empty_like(part) for _ in range(zmap.world_size)]
        dist.all_gather(parts, part, group=zmap.process_group)
        full = torch.cat(parts)
        for index, off, n in zg.tensors:
            out[names[index]] = full[off:off + n].view(zmap.shapes[index]).clone()
    return out


def run_job(job: str, steps: int, data_dir: Path, vocab: Path, out: Path, seed: int | None = None) -> None:
    import bert_ds.optim.clip
    from bert_ds.data.index import vocab_sha256
    from bert_ds.data.loader import build_loader
    from bert_ds.runtime.engine import build_engine, build_model

    stage, trust_ratio, _, bug = parse_job(job)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    recipe = exactness_recipe(job)
    if seed is not None:  # another initialisation and data order: another sample of the rounding
        recipe = dataclasses.replace(recipe, seed=seed)
    engine_recipe = recipe
    if bug == "convention":
        other = {"all": "decay_only", "decay_only": "all"}[trust_ratio]
        engine_recipe = dataclasses.replace(recipe, optimizer=dataclasses.replace(recipe.optimizer, trust_ratio=other))
    saved_clip_call = bert_ds.optim.clip.GlobalNormClip.__call__
    if bug == "fp32clip":
        if stage != 0:
            raise ValueError(f"job {job!r}: fp32clip is a stage-0 bug")

        def deepspeed_fp32_clip(self, optimizer, args, kwargs):
            from deepspeed.runtime.utils import clip_grad_norm_

            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self.last_norm = float(clip_grad_norm_(params, self.max_norm))

        bert_ds.optim.clip.GlobalNormClip.__call__ = deepspeed_fp32_clip
    phase = recipe.phases[0]
    vocab_size = sum(1 for line in vocab.read_text(encoding="utf-8").splitlines() if line)
    model = build_model(recipe, recipe.model_config(vocab_size))
    te = build_engine(engine_recipe, 0, model, world)
    client, names = _tensor_names(te)
    if bug == "nocopy":
        if stage == 0:
            raise ValueError(f"job {job!r}: nocopy is a ZeRO 1/2 bug")
        for group in client.zero_layout.groups:
            group.bit16_partition = None
    if bug == "noreduce":
        if stage == 0:
            raise ValueError(f"job {job!r}: noreduce is a ZeRO 1/2 bug")
        client.zero_layout.world_size = 1
    cuts = _cut_tensors(te, names) if stage else {}
    received: dict[int, tuple[torch.Tensor, float]] = {}

    def record(optimizer, args, kwargs):  # runs after the clip hook that build_engine installs at stage 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    received[id(p)] = (p.grad.detach().clone(), float(group["lr"]))

    client.register_step_pre_hook(record)
    loader = build_loader(data_dir, global_batch_size=phase.global_batch_size, micro_batch_size=phase.micro_batch_size,
                          rank=rank, world_size=world, seed=recipe.seed, num_workers=0,
                          expected_seq_len=phase.seq_len, expected_vocab_sha256=vocab_sha256(vocab),
                          max_predictions=phase.max_predictions)
    batches = iter(loader)
    opt = recipe.optimizer
    reference = Float64Lamb(opt.betas, opt.eps, opt.weight_decay, opt.trust_ratio, opt.bias_correction,
                            opt.trust_clamp)
    params = dict(te.engine.module.named_parameters())
    result: dict = {"job": job, "world_size": world, "bug": bug, "steps": []}
    for step in range(steps):
        for _ in range(te.accumulation):
            batch = next(batches)
            te.engine.backward(te.engine(**{k: batch[k] for k in MODEL_INPUTS}).loss)
            if te.engine.is_gradient_accumulation_boundary():
                before = {n: p.detach().clone() for n, p in params.items()}
                received.clear()
            te.engine.step()
        after = {n: p.detach().clone() for n, p in params.items()}
        norm = te.grad_norm()
        if stage == 0:
            by_id = {id(p): n for n, p in params.items()}
            grads = {by_id[k]: g for k, (g, _) in received.items()}
        else:
            grads = _full_gradients(te, [received[id(g["params"][0])][0] for g in client.param_groups], names)
        lrs = {lr for _, lr in received.values()}
        if rank != 0:
            continue
        if len(lrs) != 1 or grads.keys() != before.keys():
            raise RuntimeError(f"{job}: step {step + 1}: lrs {lrs}, gradients for {len(grads)} of {len(before)} "
                               "tensors")
        lr = lrs.pop()
        want = reference.updates(before, grads, lr)
        received_norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
        result["steps"].append({
            "lr": lr, "grad_norm": norm, "received_norm": received_norm,
            "clip_error": None if norm is None else clip_error(received_norm, norm),
            "update_errors": {n: update_error(after[n].double() - before[n].double(), want[n]) for n in want},
            "slice_ratio_errors": {n: slice_ratio_error(after[n].double() - before[n].double(), want[n], cut)
                                   for n, cut in cuts.items()},
        })
        if step == 0 and norm is not None:  # before clipping: what every rank count must agree on
            (out / job).mkdir(parents=True, exist_ok=True)
            coef = clip_coefficient(norm)
            torch.save({n: g / coef for n, g in grads.items()}, out / job / "grad_step1.pt")
    if rank == 0:
        (out / job).mkdir(parents=True, exist_ok=True)
        (out / job / "result.json").write_text(json.dumps(result))
    te.engine.destroy()
    bert_ds.optim.clip.GlobalNormClip.__call__ = saved_clip_call


def main() -> None:

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", required=True, help="comma-separated job names, run in order")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--data", type=Path, required=True, help="a seq-128 shard set")
    ap.add_argument("--vocab", type=Path, required=True, help="the shard set's vocab.txt")
    ap.add_argument("--seed", type=int, default=None, help="instead of the recipe's seed")
    args = ap.parse_args()
    jobs = args.jobs.split(",")
    for job in jobs:
        parse_job(job)
    from bert_ds.runtime.distributed import join_gloo_group

    join_gloo_group()
    for job in jobs:
        run_job(job, args.steps, args.data, args.vocab, args.out, args.seed)


if __name__ == "__main__":
    from bert_ds.lifecycle.rank_exit import end_process

    main()
    end_process(0)  # a DeepSpeed rank: no C++ teardown of gloo's threads (see rank_exit)
