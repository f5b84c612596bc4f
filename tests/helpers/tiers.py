"""The two test tiers (issue 22): the default tier (``make test-fast``) runs in-process and may start plain
subprocesses (any program's ``--help``, a tokenizer in a fresh interpreter), but never a process tree of ranks; tests
that launch ranks -- the ``deepspeed`` launcher, ``mpirun``, ``srun``/``sbatch``, ``torchrun``,
``bert_ds.runtime.pretrain``, or any process handed a ``RANK`` -- are marked ``e2e`` and run in the whole suite
(``make test``).

:func:`rank_launch` decides whether a command is such a launch; ``tests/conftest.py`` refuses one in every test not
marked ``e2e``, so a test cannot drift into the wrong tier unnoticed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Iterator, Mapping, Sequence

__all__ = ["NEEDS", "RANK_ENTRY_POINTS", "RANK_LAUNCHERS", "gpu_available", "mpi_available", "rank_launch",
           "refuse_rank_launches", "slurm_up"]

RANK_LAUNCHERS = frozenset({"deepspeed", "ds", "mpirun", "mpiexec", "srun", "sbatch", "salloc", "torchrun"})
"""Programs that start ranks (by the basename of argv[0])."""
RANK_ENTRY_POINTS = ("bert_ds.runtime.pretrain", "bert_ds/runtime/pretrain.py", "deepspeed.launcher",
                     "torch.distributed.run")
"""Modules and scripts that are ranks or start them, wherever they appear in the argument list."""
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


def rank_launch(args: str | bytes | os.PathLike | Sequence, env: Mapping[str, str] | None = None) -> str | None:
    """Why ``args`` (as handed to ``subprocess.Popen``) starts ranks, or None when it does not."""
    if isinstance(args, bytes):
        args = args.decode(errors="replace")
    argv = shlex.split(args) if isinstance(args, str) else [os.fsdecode(a) if isinstance(a, bytes | os.PathLike)
                                                            else str(a) for a in args]
    if not argv or argv[-1] in ("--help", "-h"):
        return None  # a launcher or rank script asked for its help starts nothing
    if os.path.basename(argv[0]) in RANK_LAUNCHERS:
        return f"the {os.path.basename(argv[0])} launcher"
    entry = next((a for a in argv for e in RANK_ENTRY_POINTS if e in a), None)
    if entry is not None:
        return f"a rank entry point ({entry})"
    if env is not None and any(var in env for var in _RANK_VARIABLES):
        return f"a process given {[v for v in _RANK_VARIABLES if v in env]}"
    return None


SLURM_NODE_UP = ("idle", "mixed", "allocated", "completing")
"""``sinfo`` node states that take jobs: not only ``idle`` -- another test worker's job may hold the node when this
worker probes (a full run skipped 3 Slurm tests that way, 2026-11-28)."""


def slurm_up() -> bool:
    """A Slurm controller answers and a node takes jobs (CI starts the one-node cluster with
    ``.ci/start_slurm.sh``)."""
    import shutil
    import subprocess

    if not shutil.which("sbatch") or not shutil.which("sinfo"):
        return False
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    states = {state.rstrip("*~#!%$@^-+") for state in proc.stdout.split()}
    return proc.returncode == 0 and bool(states & set(SLURM_NODE_UP))


def mpi_available() -> bool:
    """Open MPI's ``mpirun`` and mpi4py are installed."""
    import importlib.util
    import shutil

    return shutil.which("mpirun") is not None and importlib.util.find_spec("mpi4py") is not None


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


NEEDS = {"slurm": (slurm_up, "no Slurm controller answers (CI starts one with .ci/start_slurm.sh)"),
         "mpi": (mpi_available, "needs Open MPI's mpirun and mpi4py (pip install .[mpi])"),
         "gpu": (gpu_available, "needs a CUDA GPU")}
"""Marker -> (is the resource here, the skip reason): a test marked ``slurm``, ``mpi`` or ``gpu`` skips without it."""


@contextlib.contextmanager
def refuse_rank_launches(nodeid: str) -> Iterator[None]:
    """Inside the block, ``subprocess.Popen`` (and so ``subprocess.run``) raises RuntimeError naming ``nodeid`` and the
    command when the command starts ranks (:func:`rank_launch`); any other command runs."""
    import subprocess

    original = subprocess.Popen

    class _NoRanksPopen(original):
        def __new__(cls, args, *rest, **kwargs):  # refused before an object exists: no Popen.__del__ on a husk
            why = rank_launch(args, kwargs.get("env"))
            if why is not None:
                raise RuntimeError(f"{nodeid} is not marked e2e but starts {why}: {args!r}; mark it "
                                   f"@pytest.mark.e2e (tests/helpers/tiers.py) or test the decision in-process")
            return super().__new__(cls)

    subprocess.Popen = _NoRanksPopen
    try:
        yield
    finally:
        subprocess.Popen = original
