"""warmup_poly_decay: values at key steps, LambdaLR compatibility, argument checks."""

from __future__ import annotations

import pytest
import torch

from bert_ds.optim import warmup_poly_decay


def test_key_steps():
    f = warmup_poly_decay(total_steps=100, warmup_fraction=0.1, power=0.5)
    assert f(0) == pytest.approx(0.1)  # first update: 1/10 of the peak
    assert f(4) == pytest.approx(0.5)
    assert f(9) == pytest.approx(1.0)  # the 10th update is the peak
    assert f(10) == pytest.approx((89 / 90) ** 0.5)
    assert f(54) == pytest.approx((45 / 90) ** 0.5)
    assert f(98) == pytest.approx((1 / 90) ** 0.5)
    assert f(99) == 0.0 and f(500) == 0.0  # the phase ends at 0


def test_power_one_is_linear_and_no_warmup():
    f = warmup_poly_decay(total_steps=10, warmup_fraction=0.0, power=1.0)
    assert [round(f(s), 6) for s in range(10)] == [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0]


def test_nvidia_poly_key_steps():
    """``nvidia_poly`` at hand-computed points: warm-up ``x / f`` while ``x = n / S < f`` (not over ``int(f * S)``
    steps), then ``(1 - x) ** p`` from the phase start, 0 at the last update."""
    from bert_ds.optim.schedule import nvidia_poly_warmup

    f = nvidia_poly_warmup(total_steps=100, warmup_fraction=0.105, power=0.5)
    assert f(0) == pytest.approx(0.01 / 0.105)  # update 1
    assert f(9) == pytest.approx(0.10 / 0.105)  # update 10: x = 0.10 < 0.105, still warming up
    assert f(10) == pytest.approx(0.89 ** 0.5)  # update 11: x = 0.11, the drop from ~0.95 to 0.943
    assert f(49) == pytest.approx(0.5 ** 0.5)
    assert f(99) == 0.0 and f(150) == 0.0
    assert warmup_poly_decay(100, 0.105, 0.5)(10) == pytest.approx((89 / 90) ** 0.5)  # the formula it replaces


def test_composer_linear_key_steps():
    from bert_ds.optim.schedule import composer_linear_warmup

    f = composer_linear_warmup(total_steps=100, warmup_fraction=0.1, final_fraction=0.02)
    assert f(0) == 0.0 and f(5) == pytest.approx(0.5)  # steps done, not the update's number: the first lr is 0
    assert f(10) == 1.0 and f(55) == pytest.approx(1 - 0.98 * 0.5) and f(100) == pytest.approx(0.02)
    assert f(1000) == pytest.approx(0.02)  # the floor holds past the end


class _Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def test_time_budget_on_a_fake_clock():
    """A 2-hour budget with 10% warm-up: the lr follows the agreed hours, whatever the step count; the budget is
    spent at 2 h; the state round-trips and the clock of the next process counts on from it."""
    from torch.optim.lr_scheduler import LambdaLR

    from bert_ds.optim.schedule import TimeBudget, apply_elapsed, time_linear_warmup

    clock = _Clock()
    budget = TimeBudget(2.0, clock)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = LambdaLR(opt, time_linear_warmup(budget, 0.1))
    assert opt.param_groups[0]["lr"] == 0.0  # no time trained yet
    clock.t += 0.1 * 3600  # 0.1 h: half the warm-up
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0  # the scheduler alone does not read the clock ...
    apply_elapsed(sched, budget, budget.read())  # ... the agreed reading sets the next lr
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4) and sched.get_last_lr() == [opt.param_groups[0]["lr"]]
    clock.t += 1.0 * 3600  # 1.1 h: half-way down the decay
    apply_elapsed(sched, budget, budget.read())
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.9 / 1.8) and not budget.exhausted
    state = budget.state_dict()
    later = _Clock()
    later.t = 9e9
    resumed = TimeBudget(2.0, later)  # the next process: a new budget and a new schedule reading it
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = LambdaLR(opt, time_linear_warmup(resumed, 0.1))
    resumed.load_state_dict(state)
    assert resumed.read() == pytest.approx(1.1 * 3600) and resumed.agreed_s == pytest.approx(1.1 * 3600)
    apply_elapsed(sched, resumed, resumed.agreed_s)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.9 / 1.8)
    later.t += 0.9 * 3600
    apply_elapsed(sched, resumed, resumed.read())
    assert resumed.exhausted and opt.param_groups[0]["lr"] == 0.0


@pytest.mark.parametrize("hours", [0, -1.0, True, "24", float("nan")])
def test_time_budget_refuses_bad_hours(hours):
    from bert_ds.optim.schedule import TimeBudget

    with pytest.raises(ValueError, match="budget_hours"):
        TimeBudget(hours)


def test_schedule_names_agree_with_the_recipe():
    from bert_ds.optim.schedule import SCHEDULES, lr_lambda
    from bert_ds.recipe import _SCHEDULES

    assert SCHEDULES == _SCHEDULES
    with pytest.raises(ValueError, match="needs a TimeBudget"):
        lr_lambda("time_linear", 10, 0.1, 1.0)
    with pytest.raises(ValueError, match="choose one of"):
        lr_lambda("cosine", 10, 0.1, 1.0)


def test_lambda_lr_drives_optimizer_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=6e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_poly_decay(20, 0.25, 0.5))
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(6e-3 / 5) and lrs[4] == pytest.approx(6e-3) and lrs[-1] == 0.0
    assert lrs.index(max(lrs)) == 4


@pytest.mark.parametrize("kw", [dict(total_steps=0, warmup_fraction=0.1), dict(total_steps=10, warmup_fraction=1.5),
                                dict(total_steps=10, warmup_fraction=0.1, power=0.0),
                                dict(total_steps=10.0, warmup_fraction=0.1)])
def test_bad_arguments(kw):
    with pytest.raises(ValueError):
        warmup_poly_decay(**kw)


def _phase(peak: float, steps: int = 10, taken: int = 0):
    from torch.optim.lr_scheduler import LambdaLR

    opt = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                           {"params": [torch.nn.Parameter(torch.zeros(3))]}], lr=peak)  # two groups
    scheduler = LambdaLR(opt, warmup_poly_decay(steps, 0.2))
    for _ in range(taken):
        opt.step()
        scheduler.step()
    return opt, scheduler


def test_the_schedule_state_survives_a_load_through_its_one_owner():
    """Resume: a restored LambdaLR leaves the groups at the fresh schedule's first lr until sync; a hand-off keeps the
    new phase's lrs across the old phase's optimizer state; a changed peak continues from the same position."""
    from bert_ds.optim.schedule import keep_group_lrs, rescale_peak, sync_groups_to_schedule

    saved_opt, saved = _phase(1e-3, taken=4)
    opt, fresh = _phase(1e-3)
    fresh.load_state_dict(saved.state_dict())
    assert [g["lr"] for g in opt.param_groups] != saved.get_last_lr()  # what the sync is for
    sync_groups_to_schedule(fresh)
    assert [g["lr"] for g in opt.param_groups] == saved.get_last_lr() == [g["lr"] for g in saved_opt.param_groups]

    phase2, _ = _phase(4e-3)
    with keep_group_lrs(phase2):
        phase2.load_state_dict(saved_opt.state_dict())
    assert [g["lr"] for g in phase2.param_groups] == [4e-3 / 2, 4e-3 / 2]  # warm-up step 1 of 2

    rescale_peak(fresh, 5e-4)
    expected = 5e-4 * warmup_poly_decay(10, 0.2)(4)
    assert [g["lr"] for g in opt.param_groups] == [expected, expected] == fresh.get_last_lr()
    opt.step()
    fresh.step()
    assert fresh.get_last_lr() == [5e-4 * warmup_poly_decay(10, 0.2)(5)] * 2
