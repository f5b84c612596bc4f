"""Helpers for tests that train: a small two-phase recipe, launching ``bert_ds.runtime.pretrain`` on real DeepSpeed
CPU ranks, and comparing the weights of two runs."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import torch

from tests.helpers import HANG_GUARD_S, child_env
from tests.helpers.ranks import REPO, VENV_BIN, rank_command, run_ranks, spawn_ranks

__all__ = ["REPO", "SMALL_RECIPE", "VENV_BIN", "assert_close_params", "param_diffs", "run_pretrain",
           "run_until_signalled", "tensorboard_scalars", "weights", "write_recipe"]

# The smallest recipe that still has two phases, accumulation (micro 1 of global 4) and a boundary; dropout off so
# runs on different numbers of ranks are comparable.
SMALL_RECIPE = {
    "name": "engine_test", "model": "tiny", "kernels": "torch", "seed": 7,
    "model_overrides": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
    "deepspeed": {"zero_stage": 2, "precision": "fp32", "gradient_clipping": 1.0},
    "logging": {"interval": 1, "keep_last_k": 5, "max_nonfinite_steps": 2},
    "phases": [
        {"seq_len": 128, "steps": 4, "global_batch_size": 4, "micro_batch_size": 1, "lr": 1e-2,
         "warmup_fraction": 0.25, "max_predictions": 20},
        {"seq_len": 512, "steps": 2, "global_batch_size": 2, "micro_batch_size": 1, "lr": 5e-3,
         "warmup_fraction": 0.0, "max_predictions": 80},
    ],
}


def write_recipe(path: Path, base: dict | None = None, **changes) -> Path:
    """``SMALL_RECIPE`` (or ``base``) with top-level keys replaced; ``deepspeed``/``optimizer`` dicts are merged."""
    recipe = json.loads(json.dumps(base or SMALL_RECIPE))
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(recipe.get(key), dict):
            recipe[key] = {**recipe[key], **value}
        else:
            recipe[key] = value
    path.write_text(json.dumps(recipe, indent=1))
    return path


def run_pretrain(args: list[str], nprocs: int = 1, timeout: float = HANG_GUARD_S, check: bool = True,
                 ) -> subprocess.CompletedProcess:
    """``python -m bert_ds.runtime.pretrain`` (1 process) or N CPU ranks of ``bert_ds/runtime/pretrain.py`` started
    as DeepSpeed's ``launch.py`` starts them (:func:`~tests.helpers.ranks.spawn_ranks`: these tests are about what
    the ranks compute; the launch command's own behaviour is tests/faults', tests/lifecycle's and tests/launch's).

    Without a ``--tokenizer`` in ``args``, the one ``synthetic_data`` writes beside the first ``--data`` directory is
    passed (the flag is required)."""
    if "--tokenizer" not in args and "--data" in args:
        synthetic_tokenizer = Path(args[args.index("--data") + 1]).parent / "tokenizer"
        if synthetic_tokenizer.is_dir():
            args = [*args, "--tokenizer", str(synthetic_tokenizer)]
    if nprocs == 1:
        return run_ranks(rank_command(1, args), timeout=timeout, check=check)
    return spawn_ranks(nprocs, args, timeout=timeout, check=check)


def run_until_signalled(recipe: Path, data: tuple[Path, Path], run: Path, sig: int = signal.SIGUSR1,
                        ) -> tuple[int, list[str]]:
    """Start ``python -m bert_ds.runtime.pretrain`` on ``data``, send ``sig`` once it logs step 1, and return its exit
    code and console lines."""
    args = ["--recipe", str(recipe), "--data", *map(str, data), "--tokenizer", str(data[0].parent / "tokenizer"),
            "--output", str(run)]
    proc = subprocess.Popen(rank_command(1, args), cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 1 "):
            proc.send_signal(sig)
            break
    lines += proc.stdout.readlines()
    return proc.wait(timeout=HANG_GUARD_S), lines


def weights(run_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    from bert_ds.checkpoint import consolidated_state_dict

    return consolidated_state_dict(run_dir / "checkpoints", tag)


# Attention query/key biases get (almost) no gradient: a key bias adds q.b_k to every score of a query row, which the
# softmax cancels exactly, and the query bias only sees the tiny initial keys. Adam/LAMB normalise such rounding-noise
# gradients into O(lr) updates, so their relative differences measure noise, not the optimizer; they are checked in
# absolute terms instead.
_NOISE_ONLY = ("attention.self.query.bias", "attention.self.key.bias")


def param_diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """``tensor_rel``: max over tensors of ||a - b|| / ||b|| (query/key biases excluded); ``global_rel``: the same over
    all parameters concatenated; ``noise_abs``: max |a - b| over the query/key biases."""
    assert a.keys() == b.keys()
    tensor_rel = max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item()
                     for k in a if not k.endswith(_NOISE_ONLY))
    flat_a = torch.cat([a[k].flatten() for k in sorted(a)])
    flat_b = torch.cat([b[k].flatten() for k in sorted(a)])
    noise_abs = max((a[k] - b[k]).abs().max().item() for k in a if k.endswith(_NOISE_ONLY))
    return {"tensor_rel": tensor_rel, "global_rel": ((flat_a - flat_b).norm() / flat_b.norm()).item(),
            "noise_abs": noise_abs}


def assert_close_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> dict[str, float]:
    d = param_diffs(a, b)
    print(f"{what}: per-tensor rel {d['tensor_rel']:.2e}, global rel {d['global_rel']:.2e}, "
          f"query/key bias abs {d['noise_abs']:.2e}")
    assert d["tensor_rel"] <= 1e-5 and d["global_rel"] <= 1e-6 and d["noise_abs"] <= 1e-6, f"{what}: {d}"
    return d


def tensorboard_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar tag of a run's TensorBoard directory as {step: value}, read the way TensorBoard reads it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(set(steps)) == len(steps), f"{tag}: a step written twice: {steps}"
        out[tag] = {e.step: e.value for e in events}
    return out
