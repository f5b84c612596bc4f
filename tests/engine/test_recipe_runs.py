"""Every GPU recipe in ds_configs/ starts and runs on 2 real DeepSpeed CPU ranks: its optimizer, schedule, precision,
ZeRO options (overlap_comm on), masking and phase hand-off, with the model shrunk to ``tiny`` and each phase cut to
2 steps of global batch 4 (micro 1, so 2 ranks accumulate 2 micro batches). The lr logged at each phase's first step
must be the one the recipe's own schedule gives, so a schedule field the run ignored (``schedule_steps``) fails."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bert_ds.optim import TimeBudget, lr_lambda
from bert_ds.recipe import load_recipe
from tests.helpers.runs import REPO, run_pretrain, tensorboard_scalars

pytestmark = pytest.mark.e2e

CPU_ONLY = {"tiny_cpu", "demo_cpu", "demo_warmup_cpu"}  # run by the engine and demo tests already
GPU_RECIPES = sorted(p for p in (REPO / "ds_configs").glob("*.json") if p.stem not in CPU_ONLY)
SMOKE_STEPS = 2


def _param(path: Path):
    return pytest.param(path, id=path.stem)


def smoke_variant(path: Path) -> dict:
    """The recipe at ``path`` with the model shrunk and each phase cut short; every other field is the recipe's."""
    data = json.loads(path.read_text())
    data["model"] = "tiny"
    data["logging"] = {**data.get("logging", {}), "interval": 1}
    for phase in data["phases"]:
        phase.update(steps=SMOKE_STEPS, global_batch_size=4, micro_batch_size=1, checkpoint_interval=0,
                     eval_interval=0)
    return data


def test_every_gpu_recipe_is_covered():
    names = {p.stem for p in GPU_RECIPES}
    assert {"bert_base", "bert_large", "bert_base_paper", "bert_base_mosaic", "bert_base_8gpu",
            "bert_large_24h"} <= names, names


@pytest.mark.parametrize("path", [_param(p) for p in GPU_RECIPES])
def test_recipe_runs_on_two_cpu_ranks(path, synthetic_data, tmp_path):
    shipped = load_recipe(path)
    assert shipped.deepspeed.overlap_comm, f"{path.name}: GPU recipes overlap ZeRO's reduction with backward"
    recipe_path = tmp_path / path.name
    recipe_path.write_text(json.dumps(smoke_variant(path)))
    recipe = load_recipe(recipe_path)
    data = [str(d) for d in synthetic_data[:len(recipe.phases)]]
    run = tmp_path / "run"
    run_pretrain(["--recipe", str(recipe_path), "--data", *data, "--output", str(run)], nprocs=2)

    last = len(recipe.phases)
    assert (run / "checkpoints" / "latest").read_text() == f"phase{last}-step{SMOKE_STEPS:06d}"
    scalars = tensorboard_scalars(run / "tensorboard")
    losses = scalars["train/loss"]
    assert len(losses) == SMOKE_STEPS * last and all(math.isfinite(v) for v in losses.values())
    for i, phase in enumerate(recipe.phases):
        budget = TimeBudget(phase.budget_hours) if phase.schedule == "time_linear" else None  # 0 h trained: lr 0
        factor = lr_lambda(phase.schedule, phase.schedule_steps or phase.steps, phase.warmup_fraction,
                           phase.decay_power, phase.final_lr_fraction, budget)
        first = i * SMOKE_STEPS + 1
        expected = phase.lr * factor(0)
        assert scalars["train/lr"][first] == pytest.approx(expected, rel=1e-6), (path.stem, i)  # float32 in the log
