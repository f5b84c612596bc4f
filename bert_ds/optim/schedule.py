"""Learning-rate schedules as ``LambdaLR`` factors, one per source formula; the factor takes ``last_epoch`` = optimizer
steps already taken (``step``), so the n-th update of a phase uses ``f(n - 1)``. ``S`` is the schedule length in steps.

- ``warmup_poly`` (bert_ds's own): ``n / W`` for ``n <= W`` (``W = int(f * S)``), then ``((S - n) / (S - W)) ** p``.
- ``nvidia_poly``: NVIDIA DeepLearningExamples BERT ``schedulers.PolyWarmUpScheduler``: with ``x = n / S``, ``x / f``
  while ``x < f``, then ``(1 - x) ** p``: the decay runs from the phase start, so the lr drops at the end of warm-up.
- ``composer_linear``: Composer's ``LinearWithWarmupScheduler`` (MosaicBERT) in steps, ``t = n - 1`` steps done and
  ``W = int(f * S)``: ``t / W`` while ``t < W``, then ``1 - (1 - a) * min(1, (t - W) / (S - W))``, down to ``a``.
- ``time_linear``: academic-budget-bert's ``TimeScheduler`` + ``LinearCurve``: the same warm-up and linear decay to 0,
  over elapsed training hours against a budget (:class:`TimeBudget`) instead of steps.

This module also owns the schedule's state across a load (resume, phase hand-off, a changed peak, a time budget's
elapsed hours): what the optimizer's param groups hold after one (:func:`sync_groups_to_schedule`,
:func:`keep_group_lrs`, :func:`rescale_peak`, :func:`apply_elapsed`), so no other module writes ``group["lr"]``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from bert_ds.errors import BadInput

__all__ = ["NVIDIA_BERT_POWER", "SCHEDULES", "TimeBudget", "apply_elapsed", "composer_linear_warmup", "keep_group_lrs",
           "lr_lambda", "nvidia_poly_warmup", "rescale_peak", "sync_groups_to_schedule", "time_linear_warmup",
           "warmup_poly_decay"]

SCHEDULES = ("warmup_poly", "nvidia_poly", "composer_linear", "time_linear")
"""The schedule formulas a phase can name (``phases[i].schedule``); see the module docstring."""

NVIDIA_BERT_POWER = 0.5
"""NVIDIA DeepLearningExamples BERT ``PolyWarmUpScheduler(degree=0.5)``."""


def _check(name: str, total_steps: int, warmup_fraction: float) -> None:
    if not isinstance(total_steps, int) or isinstance(total_steps, bool) or total_steps < 1:
        raise BadInput(f"{name}: total_steps must be a positive integer, got {total_steps!r}")
    if not 0.0 <= warmup_fraction <= 1.0:
        raise BadInput(f"{name}: warmup_fraction must be in [0, 1], got {warmup_fraction!r}")


def warmup_poly_decay(total_steps: int, warmup_fraction: float, power: float = NVIDIA_BERT_POWER
                      ) -> Callable[[int], float]:
    """``warmup_poly``: return ``f(step) -> lr multiplier`` for a schedule of ``total_steps`` optimizer steps."""
    _check("warmup_poly_decay", total_steps, warmup_fraction)
    if not power > 0.0:
        raise BadInput(f"warmup_poly_decay: power must be > 0, got {power!r}")
    warmup_steps = int(warmup_fraction * total_steps)

    def factor(step: int) -> float:
        n = step + 1  # the update this lr is used for, 1-based
        if n <= warmup_steps:
            return n / warmup_steps
        if n >= total_steps:
            return 0.0
        return ((total_steps - n) / (total_steps - warmup_steps)) ** power

    return factor


def nvidia_poly_warmup(total_steps: int, warmup_fraction: float, power: float = NVIDIA_BERT_POWER
                       ) -> Callable[[int], float]:
    """``nvidia_poly``: NVIDIA's ``PolyWarmUpScheduler``, stepped before each optimizer step with ``last_epoch`` =
    the optimizer's step count + 1 (= n); its step count starts at 0 in each phase (phase 2 zeroes it)."""
    _check("nvidia_poly_warmup", total_steps, warmup_fraction)
    if not power > 0.0:
        raise BadInput(f"nvidia_poly_warmup: power must be > 0, got {power!r}")

    def factor(step: int) -> float:
        n = step + 1
        if n >= total_steps:
            return 0.0  # (1 - 1) ** p; the phase ends here
        progress = n / total_steps
        if progress < warmup_fraction:
            return progress / warmup_fraction
        return (1.0 - progress) ** power

    return factor


def composer_linear_warmup(total_steps: int, warmup_fraction: float, final_fraction: float
                           ) -> Callable[[int], float]:
    """``composer_linear``: linear warm-up from 0, then linear decay to ``final_fraction`` of the peak at
    ``total_steps`` (Composer evaluates it with the steps already done, so the first update's lr is 0)."""
    _check("composer_linear_warmup", total_steps, warmup_fraction)
    if not 0.0 <= final_fraction <= 1.0:
        raise BadInput(f"composer_linear_warmup: final_fraction must be in [0, 1], got {final_fraction!r}")
    warmup_steps = int(warmup_fraction * total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        done = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps)) if total_steps > warmup_steps else 0.0
        return 1.0 - (1.0 - final_fraction) * done

    return factor


class TimeBudget:
    """Training time against a wall-clock budget (academic-budget-bert's ``--total_training_time``).

    ``clock`` returns seconds (``time.monotonic``; tests pass a fake one). :meth:`read` is this process's count: the
    seconds since construction (or the last :meth:`load_state_dict`) plus those restored from a checkpoint.
    ``agreed_s`` is what the schedule and the stop use; the trainer sets it at each step boundary from rank 0's
    reading (:func:`apply_elapsed`), so every rank takes the same lr and stops at the same step."""

    def __init__(self, budget_hours: float, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(budget_hours, bool) or not isinstance(budget_hours, int | float) or not budget_hours > 0:
            raise BadInput(f"TimeBudget: budget_hours must be > 0, got {budget_hours!r}")
        self.budget_hours = float(budget_hours)
        self._clock = clock
        self._before_s = 0.0
        self._start = clock()
        self.agreed_s = 0.0

    def read(self) -> float:
        return self._before_s + (self._clock() - self._start)

    @property
    def exhausted(self) -> bool:
        return self.agreed_s >= self.budget_hours * 3600.0

    def state_dict(self) -> dict:
        return {"elapsed_s": self.agreed_s, "budget_hours": self.budget_hours}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's elapsed time; this process's clock counts on from now."""
        self._before_s = float(state["elapsed_s"])
        self._start = self._clock()
        self.agreed_s = self._before_s


def time_linear_warmup(budget: TimeBudget, warmup_fraction: float) -> Callable[[int], float]:
    """``time_linear``: the step is ignored; the lr follows ``budget.agreed_s`` (hours ``h`` of a budget ``B``):
    ``h / (f * B)`` while ``h < f * B``, then ``max(0, B - h) / (B - f * B)``."""
    if not 0.0 <= warmup_fraction < 1.0:
        raise BadInput(f"time_linear_warmup: warmup_fraction must be in [0, 1), got {warmup_fraction!r}")

    def factor(step: int) -> float:
        hours, total = budget.agreed_s / 3600.0, budget.budget_hours
        warmup = total * warmup_fraction
        if hours < warmup:
            return hours / warmup
        return max(0.0, total - hours) / (total - warmup)

    return factor


def lr_lambda(schedule: str, total_steps: int, warmup_fraction: float, power: float, final_fraction: float = 0.0,
              budget: TimeBudget | None = None) -> Callable[[int], float]:
    """The factor for ``schedule`` (one of :data:`SCHEDULES`); ``budget`` is required by ``time_linear`` only."""
    if schedule == "warmup_poly":
        return warmup_poly_decay(total_steps, warmup_fraction, power)
    if schedule == "nvidia_poly":
        return nvidia_poly_warmup(total_steps, warmup_fraction, power)
    if schedule == "composer_linear":
        return composer_linear_warmup(total_steps, warmup_fraction, final_fraction)
    if schedule == "time_linear":
        if budget is None:
            raise BadInput("lr_lambda: schedule 'time_linear' needs a TimeBudget")
        return time_linear_warmup(budget, warmup_fraction)
    raise BadInput(f"lr_lambda: schedule={schedule!r}: choose one of {SCHEDULES}")


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


def apply_elapsed(scheduler, budget: TimeBudget, elapsed_s: float) -> None:
    """Set the agreed elapsed time and the lr it gives to the groups (and the scheduler's last lr): the next update
    uses the lr of ``elapsed_s``, not of the time the scheduler last stepped."""
    budget.agreed_s = float(elapsed_s)
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    scheduler._last_lr = [base * factor for base in scheduler.base_lrs]
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler._last_lr, strict=True):
        group["lr"] = lr
