"""Shared pieces of the optimizer tests: a tiny model with awkward shapes, its data, a float64 LAMB reference,
the naive flat-slice LAMB, and launchers for real DeepSpeed CPU ranks (gloo): ``lamb_zero_worker`` (the tiny model),
``lamb_engine_worker`` (bert_ds's engine on real text, step by step against a float64 LAMB) and this module's own
worker for the same engine runs in fp32 or DeepSpeed's bf16 mode (``launch_precision_runs``; ``python -m
tests.helpers.lamb_harness`` is one of its ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tests.helpers.ranks import run_module_ranks as run_ranks

ZERO_WORKER = "tests.helpers.lamb_zero_worker"
ENGINE_WORKER = "tests.helpers.lamb_engine_worker"
PRECISION_WORKER = "tests.helpers.lamb_harness"  # this module is the worker of launch_precision_runs

GLOBAL_BATCH = 8
SEQ = 5
VOCAB = 11
LR = 2e-2
WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.999)
EPS = 1e-6
CLIP = 0.05  # small enough that the global-norm clip is active on most steps


class TinyNet(nn.Module):
    """Odd sizes so flat ZeRO partitions cut tensors at rank boundaries."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 17)
        self.fc1 = nn.Linear(17, 33)
        self.LayerNorm = nn.LayerNorm(33)
        self.fc2 = nn.Linear(33, 3)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, T, 17)
        h = self.LayerNorm(torch.tanh(self.fc1(h)))  # (B, T, 33)
        logits = self.fc2(h.mean(dim=1))  # (B, 3)
        return nn.functional.cross_entropy(logits, labels)


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    model = TinyNet()
    with torch.no_grad():  # non-trivial LayerNorm/bias values so every tensor has a nonzero norm
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(0, 3, (GLOBAL_BATCH,), generator=g)
    return ids, labels


def reference_lamb(steps: int, clip: float = CLIP, min_trust=None, max_trust=None, trust_ratio: str = "all",
                   stats: dict | None = None) -> dict[str, torch.Tensor]:
    """Float64 LAMB (You et al. 2019, Algorithm 2), one tensor at a time, after a DeepSpeed-style global-norm clip.

    ``trust_ratio="decay_only"``: tensors without weight decay take ``r = 1`` (apex ``FusedLAMB`` default).
    ``stats["clipped_steps"]`` counts the steps on which the clip was active.
    """
    model = make_model().double()
    params = dict(model.named_parameters())
    decay = {n: (0.0 if (n.endswith("bias") or "LayerNorm.weight" in n or p.ndim <= 1) else WEIGHT_DECAY)
             for n, p in params.items()}
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    b1, b2 = BETAS
    for t in range(1, steps + 1):
        model.zero_grad()
        ids, labels = batch(t - 1)
        model(ids, labels).backward()
        with torch.no_grad():
            if clip > 0:
                total = torch.sqrt(sum((p.grad**2).sum() for p in params.values()))
                coef = clip / (total + 1e-6)  # deepspeed.runtime.utils.clip_grad_norm_
                if coef < 1:
                    if stats is not None:
                        stats["clipped_steps"] = stats.get("clipped_steps", 0) + 1
                    for p in params.values():
                        p.grad.mul_(coef)
            for n, p in params.items():
                g = p.grad
                m[n] = b1 * m[n] + (1 - b1) * g
                v[n] = b2 * v[n] + (1 - b2) * g * g
                u = (m[n] / (1 - b1**t)) / (torch.sqrt(v[n] / (1 - b2**t)) + EPS) + decay[n] * p
                wn, un = p.norm(), u.norm()
                if trust_ratio == "decay_only" and decay[n] == 0.0:
                    r = 1.0
                elif wn > 0 and un > 0:
                    r = wn / un
                    if min_trust is not None:
                        r = max(r, torch.tensor(min_trust, dtype=r.dtype))
                    if max_trust is not None:
                        r = min(r, torch.tensor(max_trust, dtype=r.dtype))
                else:
                    r = 1.0
                p.sub_(LR * r * u)
    return {n: p.detach().clone() for n, p in params.items()}


class NaiveLamb(torch.optim.Optimizer):
    """LAMB with one trust ratio per tensor *it sees*: under ZeRO that is one per rank's flat slice (the bug)."""

    def __init__(self, params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"], st["exp_avg"], st["exp_avg_sq"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                t = st["step"]
                st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                u = (st["exp_avg"] / (1 - b1**t)) / ((st["exp_avg_sq"] / (1 - b2**t)).sqrt() + group["eps"])
                u.add_(p, alpha=group["weight_decay"])
                wn, un = p.norm(), u.norm()
                r = wn / un if wn > 0 and un > 0 else 1.0
                p.sub_(group["lr"] * r * u)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Max over tensors of ||a - b||_inf / ||b||_inf (elementwise ratios blow up near zero entries)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[n].detach().double() - b[n].detach().double()).abs().max() / b[n].detach().double().abs().max())
               for n in a)


def launch(world_size: int, out_dir: Path, jobs: list[str], steps: int = 20, ckpt_from: Path | None = None) -> dict:
    """Run ``lamb_zero_worker`` jobs on ``world_size`` CPU ranks.

    Returns ``{job: {"ranks": [per-rank JSON], "params": [per-rank params or None]}}``.
    """
    args = [f"--out={out_dir}", f"--jobs={','.join(jobs)}", f"--steps={steps}"]
    if ckpt_from is not None:
        args.append(f"--ckpt_from={ckpt_from}")
    run_ranks(world_size, out_dir, ZERO_WORKER, args)
    results = {}
    for job in jobs:
        d = out_dir / job
        params = [d / f"params_rank{r}.pt" for r in range(world_size)]
        results[job] = {"ranks": [json.loads((d / f"rank{r}.json").read_text()) for r in range(world_size)],
                        "params": [torch.load(p) if p.exists() else None for p in params]}
    return results


def launch_engine_runs(world_size: int, out_dir: Path, jobs: list[str], steps: int, data: Path,
                       vocab: Path) -> dict[str, dict]:
    """Run ``lamb_engine_worker`` jobs (``z<stage>-<trust_ratio>[-overlap][-<bug>]``) on ``world_size`` CPU ranks.

    Returns ``{job: {"steps": per-step records (lr, grad_norm, received_norm, clip_error, update_errors per tensor),
    "grad_step1": the unclipped gradient of step 1 by tensor name}}`` (see the worker's docstring).
    """
    run_ranks(world_size, out_dir, ENGINE_WORKER, [f"--out={out_dir}", f"--jobs={','.join(jobs)}", f"--steps={steps}",
                                                   f"--data={data}", f"--vocab={vocab}"])
    return {job: {**json.loads((out_dir / job / "result.json").read_text()),
                  "grad_step1": torch.load(out_dir / job / "grad_step1.pt")} for job in jobs}


# ------------------------------------------------------------------------------------- mixed precision (bf16) runs
PRECISION_FAULTS = ("nocopy", "noreduce")
"""Deliberate bugs a precision job can inject into the bound ZeroAwareLamb, to show its test can fail: ``nocopy``
skips the bit16 re-copy after the deferred update (the model's bit16 copy of every param group but the last keeps the
weights of before the step), ``noreduce`` skips the all-reduce of the partial norms (one trust ratio per rank slice,
DeepSpeed issue #88)."""


def _precision_job(job: str) -> tuple[str, int, str, str | None]:
    """``<fp32|bf16>-z<stage>-<trust_ratio>[-<fault>]`` -> (precision, stage, trust_ratio, fault)."""
    precision, stage, trust_ratio, *fault = job.split("-")
    if precision not in ("fp32", "bf16") or stage not in ("z1", "z2") or len(fault) > 1 or (
            fault and fault[0] not in PRECISION_FAULTS):
        raise ValueError(f"precision job {job!r}: expected <fp32|bf16>-z<1|2>-<trust_ratio>[-<fault in "
                         f"{PRECISION_FAULTS}>]")
    return precision, int(stage[1:]), trust_ratio, (fault[0] if fault else None)


def _bit16_mismatches(zero_optimizer) -> int:
    """Elements of this rank's bit16 partitions that differ from its fp32 master partitions rounded to bit16."""
    from bert_ds.deepspeed_internals import zero_partition_map

    return sum(int((g.bit16_partition != g.flat.to(g.bit16_partition.dtype)).sum())
               for g in zero_partition_map(zero_optimizer).groups)


def run_precision_job(job: str, steps: int, data_dir: Path, vocab: Path, out: Path) -> None:
    """One precision job on this rank (see :func:`launch_precision_runs`)."""
    import dataclasses
    import os

    from deepspeed.utils import safe_get_full_fp32_param

    import bert_ds.runtime.engine
    from bert_ds.data.index import vocab_sha256
    from bert_ds.data.loader import build_loader
    from tests.helpers.lamb_engine_worker import MODEL_INPUTS, job_recipe

    precision, stage, trust_ratio, fault = _precision_job(job)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    recipe = job_recipe(f"z{stage}-clip-{trust_ratio}")
    recipe = dataclasses.replace(recipe, deepspeed=dataclasses.replace(recipe.deepspeed, precision=precision))
    phase = recipe.phases[0]
    vocab_size = sum(1 for line in vocab.read_text(encoding="utf-8").splitlines() if line)
    model = bert_ds.runtime.engine.build_model(recipe, recipe.model_config(vocab_size))
    init = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    te = bert_ds.runtime.engine.build_engine(recipe, 0, model, world)  # an explicit bf16 runs as bf16 on CPU ranks too
    assert te.precision == precision, (te.precision, precision)
    zero = te.engine.optimizer
    layout = zero.optimizer.zero_layout
    if fault == "nocopy":
        for group in layout.groups:
            group.bit16_partition = None
    elif fault == "noreduce":
        layout.world_size = 1
    loader = build_loader(data_dir, global_batch_size=phase.global_batch_size, micro_batch_size=phase.micro_batch_size,
                          rank=rank, world_size=world, seed=recipe.seed, num_workers=0,
                          expected_seq_len=phase.seq_len, expected_vocab_sha256=vocab_sha256(vocab),
                          max_predictions=phase.max_predictions)
    batches = iter(loader)
    record: dict = {"losses": [], "grad_norms": [], "bit16_mismatches": []}
    for _ in range(steps):
        losses = []
        for _ in range(te.accumulation):
            batch = next(batches)
            loss = te.engine(**{k: batch[k] for k in MODEL_INPUTS}).loss
            te.engine.backward(loss)
            te.engine.step()
            losses.append(float(loss))
        record["losses"].append(sum(losses) / len(losses))
        record["grad_norms"].append(te.grad_norm())
        record["bit16_mismatches"].append(_bit16_mismatches(zero))
    # Every rank: the model's (all-gathered) params against the full fp32 master rounded to the model's dtype.
    model_params = dict(te.engine.module.named_parameters())
    master = {n: safe_get_full_fp32_param(p) for n, p in model_params.items()}
    record["param_dtypes"] = sorted({str(p.dtype) for p in model_params.values()})
    record["model_vs_master_mismatches"] = {n: int((p.data != master[n].to(p.dtype)).sum())
                                            for n, p in model_params.items()}
    d = out / job
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save({"master": {n: t.double() for n, t in master.items()}, "init": init}, d / "params.pt")
    te.engine.destroy()


def launch_precision_runs(world_size: int, out_dir: Path, jobs: list[str], steps: int, data: Path,
                          vocab: Path) -> dict[str, dict]:
    """Run precision jobs on ``world_size`` CPU ranks, in one process per rank (this module is their worker).

    A job ``<fp32|bf16>-z<1|2>-<trust_ratio>[-<fault>]`` is ``lamb_engine_worker``'s ``z<stage>-clip-<trust_ratio>``
    (tiny_cpu, dropout 0, gradient clipping 1.0, the first ``steps`` steps of phase 1 on real text) built by
    ``bert_ds.runtime.engine.build_engine`` with ``deepspeed.precision`` set (``bf16`` is DeepSpeed's ``"bf16":
    {"enabled": true}``: bf16 model and gradients, fp32 master weights in ZeRO's partitions), with a
    ``PRECISION_FAULTS`` fault.

    Returns ``{job: {"ranks": [per-rank record], "master": the full fp32 master weights after the last step, "init":
    the initial weights (both fp64)}}``. A rank's record has per-step ``losses`` (mean over its
    micro-batches), ``grad_norms``, ``bit16_mismatches`` (elements of its bit16 partitions that differ from its fp32
    partitions rounded to bit16, after each step), the model's ``param_dtypes`` and, after the last step,
    ``model_vs_master_mismatches`` per param (the model's params against the full fp32 master rounded to their dtype).
    """
    for job in jobs:
        _precision_job(job)
    run_ranks(world_size, out_dir, PRECISION_WORKER, [f"--out={out_dir}", f"--jobs={','.join(jobs)}",
                                                      f"--steps={steps}", f"--data={data}", f"--vocab={vocab}"])
    results = {}
    for job in jobs:
        saved = torch.load(out_dir / job / "params.pt")
        results[job] = {"ranks": [json.loads((out_dir / job / f"rank{r}.json").read_text())
                                  for r in range(world_size)], **saved}
    return results


def _precision_worker_main() -> None:
    import argparse


    ap = argparse.ArgumentParser(description="precision jobs of launch_precision_runs, one rank per process")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", required=True, help="comma-separated job names, run in order")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--data", type=Path, required=True, help="a seq-128 shard set")
    ap.add_argument("--vocab", type=Path, required=True, help="the shard set's vocab.txt")
    args = ap.parse_args()
    from bert_ds.runtime.distributed import join_gloo_group

    join_gloo_group()
    for job in args.jobs.split(","):
        run_precision_job(job, args.steps, args.data, args.vocab, args.out)


if __name__ == "__main__":
    from bert_ds.lifecycle.rank_exit import end_process

    _precision_worker_main()
    end_process(0)  # a DeepSpeed rank: no C++ teardown of gloo's threads (see rank_exit)
