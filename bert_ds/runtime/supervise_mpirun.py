"""``bert-ds mpirun ARGS``: Open MPI's ``mpirun`` under the supervisor of :mod:`bert_ds.runtime.supervise`, so a
pre-emption signal to the command or its process group ends in a checkpoint and exit 75 (a bare ``mpirun`` answers
SIGTERM by killing the ranks before they save, and exits 1; so does this one's ``mpirun`` when the TERM is sent to it
directly)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bert_ds.runtime.supervise import MPIRUN, supervise

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    return supervise(MPIRUN, argv)


if __name__ == "__main__":
    sys.exit(main())
