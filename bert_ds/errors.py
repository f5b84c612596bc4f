"""The errors of every bert_ds command, and the one place that turns an error into its line and exit code.

A :class:`BertDsError` carries its exit code (:class:`~bert_ds.exit_codes.ExitCode`) as a class attribute: bad input
is :class:`BadInput` (2, also a ``ValueError``), a disk that fills or fails under a run is :class:`StorageError` (74:
not the input's fault, and retrying without freeing space fails the same way). :func:`run_main` runs a command's body
and writes whatever it raises once, as ``<prog>: error: <message>``, returning the code; an ``OSError`` (a path
that does not exist, a permission) is bad input as well, except an ``OSError`` of the storage itself (``ENOSPC``,
``EDQUOT``, ``EIO``, ``EFBIG``), which is 74 whatever class raised it. Anything else is a bug and keeps its traceback
and exits 1: a plain ``ValueError`` too (a ``zip(..., strict=True)`` in the step, a numpy shape error), since every
refusal of the user's input is raised as :class:`BadInput`.
A leaf: imports only the exit-code table.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable

from bert_ds.exit_codes import ExitCode

__all__ = ["STORAGE_ERRNOS", "BadInput", "BertDsError", "StepFailed", "StorageError", "error_lines", "exit_code_of",
           "run_main"]

STORAGE_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EIO, errno.EFBIG) if e)
"""An ``OSError`` with one of these is the storage failing (full, over quota, broken), not a bad path."""


class BertDsError(Exception):
    """Base of every error a bert_ds command reports in one line; ``exit_code`` is what the command then exits
    with."""

    exit_code: ExitCode = ExitCode.FAILED


class BadInput(BertDsError, ValueError):
    """A file, field or value the command cannot use, named in the message; nothing already written is lost."""

    exit_code = ExitCode.BAD_INPUT


class StepFailed(BertDsError, RuntimeError):
    """A step failed that is not the input's fault (a worker process died, a result fell short of its target)."""

    exit_code = ExitCode.FAILED


class StorageError(BertDsError):
    """Writing failed because the storage did (disk full, quota, I/O error): what was saved before is intact."""

    exit_code = ExitCode.IO_ERROR


def exit_code_of(exc: BaseException) -> ExitCode | None:
    """The exit code ``exc`` stands for, or None for an exception that is a bug (it propagates, with its
    traceback)."""
    if isinstance(exc, BertDsError):
        return exc.exit_code
    if isinstance(exc, OSError):
        return ExitCode.IO_ERROR if exc.errno in STORAGE_ERRNOS else ExitCode.BAD_INPUT
    return None  # a plain ValueError too: bad input is typed (BadInput), so an untyped one is a bug


def error_lines(prog: str | None, message: str) -> str:
    """``<prog>: error: <line>`` for each line of ``message`` (one per problem), or ``error: <line>`` without a
    prog (bert-ds-evaluate and bert-ds-convert-checkpoint, whose first line users and tests match as it was)."""
    prefix = f"{prog}: error: " if prog else "error: "
    return "".join(f"{prefix}{line}\n" for line in (message.splitlines() or [""]))


def run_main(prog: str | None, body: Callable[..., int | None], /, *args, **kwargs) -> int:
    """``body(*args, **kwargs)``'s exit status (None is 0); an error it raises is written once to stderr by
    :func:`error_lines` and returned as :func:`exit_code_of` says; any other exception propagates."""
    try:
        code = body(*args, **kwargs)
    except Exception as exc:
        code = exit_code_of(exc)
        if code is None:
            raise
        # One write: ranks share the launcher's stderr, and print() writes the text and the newline separately.
        sys.stderr.write(error_lines(prog, str(exc)))
        sys.stderr.flush()
        return int(code)
    return 0 if code is None else int(code)
