"""The phase hand-off's optimizer step count (recipe ``handoff.optimizer_step``): ``continue`` makes phase 2's updates
those of one uninterrupted optimizer; ``reset`` (NVIDIA's hand-off, the default) restarts Adam's bias correction over
the carried moments, which scales the first updates by sqrt(1 - b2^t) / (1 - b1^t) (0.15-0.32 over the first 100)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bert_ds.checkpoint.layout import RUN_STATE_NAME
from bert_ds.checkpoint.restore import Handoff
from bert_ds.deepspeed_internals import MODEL_STATES_NAME
from tests.helpers.runs import run_pretrain, write_recipe

BETAS, LR, WD = (0.9, 0.999), 1e-4, 0.01  # bert_base_paper's Adam settings; one lr for both phases here
PHASE1_STEPS = 300


class _Stage0Engine:
    """What ``Handoff.load_moments`` asks of a DeepSpeed engine without ZeRO: the stage and the client optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def zero_optimization_stage(self) -> int:
        return 0


def _gradients(steps: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(256, generator=generator, dtype=torch.float64) for _ in range(steps)]


def _adamw(weight: torch.Tensor) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
    param = torch.nn.Parameter(weight.clone())
    return param, torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=1e-6, weight_decay=WD)


def _step(param: torch.nn.Parameter, optimizer: torch.optim.Optimizer, grad: torch.Tensor) -> torch.Tensor:
    """One update; returns its Adam part (the change less AdamW's decoupled decay ``lr * wd * w``)."""
    before = param.detach().clone()
    param.grad = grad.clone()
    optimizer.step()
    return param.detach() - before * (1 - LR * WD)


@pytest.fixture()
def phase1(tmp_path):
    """An AdamW trained ``PHASE1_STEPS`` updates and saved as a stage-0 checkpoint tag: (tag dir, param, optimizer)."""
    param, optimizer = _adamw(torch.randn(256, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    for grad in _gradients(PHASE1_STEPS, seed=1):
        _step(param, optimizer, grad)
    tag = tmp_path / "phase1-step000300"
    tag.mkdir()
    torch.save({"optimizer": optimizer.state_dict()}, tag / MODEL_STATES_NAME)
    return tag, param, optimizer


def _phase2(tag, weight: torch.Tensor, optimizer_step: str):
    param, optimizer = _adamw(weight)
    Handoff(ckpt_dir=tag.parent, tag=tag.name, run_state={"world_size": 1}).load_moments(
        _Stage0Engine(optimizer), optimizer_step)
    return param, optimizer


def test_continue_is_one_uninterrupted_optimizer(phase1):
    tag, straight_param, straight = phase1
    param, optimizer = _phase2(tag, straight_param.detach(), "continue")
    assert int(optimizer.state[param]["step"]) == PHASE1_STEPS
    for grad in _gradients(5, seed=2):
        assert torch.equal(_step(param, optimizer, grad), _step(straight_param, straight, grad))
    assert torch.equal(param.detach(), straight_param.detach())


def test_reset_scales_the_first_updates_by_the_restarted_bias_correction(phase1):
    """Fed the same gradients, the two optimizers hold the same moments (Adam's moments do not depend on the step
    count); only bias correction differs, so reset / continued = sqrt(1 - b2^t) / (1 - b1^t) at update t of phase 2
    (times (1 - b2^(300 + t)) ** -0.5 / (1 - b1^(300 + t)) ** -1 for the continued count, 1.0136 at t = 1 here)."""
    tag, straight_param, _ = phase1
    weight = straight_param.detach()
    reset_param, reset = _phase2(tag, weight, "reset")
    cont_param, cont = _phase2(tag, weight, "continue")
    assert int(reset.state[reset_param]["step"]) == 0
    ratios = []
    for t, grad in enumerate(_gradients(100, seed=3), start=1):
        reset_update, cont_update = _step(reset_param, reset, grad), _step(cont_param, cont, grad)
        ratio = (reset_update / cont_update).median().item()
        n = PHASE1_STEPS + t

        def corrected(k: int) -> float:
            return math.sqrt(1 - BETAS[1] ** k) / (1 - BETAS[0] ** k)

        assert ratio == pytest.approx(corrected(t) / corrected(n), rel=1e-3), t
        ratios.append(corrected(t))  # against an optimizer that has run long enough (the paper's 900,000 updates)
    assert ratios[0] == pytest.approx(0.3162, abs=1e-4)
    assert 0.15 < min(ratios) < 0.16 and max(ratios) == ratios[0] < 0.32


def test_only_the_paper_recipe_continues_the_count():
    from bert_ds.recipe import load_recipe
    from tests.test_recipes import CONFIGS

    recipes = {p.stem: load_recipe(p) for p in CONFIGS}
    assert recipes["bert_base_paper"].handoff.optimizer_step == "continue"
    # NVIDIA's hand-off (their run_pretraining.py --phase2) restarts the count: the LAMB recipes keep the default.
    assert {name for name, r in recipes.items() if r.handoff.optimizer_step == "continue"} == {"bert_base_paper"}


@pytest.mark.e2e
def test_continue_through_the_engine_keeps_the_zero_step_count(synthetic_data, tmp_path):
    """Two real ZeRO-2 ranks, both phases, ``handoff.optimizer_step: continue``: 2 steps into phase 2 the optimizer
    has counted phase 1's 4 updates + 2 (``reset``, tests/engine/test_engine_resume.py, counts 2)."""
    recipe = write_recipe(tmp_path / "recipe.json", handoff={"optimizer_step": "continue"})
    run = tmp_path / "run"
    run_pretrain(["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--output", str(run)], nprocs=2)
    tag = run / "checkpoints" / "phase2-step000002"
    assert json.loads((tag / RUN_STATE_NAME).read_text())["recipe"]["handoff"] == {"optimizer_step": "continue"}
    files = sorted(tag.glob("zero_pp_rank_*_optim_states.pt"))
    assert len(files) == 2
    for f in files:
        groups = torch.load(f, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
        assert groups and all(int(group["step"]) == 6 for group in groups)
