"""A rank's pre-emption flag: SIGTERM/SIGUSR1 only set it; the step loop checkpoints at the next step boundary and
the rank exits 75 (:class:`bert_ds.exit_codes.ExitCode`).

A :class:`Preemption` does nothing when built; :meth:`Preemption.arm` installs the handlers, takes over a signal
:mod:`bert_ds.lifecycle.early_signals` recorded while the rank was still importing, and starts the runner watch
(:mod:`bert_ds.lifecycle.runner_watch`: SIGTERM to the ``deepspeed`` runner alone is not forwarded to the ranks).
:meth:`Preemption.disarm` ignores both signals once the exit code is decided. The loop asks
:meth:`Preemption.agreed` (one all-reduce) so every rank stops at the same step.
"""

from __future__ import annotations

import signal

from bert_ds.exit_codes import ExitCode

__all__ = ["PREEMPTION_SIGNALS", "Preemption"]

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Slurm's ``--signal`` (USR1 in ``slurm/``) and every scheduler's TERM both mean: checkpoint and exit 75."""


class Preemption:
    """SIGTERM/SIGUSR1 only set a flag (once :meth:`arm` ran); the loop checkpoints at the next step boundary."""

    last_signal: int | None = None
    """The last such signal this process received (read by the entry point to explain a failure it caused)."""

    def __init__(self) -> None:
        self.requested = False
        self.while_importing = False
        """The signal came while the rank was still importing (recorded by :mod:`bert_ds.lifecycle.early_signals`)."""

    def arm(self) -> Preemption:
        """Install the handlers, honour a signal caught while importing, start the runner watch; returns ``self``."""
        from bert_ds.lifecycle import early_signals
        from bert_ds.lifecycle.runner_watch import watch_runner

        self.while_importing = early_signals.caught() is not None
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._handler)
        if self.while_importing:
            self._handler(early_signals.caught(), None)
        watch_runner(lambda: self._handler(signal.SIGTERM, None))
        return self

    @staticmethod
    def disarm() -> None:
        """Ignore both signals from now on: the exit code is decided, so a pre-emption signal is moot (a batch script
        forwarding its own TERM as USR1 while the ranks exit, say), and Python's finalization would put back the
        default action, which dies of it (a Slurm task ended by USR1 after "exit 75")."""
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _handler(self, signum, frame) -> None:
        self.requested = True
        Preemption.last_signal = signum

    def stopped_during_startup(self, where: str, last_tag: str | None, rank: int = 0) -> int:
        """Exit 75 for a signal that came before the first step: nothing was trained, so nothing is saved."""
        if rank == 0:
            name = signal.Signals(Preemption.last_signal or signal.SIGTERM).name
            when = "while the rank was still importing" if self.while_importing else "during start-up"
            print(f"pre-empted {where} ({name} {when}): nothing trained or written since "
                  f"{last_tag or 'the start'}; exit {ExitCode.PREEMPTED}", flush=True)
        return ExitCode.PREEMPTED

    def agreed(self, device) -> bool:
        """Whether any rank was asked to stop: one all-reduce, so every rank takes the same branch."""
        import deepspeed.comm as dist
        import torch

        flag = torch.tensor([float(self.requested)], device=device)
        dist.all_reduce(flag)
        return flag.item() > 0
