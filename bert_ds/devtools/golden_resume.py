"""Golden resume on one device (Megatron-core's checkpoint-resume test): does a resumed run continue bit for bit?

An uninterrupted run trains ``steps`` steps and saves its state after ``save_at`` (model, fp32 masters, LAMB moments
and step counts, through ``torch.save`` into memory: a real serialisation round trip). A fresh
:class:`~bert_ds.devtools.bench_step.BenchStep`, initialised from another seed so that a missing piece shows, loads
that state and trains the remaining steps. Each step draws its dropout masks from the trainer's keyed stream
(:class:`bert_ds.runtime.trainer.DropoutKey`: seed, phase, step, micro batch), as a resumed pre-training run does;
the batch is fixed, so the loss must fall (:func:`~bert_ds.devtools.gpu_rules.loss_rule`; over fresh random batches
it wanders). Per step after the save it records the loss and the sum of |w| over the fp32 masters (float64); the
final weights are compared whole. :func:`bert_ds.devtools.gpu_rules.resume_rule` judges; only when the resumed
run is not bit for bit does a second uninterrupted run measure what run-to-run noise allows.

Deterministic mode (``torch.use_deterministic_algorithms``, warn only, and ``CUBLAS_WORKSPACE_CONFIG``) is process
state: gpu-check runs this item in a child process started with that variable set.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

import torch

from bert_ds.config import BertConfig
from bert_ds.devtools.bench_step import BenchStep, predictions_for, synthetic_batch
from bert_ds.devtools.gpu_rules import loss_rule, resume_rule

__all__ = ["CUBLAS_WORKSPACE", "golden_resume", "load_snapshot", "run_steps"]

CUBLAS_WORKSPACE = ":4096:8"
"""CUBLAS_WORKSPACE_CONFIG for deterministic cuBLAS (CUDA docs, "Results reproducibility"), set before the first
cuBLAS call."""
_SEED = 12345  # the run's seed (DropoutKey.seed), as a recipe's "seed"
LOSS_WARMUP = 3  # the first LAMB steps may raise the loss (H100 run: step 2 above step 1); judged from step 4 on


def load_snapshot(bench: BenchStep, snapshot: bytes) -> None:
    """Restore everything :meth:`BenchStep.state_dict` saved (the default ``restore`` of :func:`golden_resume`)."""
    bench.load_state_dict(torch.load(io.BytesIO(snapshot), map_location=bench.device, weights_only=True))


def run_steps(bench: BenchStep, first: int, last: int, batch: int, seq: int,
              save_at: int | None = None) -> tuple[dict, bytes | None]:
    """Train steps ``first``..``last`` (1-based, inclusive), recording each step's loss and weight sum. Returns the
    records (and the final masters) and the state saved after step ``save_at``, if asked."""
    from bert_ds.runtime.trainer import DropoutKey

    losses, sums, snapshot = [], [], None
    data = synthetic_batch(bench.config, batch, seq, predictions_for(seq), bench.device)
    for step in range(first, last + 1):
        torch.manual_seed(DropoutKey(seed=_SEED, phase=0, step=step - 1, rank=0, world_size=1).seed_for(0))
        loss = bench.forward_backward(data)
        bench.optimizer_step()
        losses.append(loss)
        sums.append(torch.stack([m.detach().double().abs().sum() for m in bench.masters]).sum())
        if step == save_at:
            buffer = io.BytesIO()
            torch.save(bench.state_dict(), buffer)
            snapshot = buffer.getvalue()
    record = {"losses": [float(x) for x in losses], "weight_sums": [float(x) for x in sums],
              "final": [m.detach().clone() for m in bench.masters]}
    return record, snapshot


def _after(run: dict, n: int) -> dict:
    """The last ``n`` steps' records of a run (the steps after the save)."""
    return {**run, "losses": run["losses"][-n:], "weight_sums": run["weight_sums"][-n:]}


def _same_weights(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["final"], b["final"], strict=True))


def golden_resume(config: BertConfig, seq: int, batch: int, device: torch.device, dtype: torch.dtype,
                  kernels: str = "auto", steps: int = 20, save_at: int = 10,
                  restore: Callable[[BenchStep, bytes], None] = load_snapshot) -> tuple[bool, dict]:
    """The golden-resume item: uninterrupted run, resumed run (``restore`` loads the snapshot into a fresh model;
    replaceable, so a restore that forgets a piece can be shown to fail), and a rerun only when they differ."""
    later = steps - save_at
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # a kernel without a deterministic twin warns
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            full, snapshot = run_steps(BenchStep(config, device, dtype, kernels), 1, steps, batch, seq, save_at)
            fresh = BenchStep(config, device, dtype, kernels, seed=1)  # other weights: a missing piece shows
            restore(fresh, snapshot)
            resumed, _ = run_steps(fresh, save_at + 1, steps, batch, seq)
            runs = {"uninterrupted": {**full, "weights_equal": True},
                    "resumed": {**resumed, "weights_equal": _same_weights(resumed, full)}}
            if not (runs["resumed"]["weights_equal"] and resumed["losses"] == _after(full, later)["losses"]):
                rerun, _ = run_steps(BenchStep(config, device, dtype, kernels), 1, steps, batch, seq)
                runs["rerun"] = {**rerun, "weights_equal": _same_weights(rerun, full)}
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    ok, verdict = resume_rule(_after(runs["uninterrupted"], later), runs["resumed"],
                              _after(runs["rerun"], later) if "rerun" in runs else None)
    falls, loss = loss_rule(full["losses"], LOSS_WARMUP)
    if not falls:
        verdict["reason"] = "; ".join(filter(None, [verdict.get("reason"), f"uninterrupted run: {loss['reason']}"]))
    nondeterministic = sorted({str(w.message)[:200] for w in caught if "deterministic" in str(w.message)})
    details = {"model": f"{config.num_hidden_layers} layers x {config.hidden_size}", "seq": seq, "batch": batch,
               "dtype": str(dtype).removeprefix("torch."), "kernels": kernels, "steps": steps, "saved_after": save_at,
               "snapshot_mib": round(len(snapshot) / 2**20, 1), **verdict, "loss_falls": loss,
               "nondeterministic_ops": nondeterministic,
               **{name: {k: v for k, v in run.items() if k != "final"} for name, run in runs.items()}}
    return ok and falls, details
