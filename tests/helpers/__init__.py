"""Shared test helpers, imported as ``tests.helpers.<module>`` (pyproject's ``pythonpath = ["."]`` puts the repository
root on ``sys.path``). Nothing here is a test; ``conftest.py`` files only hold fixtures."""

import contextlib
import os
from collections.abc import Iterator

from bert_ds.runtime.distributed import free_port

__all__ = ["HANG_GUARD_S", "LAUNCHER_VARS", "child_env", "environ", "free_port"]

HANG_GUARD_S = 600
"""Timeout for a subprocess a test starts: a guard against a hang (a stuck launcher, a lock left by a killed
DeepSpeed extension build), never a speed check. Generous so the suite passes on a loaded 2-core machine (the longest
subprocess of the suite takes about a minute there), and below pytest-timeout's 900 s per test (pyproject.toml): a hung
subprocess fails its test with its output, where pytest-timeout would end the whole xdist worker (and a session whose
worker was replaced that way has been seen to wait for ever instead of finishing)."""


LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "CROSS_RANK", "CROSS_SIZE")
"""What a launcher hands its ranks. A process started by a test must not inherit them from the test process (a job
that inherits RANK=9 WORLD_SIZE=16 MASTER_ADDR=gpu01 waits for its peers for the full rendezvous timeout)."""


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a process a test starts: this process's, without launcher variables (``LAUNCHER_VARS``)
    and Slurm/Open MPI job variables, with PYTHONPATH on the checkout, one thread per rank, and ``extra``."""
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
    return {**env, "PYTHONPATH": repo, "OMP_NUM_THREADS": "1", **extra}


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """This process's ``os.environ`` with ``values`` set inside the block, as it was after (for code read in the test
    process itself: a client library, a pre-flight decided in-process)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
