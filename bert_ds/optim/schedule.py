"""Learning-rate schedules as ``LambdaLR`` factors: linear warmup, then polynomial decay to 0 over the phase.

``torch.optim.lr_scheduler.LambdaLR(opt, warmup_poly_decay(...))`` or DeepSpeed's ``lr_scheduler=`` argument of
``deepspeed.initialize`` (the engine calls ``scheduler.step()`` after every optimizer step). The factor takes
``last_epoch`` = optimizer steps already taken, so the n-th update (n = step + 1) uses::

    n / W                        for n <= W          (W = floor(warmup_fraction * total_steps))
    ((T - n) / (T - W)) ** p     for W < n <= T       (0 at the last step and after)

NVIDIA DeepLearningExamples BERT (``schedulers.PolyWarmUpScheduler``, degree 0.5) instead decays
``(1 - n / T) ** p`` from the phase start, so its lr drops at the end of warmup; ``decay_from_start=True``
reproduces it.

This module also owns the schedule's state across a load (resume, phase hand-off, a changed peak): what the optimizer's
param groups hold after one (:func:`sync_groups_to_schedule`, :func:`keep_group_lrs`, :func:`rescale_peak`), so no
other module writes ``group["lr"]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["NVIDIA_BERT_POWER", "keep_group_lrs", "rescale_peak", "sync_groups_to_schedule", "warmup_poly_decay"]

NVIDIA_BERT_POWER = 0.5
"""NVIDIA DeepLearningExamples BERT ``PolyWarmUpScheduler(degree=0.5)``."""


def warmup_poly_decay(total_steps: int, warmup_fraction: float, power: float = NVIDIA_BERT_POWER,
                      decay_from_start: bool = False) -> Callable[[int], float]:
    """Return ``f(step) -> lr multiplier`` for a phase of ``total_steps`` optimizer steps."""
    if not isinstance(total_steps, int) or isinstance(total_steps, bool) or total_steps < 1:
        raise ValueError(f"warmup_poly_decay: total_steps must be a positive integer, got {total_steps!r}")
    if not 0.0 <= warmup_fraction <= 1.0:
        raise ValueError(f"warmup_poly_decay: warmup_fraction must be in [0, 1], got {warmup_fraction!r}")
    if not power > 0.0:
        raise ValueError(f"warmup_poly_decay: power must be > 0, got {power!r}")
    warmup_steps = int(warmup_fraction * total_steps)

    def factor(step: int) -> float:
        n = step + 1  # the update this lr is used for, 1-based
        if n <= warmup_steps:
            return n / warmup_steps
        if n >= total_steps:
            return 0.0
        if decay_from_start:
            return (1.0 - n / total_steps) ** power
        return ((total_steps - n) / (total_steps - warmup_steps)) ** power

    return factor


def sync_groups_to_schedule(scheduler) -> None:
    """Every param group's lr := the schedule's current value. ``LambdaLR.load_state_dict`` restores the step count
    but leaves the groups at the fresh schedule's first lr until the next ``scheduler.step()``: the first resumed step
    must use the saved schedule's next lr."""
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr


@contextlib.contextmanager
def keep_group_lrs(optimizer) -> Iterator[None]:
    """Loading another phase's optimizer state (its moments) inside the block keeps this phase's lrs: the new phase's
    schedule, not the old phase's last lr (``optimizer.load_state_dict`` replaces the groups' hyperparameters)."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    yield
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def rescale_peak(scheduler, peak: float) -> None:
    """A schedule restored with another peak lr (``base_lrs``) continues at ``peak`` from the same position (warm-up or
    decay step kept): the groups' lr, ``initial_lr`` and the scheduler's last lr all follow."""
    scheduler.base_lrs = [peak for _ in scheduler.base_lrs]
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    scheduler._last_lr = [peak * factor for _ in scheduler.base_lrs]
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler._last_lr, strict=True):
        group["lr"] = lr
        group["initial_lr"] = peak
