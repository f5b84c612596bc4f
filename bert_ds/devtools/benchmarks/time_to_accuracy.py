"""Time to a held-out masked-LM accuracy on the demo setting: bert_ds against a plain transformers + PyTorch loop.

Same shards (the demo's seq-128 training set, dynamic masking, same order), same model size (the ``tiny`` preset),
same global batch (32), same held-out set and accuracy (correct / valid masked positions of ``eval128``), evaluated
every ``EVAL_INTERVAL`` steps by both. bert_ds runs as ``make demo`` trains it: ``ds_configs/demo_cpu.json``'s first
phase (ZeRO-2, LAMB, 2 CPU ranks through the ``deepspeed`` launcher), stopping at the target
(``target_mlm_accuracy``). The baseline is :mod:`bert_ds.devtools.benchmarks.hf_loop` (AdamW; its learning rate chosen
by the sweep recorded in BENCHMARKS.md), stopping at the target too. Both clocks run from process start to the eval line
that first reaches the target, start-up and evaluation included, as a user waits for them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["TARGET", "time_to_accuracy"]

REPO = Path(__file__).resolve().parents[3]
TARGET = 0.13
"""Held-out masked-LM accuracy at seq 128: 2.5x the unigram baseline of the demo's eval set (5.3%), a level both
trainers reach from scratch within the budget (both level off near 14.4% by 1,500 steps: the tiny model's attention
stays near uniform without ``make demo``'s seq-32 warm-up)."""
STEPS = 1500
EVAL_INTERVAL = 100
HF_LR = 2e-3
"""The plain loop's best learning rate in a sweep over the full 1,500-step schedule (measured on this setting, eval
every 100 steps): 5e-4 levels off at 11.3%, 1e-3 at 13.3%, 2e-3 reaches 13.3% at step 600 and 14.5% at best,
4e-3 diverges (stays at the 5.3% unigram answer)."""
_EVAL = re.compile(r"^eval step (\d+) \| mlm_accuracy ([0-9.]+)")


def _timed(cmd: list[str], log: Path, env: dict) -> list[tuple[int, float, float]]:
    """Run ``cmd``; return (step, accuracy, seconds since start) for every eval line it prints."""
    evals = []
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        for line in proc.stdout:
            out.write(line)
            match = _EVAL.match(line)
            if match:
                evals.append((int(match[1]), float(match[2]), time.perf_counter() - start))
                print(f"    {line.rstrip()}  [{evals[-1][2]:.0f} s]", flush=True)
        code = proc.wait()
    if code != 0:
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{cmd[0]} exited with status {code}; the end of {log}:\n{tail}")
    return evals


def _summary(evals: list[tuple[int, float, float]], target: float, settings: str) -> dict:
    hit = next(((s, a, t) for s, a, t in evals if a >= target), None)
    return {"evals": evals, "step_at_target": hit[0] if hit else None, "seconds_to_target": hit[2] if hit else None,
            "final_accuracy": evals[-1][1] if evals else 0.0, "total_seconds": evals[-1][2] if evals else None,
            "settings": settings}


def _bert_ds(data: dict[str, Path], work: Path, steps: int, interval: int, target: float, env: dict) -> dict:
    recipe = json.loads((REPO / "ds_configs" / "demo_cpu.json").read_text())
    recipe["name"] = "tta_" + recipe["name"]
    phase = recipe["phases"][0]
    phase.update(steps=steps, eval_interval=interval, target_mlm_accuracy=target)
    recipe["phases"] = [phase]
    recipe["logging"]["interval"] = 50
    work.mkdir(parents=True, exist_ok=True)
    (work / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
    from bert_ds.devtools.demo import TRAIN_RANKS, _free_port

    launcher = Path(sys.executable).parent / "deepspeed"
    cmd = [str(launcher), "--num_gpus", str(TRAIN_RANKS), "--master_port", str(_free_port()),
           str(REPO / "bert_ds" / "runtime" / "pretrain.py"), "--recipe", str(work / "recipe.json"),
           "--data", str(data["train128"]), "--eval-data", str(data["eval128"]), "--tokenizer", str(data["tokenizer"]),
           "--output", str(work / "run")]
    if (work / "run").exists():
        import shutil

        shutil.rmtree(work / "run")
    settings = (f"LAMB lr {phase['lr']}, warm-up {phase['warmup_fraction']}, ZeRO-2, {TRAIN_RANKS} ranks x 1 thread "
                f"(ds_configs/demo_cpu.json phase 1)")
    return _summary(_timed(cmd, work / "bert_ds.log", {**env, "OMP_NUM_THREADS": "1"}), target, settings)


def _transformers(data: dict[str, Path], work: Path, steps: int, interval: int, target: float, lr: float,
                  env: dict) -> dict:
    cmd = [sys.executable, "-m", "bert_ds.devtools.benchmarks.hf_loop", "--data", str(data["train128"]), "--eval-data",
           str(data["eval128"]), "--tokenizer", str(data["tokenizer"]), "--steps", str(steps), "--lr", str(lr),
           "--eval-interval", str(interval), "--target", str(target)]
    settings = f"AdamW lr {lr}, warm-up 0.05, 1 process x {os.cpu_count()} threads"
    return _summary(_timed(cmd, work / f"transformers_lr{lr}.log", env), target, settings)


def time_to_accuracy(data: dict[str, Path], work: Path, *, quick: bool = False, hf_lr: float = HF_LR) -> dict:
    """Both runs, one after the other; ``quick``: 20 steps, target 0.1% (checks the machinery only)."""
    steps, interval, target = (20, 10, 1e-3) if quick else (STEPS, EVAL_INTERVAL, TARGET)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    work.mkdir(parents=True, exist_ok=True)
    ours = _bert_ds(data, work, steps, interval, target, env)
    theirs = _transformers(data, work, steps, interval, target, hf_lr, env)
    ratio = None
    if ours["seconds_to_target"] and theirs["seconds_to_target"]:
        ratio = theirs["seconds_to_target"] / ours["seconds_to_target"]
    return {"target": target, "steps_budget": steps, "eval_interval": interval, "bert_ds": ours,
            "transformers": theirs, "ratio": ratio}
