"""The exit-code table of every bert_ds command, in one place (a leaf: imports nothing of bert_ds).

The README's table and ``slurm/pretrain_common.sh`` (which requeues on :attr:`ExitCode.PREEMPTED`) state the same
numbers; ``tests/test_exit_codes.py`` checks both against this module.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ExitCode"]


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
