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


def test_nvidia_compatible_decay():
    """The default power (and the recipe's default ``decay_power``) with ``decay_from_start`` follows NVIDIA's
    ``PolyWarmUpScheduler(degree=0.5)`` after warm-up: base_lr * (1 - n / T) ** 0.5 for the n-th update, written out
    here with its own literal degree (a drop at the warmup end)."""
    from bert_ds.recipe import PhaseConfig

    total, fraction = 7038, 0.2843
    warmup = int(fraction * total)
    for f in (warmup_poly_decay(total_steps=total, warmup_fraction=fraction, decay_from_start=True),
              warmup_poly_decay(total, fraction, PhaseConfig.__dataclass_fields__["decay_power"].default,
                                decay_from_start=True)):
        assert f(warmup - 1) == pytest.approx(1.0)
        decay = [f(step) for step in range(warmup, total - 1)]
        nvidia = [(1.0 - (step + 1) / total) ** 0.5 for step in range(warmup, total - 1)]
        assert decay == pytest.approx(nvidia, rel=1e-12)


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
