"""The exit-code table of every bert_ds command, in one place (a leaf: imports nothing of bert_ds).

The README's table and ``slurm/pretrain_common.sh`` (which requeues on :attr:`ExitCode.PREEMPTED`) state the same
numbers; ``tests/test_exit_codes.py`` checks both against this module.

A process killed by a signal has no code of its own: the supervisors (``bert-ds deepspeed``, ``bert-ds mpirun``) and
``slurm/pretrain_common.sh`` report a rank or launcher killed by signal N as ``128 + N`` (:func:`signal_exit_code`),
as POSIX shells do: 137 for SIGKILL, 134 for SIGABRT, 139 for SIGSEGV, naming the signal in their line. DeepSpeed's
``launch.py`` passes a killed rank's status on as ``sys.exit(-N)``, the byte ``256 - N`` (247 for SIGKILL): the
supervisor turns that into ``128 + N`` too (:func:`from_negated_signal`).
"""

from __future__ import annotations

import signal
from enum import IntEnum

__all__ = ["SIGNAL_BASE", "ExitCode", "from_negated_signal", "signal_exit_code", "signal_name",
           "signal_of"]


class ExitCode(IntEnum):
    OK = 0
    """Done (or ``--max-steps`` reached; nothing left to do)."""
    FAILED = 1
    """A step failed that is not the input's fault: a loader worker process died (the message names its shard), the
    demo fell short of its targets."""
    BAD_INPUT = 2
    """Bad input or an environment that cannot work, refused in one line naming the file, field or value; nothing
    already written is lost."""
    NONFINITE = 3
    """Non-finite loss or weights: the last good checkpoint is kept."""
    IO_ERROR = 74
    """The storage failed under a command: disk full, quota exceeded, an I/O error (``ENOSPC``, ``EDQUOT``, ``EIO``,
    ``EFBIG``; :class:`bert_ds.errors.StorageError`). Not the input's fault, and not retryable as it stands: free
    space or fix the mount, then rerun (pre-training: ``--resume auto``). 74 is ``EX_IOERR`` of sysexits.h."""
    STALLED = 124
    """A rank made no progress for ``--step-timeout`` seconds (a stuck collective, a dead mount, a lost GPU): every
    rank exits after a line naming the stalled ranks (host, local rank, pid) and what each last did; retryable with
    ``--resume auto`` (124 is coreutils ``timeout``'s "timed out")."""
    PREEMPTED = 75
    """SIGTERM/SIGUSR1: checkpointed at the next step boundary; resubmit with ``--resume auto`` (``EX_TEMPFAIL`` of
    sysexits.h, "try again later", what a requeue wrapper checks for)."""


SIGNAL_BASE = 128
"""A death by signal N exits ``SIGNAL_BASE + N`` (POSIX shells' ``$?`` after a killed command)."""
_MAX_SIGNAL = 64  # Linux's highest real-time signal (SIGRTMAX)


def signal_exit_code(signum: int) -> int:
    """The code of a process killed by ``signum``: 128 + N (137 for SIGKILL)."""
    return SIGNAL_BASE + int(signum)


def signal_of(code: int) -> int | None:
    """The signal a code of :func:`signal_exit_code` stands for (129..192), else None."""
    return code - SIGNAL_BASE if SIGNAL_BASE < code <= SIGNAL_BASE + _MAX_SIGNAL else None


def from_negated_signal(code: int) -> int:
    """``sys.exit(-N)`` of a launcher that passes on a killed child's status (DeepSpeed's ``launch.py``) exits with
    the byte ``256 - N``: that as ``128 + N``; any other code unchanged. No bert_ds rank exits above 128 itself."""
    return signal_exit_code(256 - code) if 256 - _MAX_SIGNAL <= code <= 255 else code


def signal_name(code: int) -> str | None:
    """``SIGKILL`` for 137, None for a code that is no signal's."""
    signum = signal_of(code)
    if signum is None:
        return None
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
