"""Each shipped GPU recipe's lr, at every step of every phase, against its source's schedule transcribed here.

The lr comes from the scheduler object the engine builds (``bert_ds.runtime.engine.phase_scheduler``), stepped once per
optimizer step as DeepSpeed steps it, with a fresh schedule per phase as the trainer builds one at each hand-off. The
source formulas are written out from the upstream files named beside them, not imported from bert_ds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bert_ds.optim.schedule import apply_elapsed
from bert_ds.recipe import load_recipe
from bert_ds.runtime.engine import phase_scheduler

CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"
CPU_RECIPES = {"tiny_cpu", "demo_cpu", "demo_warmup_cpu"}
NVIDIA_RECIPES = ("bert_base", "bert_large", "bert_base_8gpu")
SOURCE_TESTED = {*NVIDIA_RECIPES, "bert_base_mosaic", "bert_large_24h", "bert_base_paper"}


def _lrs(phase, steps: int) -> list[float]:
    """The lr of updates 1..steps, as the optimizer's group holds it when each update runs."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=phase.lr)
    scheduler, budget = phase_scheduler(opt, phase)
    assert budget is None
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def test_every_gpu_recipe_has_a_source_test():
    shipped = {p.stem for p in CONFIGS.glob("*.json")} - CPU_RECIPES
    assert shipped == SOURCE_TESTED, shipped ^ SOURCE_TESTED


# NVIDIA DeepLearningExamples, PyTorch/LanguageModeling/BERT/schedulers.py, PolyWarmUpScheduler.get_lr:
#     progress = last_epoch / total_steps
#     lr = base_lr * progress / warmup if progress < warmup else base_lr * (1.0 - progress) ** degree   (degree 0.5)
# run_pretraining.py steps it before each optimizer step, with last_epoch = param_groups[0]['step'] + 1 (the n-th
# update, n from 1); for phase 2 (--phase2 --resume_from_checkpoint) it zeroes every group's 'step' and builds the
# scheduler with phase 2's --max_steps 1563 and --warmup_proportion 0.128, so phase 2 counts n from 1 again.
def _nvidia(base_lr: float, n: int, total_steps: int, warmup: float, degree: float = 0.5) -> float:
    progress = n / total_steps
    if progress < warmup:
        return base_lr * progress / warmup
    return base_lr * (1.0 - progress) ** degree


@pytest.mark.parametrize("name", NVIDIA_RECIPES)
def test_nvidia_recipes_follow_poly_warmup_scheduler(name):
    recipe = load_recipe(CONFIGS / f"{name}.json")
    assert len(recipe.phases) == 2
    for i, phase in enumerate(recipe.phases):
        assert phase.decay_power == 0.5 and phase.schedule_steps is None
        ours = _lrs(phase, phase.steps)
        source = [_nvidia(phase.lr, n, phase.steps, phase.warmup_fraction) for n in range(1, phase.steps + 1)]
        bad = [n for n, (a, b) in enumerate(zip(ours, source, strict=True), 1)
               if not math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18)]
        assert not bad, (name, i, bad[:3], [(ours[n - 1], source[n - 1]) for n in bad[:3]])


def test_nvidia_lr_drops_at_the_end_of_warmup():
    """The difference the issue measured: right after warm-up NVIDIA's lr is 5.08e-3, not the peak 6e-3."""
    phase = load_recipe(CONFIGS / "bert_large.json").phases[0]
    lrs = _lrs(phase, 2002)
    assert lrs[1999] == pytest.approx(6e-3 * 2000 / (0.2843 * 7038), rel=1e-12)  # update 2000: still warming up
    assert lrs[2000] == pytest.approx(6e-3 * (1 - 2001 / 7038) ** 0.5, rel=1e-12)  # update 2001
    assert 5.07e-3 < lrs[2000] < 5.08e-3


# mosaicml/examples, examples/benchmarks/bert/yamls/main/mosaic-bert-base-uncased.yaml:
#     scheduler: linear_decay_with_warmup, t_warmup: 0.06dur, alpha_f: 0.02; max_duration: 286720000sp;
#     global_train_batch_size: 4096
# composer/optim/scheduler.py, LinearWithWarmupScheduler.__call__ (alpha_i 1.0) with _convert_time
# (t_warmup = int(0.06 * max_duration) samples) and LinearScheduler(alpha_i=0, alpha_f=1, t_max=t_warmup) for the
# warm-up; Composer's trainer steps the scheduler after each batch, so the n-th batch sees (n - 1) batches done.
MOSAIC_SAMPLES, MOSAIC_BATCH = 286_720_000, 4096


def _composer(base_lr: float, n: int, alpha_f: float = 0.02) -> float:
    t = (n - 1) * MOSAIC_BATCH
    t_warmup = int(0.06 * MOSAIC_SAMPLES)
    if t < t_warmup:
        return base_lr * min(1.0, t / t_warmup)
    frac = min(1.0, (t - t_warmup) / (MOSAIC_SAMPLES - t_warmup))
    return base_lr * (1.0 + frac * (alpha_f - 1.0))


def test_mosaic_recipe_follows_linear_with_warmup_scheduler():
    recipe = load_recipe(CONFIGS / "bert_base_mosaic.json")
    (phase,) = recipe.phases
    assert phase.steps * phase.global_batch_size == MOSAIC_SAMPLES and phase.global_batch_size == MOSAIC_BATCH
    ours = _lrs(phase, phase.steps)
    source = [_composer(phase.lr, n) for n in range(1, phase.steps + 1)]
    bad = [n for n, (a, b) in enumerate(zip(ours, source, strict=True), 1)
           if not math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18)]
    assert not bad, (bad[:3], [(ours[n - 1], source[n - 1]) for n in bad[:3]])
    assert ours[0] == 0.0 and ours[-1] == pytest.approx(0.02 * 5e-4, rel=1e-3)


def test_mosaic_recipe_fields_are_the_yaml_values():
    """The yaml's settings (and composer's DecoupledAdamW): lr 5e-4, betas 0.9/0.98, eps 1e-6, weight decay 1e-5
    scaled by lr / initial_lr (torch AdamW's lr * weight_decay with 0.02 = 1e-5 / 5e-4), 30% dynamic masking, MLM
    only, seq 128, batch 4096, attention dropout 0, bf16, no gradient clipping (no GradientClipping algorithm),
    seed 17."""
    r = load_recipe(CONFIGS / "bert_base_mosaic.json")
    (p,) = r.phases
    assert (r.optimizer.name, r.optimizer.betas, r.optimizer.eps, p.lr) == ("adamw", (0.9, 0.98), 1e-6, 5e-4)
    assert r.optimizer.weight_decay == pytest.approx(1e-5 / 5e-4, rel=1e-12)
    assert (p.seq_len, p.masked_lm_prob, p.dynamic_masking, r.nsp) == (128, 0.3, True, False)
    assert p.max_predictions >= math.ceil(0.3 * p.seq_len)  # room for every 30% mask: no cap
    assert r.model_config(30522).attention_probs_dropout_prob == 0.0
    assert (r.deepspeed.precision, r.deepspeed.gradient_clipping, r.seed) == ("bf16", 0.0, 17)


def test_adamw_decay_equals_composer_decoupled_decay():
    """composer/optim/decoupled_weight_decay.py, DecoupledAdamW.adamw: param.mul_(1 - (lr / initial_lr) *
    weight_decay) before the Adam update. bert_ds's adamw with weight_decay 0.02 at peak 5e-4 shrinks by the same
    factor at every point of the schedule."""
    from bert_ds.optim import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, bias=False, dtype=torch.float64)
    w0 = model.weight.detach().clone()
    grad = torch.randn_like(w0)
    opt = build_optimizer("adamw", model, 5e-4, weight_decay=0.02, betas=(0.9, 0.98), eps=1e-6)
    factor = 0.37  # somewhere in the schedule
    for g in opt.param_groups:
        g["lr"] = 5e-4 * factor
    model.weight.grad = grad.clone()
    opt.step()
    # Composer's step, transcribed (step 1, bias corrections 1 - beta ** 1):
    lr, wd, (b1, b2), eps = 5e-4 * factor, 1e-5, (0.9, 0.98), 1e-6
    p = w0 * (1 - (lr / 5e-4) * wd)
    m, v = (1 - b1) * grad, (1 - b2) * grad * grad
    denom = (v.sqrt() / math.sqrt(1 - b2)) + eps
    p = p - (lr / (1 - b1)) * m / denom
    torch.testing.assert_close(model.weight.detach(), p, rtol=0, atol=1e-15)


# IntelLabs/academic-budget-bert, pretraining/schedules.py: TimeScheduler.get_correct_position = hours since
# exp_start_marker, get_total = --total_training_time, get_total_warmup = total * warmup_proportion; LinearCurve:
#     warm-up: position / total_warmup
#     decay:   max(0.0, total - current) / max(1.0, total - total_warmup)
# README's BERT-large command: --lr_schedule time --curve linear --warmup_proportion 0.06 --total_training_time 24.0
# --gradient_clipping 0.0; run_pretraining.py saves get_now() - exp_start_marker in the checkpoint ("exp_time_marker")
# and sets exp_start_marker = get_now() - that on resume.
def _academic(base_lr: float, hours: float, total: float = 24.0, warmup_proportion: float = 0.06) -> float:
    total_warmup = total * warmup_proportion
    if hours < total_warmup:
        return base_lr * hours / total_warmup
    return base_lr * max(0.0, total - hours) / max(1.0, total - total_warmup)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _time_run(phase, clock: FakeClock, step_s: float, steps: int, state: dict | None = None):
    """Steps as the trainer takes them: the update, the scheduler's step inside it, then the agreed elapsed time
    sets the next update's lr. Returns (lrs used, elapsed hours at each update, budget)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=phase.lr)
    scheduler, budget = phase_scheduler(opt, phase, clock=clock)
    if state is not None:  # resume, as the trainer's _restore does it
        budget.load_state_dict(state)
        apply_elapsed(scheduler, budget, budget.agreed_s)
    lrs, hours = [], []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        hours.append(budget.agreed_s / 3600)
        clock.t += step_s
        opt.step()
        scheduler.step()
        apply_elapsed(scheduler, budget, budget.read())
    return lrs, hours, budget


def test_24h_recipe_follows_the_time_scheduler():
    recipe = load_recipe(CONFIGS / "bert_large_24h.json")
    (phase,) = recipe.phases
    assert (phase.schedule, phase.budget_hours, phase.warmup_fraction) == ("time_linear", 24.0, 0.06)
    assert recipe.deepspeed.gradient_clipping == 0.0 and not recipe.nsp
    step_s = 3.3  # a step every 3.3 s of training time: 26,182 steps in 24 h
    clock = FakeClock()
    lrs, hours, budget = _time_run(phase, clock, step_s, 26_300)
    source = [_academic(phase.lr, h) for h in hours]
    bad = [i for i, (a, b) in enumerate(zip(lrs, source, strict=True)) if not math.isclose(a, b, rel_tol=1e-12,
                                                                                            abs_tol=1e-18)]
    assert not bad, (bad[:3], [(lrs[i], source[i]) for i in bad[:3]])
    assert max(lrs) == pytest.approx(phase.lr, rel=1e-3) and lrs[0] == 0.0
    spent = [h >= 24.0 for h in hours]
    first = spent.index(True)
    assert budget.exhausted and not any(spent[:first]) and first == math.ceil(24 * 3600 / step_s)
    assert phase.steps > 2 * first  # the step cap is not what ends a 24-hour run at this speed


def test_time_budget_survives_a_save_and_load():
    """Stop at 7.5 h, save the schedule state through JSON (run_state.json), resume on a clock that starts
    elsewhere: the lrs from there on are those of the uninterrupted run."""
    (phase,) = load_recipe(CONFIGS / "bert_large_24h.json").phases
    step_s = 30.0
    whole, _, _ = _time_run(phase, FakeClock(), step_s, 1800)
    first_part, _, budget = _time_run(phase, FakeClock(), step_s, 900)
    state = json.loads(json.dumps(budget.state_dict()))
    assert state["elapsed_s"] == pytest.approx(900 * step_s)
    resumed, hours, _ = _time_run(phase, FakeClock(5e6), step_s, 900, state=state)
    assert hours[0] == pytest.approx(7.5)
    assert first_part + resumed == pytest.approx(whole, rel=1e-12, abs=1e-18)
    fresh, _, _ = _time_run(phase, FakeClock(5e6), step_s, 900)  # without the state, the schedule starts over
    assert fresh != resumed


# google-research/bert, optimization.py create_optimizer: polynomial_decay(init_lr, global_step, num_train_steps,
# end_learning_rate=0.0, power=1.0) from step 0, and while global_step < num_warmup_steps
# init_lr * global_step / num_warmup_steps (global_step counts updates done, from 0). The paper's recipe: 1e-4,
# 1,000,000 steps, 10,000 warm-up. Declared deviations (docs/recipes.md): bert_ds's warm-up is one update ahead and
# its decay starts from the peak at the warm-up's end, at most 1% of the peak above Google's.
def _google(t: int, init_lr: float = 1e-4, total: int = 1_000_000, warmup: int = 10_000) -> float:
    if t < warmup:
        return init_lr * t / warmup
    return init_lr * (1.0 - min(t, total) / total)


def test_paper_recipe_is_googles_schedule_within_its_declared_deviation():
    from bert_ds.optim.schedule import lr_lambda

    p1, p2 = load_recipe(CONFIGS / "bert_base_paper.json").phases
    f1 = lr_lambda(p1.schedule, p1.schedule_steps, p1.warmup_fraction, p1.decay_power)
    f2 = lr_lambda(p2.schedule, p2.steps, p2.warmup_fraction, p2.decay_power)
    ours = [p1.lr * f1(s) for s in range(p1.steps)] + [p2.lr * f2(s) for s in range(p2.steps)]
    assert _lrs(p1, 20_000) == ours[:20_000] and _lrs(p2, 100) == ours[p1.steps:p1.steps + 100]  # the object agrees
    google = [_google(t) for t in range(len(ours) + 1)]
    assert ours[:9_999] == pytest.approx(google[1:10_000], rel=1e-12)  # warm-up: one update ahead
    gaps = [ours[t] - google[t] for t in range(9_999, len(ours))]  # from update 10,000 (ours: the peak)
    assert 0.0 <= max(gaps) <= 0.01 * 1e-4 * (1 + 1e-9) and min(gaps) > -1e-10 * 1.01


def test_the_recipes_doc_names_every_schedule_and_deviation():
    """docs/recipes.md's recipe table gives each GPU recipe the schedule its file names, and its deviation table has a
    row for every GPU recipe (each differs from its source somewhere)."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text(encoding="utf-8")
    listed = dict(re.findall(r"^\| `(\w+)` \| \w+ \| \w+ \| `(\w+)` \|", text, flags=re.M))
    expected = {name: load_recipe(CONFIGS / f"{name}.json").phases[0].schedule for name in SOURCE_TESTED}
    assert listed == expected
    for name in SOURCE_TESTED:
        assert {p.schedule for p in load_recipe(CONFIGS / f"{name}.json").phases} == {expected[name]}
    deviations = text[text.index("## Deviations from the sources"):]
    first_cells = re.findall(r"^\| ([^|]+) \|", deviations, flags=re.M)
    named = {n for cell in first_cells for n in re.findall(r"`(\w+)`", cell)}
    assert SOURCE_TESTED <= named, SOURCE_TESTED - named
