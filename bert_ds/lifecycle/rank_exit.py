"""How a rank started as ``bert_ds/runtime/pretrain.py`` (a script or ``python -m``: every launcher's command) ends
once ``main`` has returned its exit code, its work done -- checkpoints saved, metrics closed, the run lock released,
the code reported to the supervisor: what a normal interpreter exit would still do runs (non-daemon threads joined,
``atexit`` handlers: the process group left, loader worker pools ended, logging flushed; MPI finalized when mpi4py
started it; Python's and C's standard streams flushed), then ``os._exit`` ends the process without the interpreter's
teardown.

That teardown is a full garbage collection of a heap holding torch, DeepSpeed and Triton, and nothing a rank needs:
measured on a tiny 2-rank CPU run (2 cores, quiet), 1.07 s from ``main``'s return to the process's end,
0.17 s without the collection; under load 7.5, 5-9 s (py-spy: ``gc_collect_main``) -- seconds every launch waits
and a pre-empted job spends inside its grace period. (``gc.freeze()`` skips the collection too, but Triton's nanobind
bindings then print leak warnings on every exit.)

The teardown also ran C++ static destructors, and those abort a gloo rank now and then ("terminate called without an
active exception", SIGABRT, exit -6) even after ``barrier`` + ``destroy_process_group``. Every process bert_ds or
its tests start as a DeepSpeed rank therefore ends here (pretrain.py, the benchmark ranks, the test workers)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading
from typing import NoReturn

__all__ = ["end_process"]


def _finalize_mpi() -> None:
    """mpi4py finalizes MPI in the interpreter's teardown, not in an ``atexit`` handler; a rank of ``mpirun`` that
    ends without ``MPI_Finalize`` is one that "exited improperly" to Open MPI, which then fails the job (exit 1)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


def end_process(code: int) -> NoReturn:
    """Finish what a normal exit does, except the interpreter's teardown, and exit with ``code``."""
    try:
        # What Py_FinalizeEx does first (CPython 3.11 wait_for_thread_shutdown): threading's own atexit callbacks,
        # which tell idle ThreadPoolExecutor workers to stop (torch.compile's inductor keeps one), then join every
        # non-daemon thread. Joining without those callbacks waits forever on such a worker.
        threading._shutdown()
        atexit._run_exitfuncs()  # what Py_FinalizeEx calls; exceptions are printed, as at a normal exit
        _finalize_mpi()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        ctypes.CDLL(None).fflush(None)  # C stdio buffers (native libraries' printf to a pipe)
        os._exit(code)
