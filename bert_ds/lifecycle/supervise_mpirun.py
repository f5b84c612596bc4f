"""``bert-ds mpirun ARGS``: Open MPI's ``mpirun`` under the supervisor of :mod:`bert_ds.lifecycle.supervise`, so a
pre-emption signal to the command, its process group or ``mpirun`` itself ends in a checkpoint and exit 75 (a bare
``mpirun`` answers SIGTERM by killing the ranks a second after its own SIGTERM to them, saved or not, and exits 1).

A TERM that reaches ``mpirun`` itself (``kill <its pid>``, Slurm's TERM to every process of a step) is Open MPI's to
handle, not the supervisor's: Open MPI 4.1 sends each local rank's process group SIGCONT, SIGTERM
``odls_base_sigkill_timeout`` seconds later and SIGKILL as long again after that
(``orte/mca/odls/base/odls_base_default_fns.c``), then exits 1. Its default, 1 s, leaves a rank one second to save:
the supervisor passes :data:`SIGKILL_TIMEOUT_S` unless the user sets the parameter, and decides 75 from the ranks' own
reports (:func:`bert_ds.lifecycle.supervise.exit_code_of`), not from ``mpirun``'s 1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from bert_ds.cli import alias
from bert_ds.lifecycle.restart import split_own_options
from bert_ds.lifecycle.supervise import MPIRUN, supervise

__all__ = ["SIGKILL_PARAM", "SIGKILL_TIMEOUT_S", "main", "mpirun_options"]

SIGKILL_PARAM = "odls_base_sigkill_timeout"
SIGKILL_TIMEOUT_S = 10
"""A rank's time, from Open MPI's SIGTERM to its SIGKILL, to finish its step and save. ``mpirun`` exits twice this after
the TERM it got, inside Slurm's default ``KillWait`` (30 s) when Slurm TERMs every process of a step; a step and a save
that take longer need ``--mca odls_base_sigkill_timeout N`` and a ``KillWait`` above 2N."""


def mpirun_options(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The options the supervisor puts before the user's: ``--mca odls_base_sigkill_timeout 10`` unless ``argv``
    names the parameter or ``OMPI_MCA_odls_base_sigkill_timeout`` is set (the user's value stands); none for a
    help request or no arguments (refused as they are)."""
    environ = os.environ if environ is None else environ
    if not argv or argv[0] in ("-h", "--help") or SIGKILL_PARAM in argv or f"OMPI_MCA_{SIGKILL_PARAM}" in environ:
        return []
    return ["--mca", SIGKILL_PARAM, str(SIGKILL_TIMEOUT_S)]


def _run(argv: list[str]) -> int:
    """``bert-ds mpirun``: Open MPI's mpirun under the supervisor."""
    own, rest = split_own_options(argv)
    return supervise(MPIRUN, [*own, *mpirun_options(rest), *rest])


main = alias("mpirun")


if __name__ == "__main__":
    sys.exit(main())
