"""Shared pieces of the optimizer tests: a tiny model with awkward shapes, its data, a float64 LAMB reference,
the naive flat-slice LAMB, and launchers for real DeepSpeed CPU ranks (gloo): ``lamb_zero_worker`` (the tiny model)
and ``lamb_engine_worker`` (bert_ds's engine on real text)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from tests.helpers import HANG_GUARD_S, child_env

ROOT = Path(__file__).resolve().parents[2]
ZERO_WORKER = "tests.helpers.lamb_zero_worker"
ENGINE_WORKER = "tests.helpers.lamb_engine_worker"

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world_size: int, out_dir: Path, module: str, args: list[str]) -> None:
    """Run ``python -m module args`` on ``world_size`` CPU ranks (gloo), one process per rank; raise with the failed
    ranks' log tails. Ranks are spawned directly with the torch.distributed env variables (what the ``deepspeed``
    launcher sets) to keep runs short on a shared 2-core machine."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", module, *args]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
    try:
        for p, _ in procs:
            p.wait(timeout=HANG_GUARD_S)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    failed = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        logs = "\n".join((out_dir / f"rank{r}.log").read_text()[-3000:] for r in failed)
        raise RuntimeError(f"ranks {failed} failed:\n{logs}")


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
    """Run ``lamb_engine_worker`` jobs (``z<stage>-<clip|noclip>-<trust_ratio>``) on ``world_size`` CPU ranks.

    Returns ``{job: {"params": rank 0's final weights (fp64), "grad_norms": per-step TrainEngine.grad_norm(),
    "independent_norms": per-step fp64 norm of the averaged gradients, stage 0 only (else empty)}}``.
    """
    run_ranks(world_size, out_dir, ENGINE_WORKER, [f"--out={out_dir}", f"--jobs={','.join(jobs)}", f"--steps={steps}",
                                                   f"--data={data}", f"--vocab={vocab}"])
    return {job: {"params": torch.load(out_dir / job / "params.pt"),
                  **json.loads((out_dir / job / "norms.json").read_text())} for job in jobs}


def max_rel_diff_excluding(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                           excluded: tuple[str, ...]) -> tuple[float, str]:
    """``max_rel_diff`` over the tensors whose name contains none of ``excluded``, and the worst tensor's name."""
    kept = [n for n in b if not any(e in n for e in excluded)]
    diffs = {n: max_rel_diff({n: a[n]}, {n: b[n]}) for n in kept}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst
