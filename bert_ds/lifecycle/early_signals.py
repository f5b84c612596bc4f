"""A pre-emption signal that reaches a rank while it is still importing torch and DeepSpeed (seconds, before ``main``
arms :class:`bert_ds.lifecycle.preemption.Preemption`) is recorded, not fatal: ``bert_ds/runtime/pretrain.py`` started
as a script or with ``python -m`` (what the ``deepspeed`` launcher, ``srun`` in ``slurm/`` and ``mpirun`` run) calls
:func:`catch` before its first heavy import, and ``Preemption`` treats a signal :func:`caught` as asked for. Slurm's
TERM-only pre-emption signals every process of a step at once, a rank just started included. Imports nothing."""

from __future__ import annotations

import signal

__all__ = ["catch", "caught"]

_caught: list[int] = []


def _record(signum, frame) -> None:
    _caught.append(signum)


def catch() -> None:
    """From now on SIGTERM and SIGUSR1 are recorded instead of ending the process."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _record)


def caught() -> int | None:
    """The last pre-emption signal recorded since :func:`catch`, or None."""
    return _caught[-1] if _caught else None
