"""Process-group set-up for every launch path, and the per-rank seeding of the random streams.

Launch paths (README "Launching"): the ``deepspeed`` launcher (sets RANK/WORLD_SIZE/...), ``srun`` one task per rank
(Slurm variables, mapped here), ``mpirun`` (DeepSpeed's MPI discovery through mpi4py), and a bare
``python -m bert_ds.pretrain`` (a one-rank group on a free local port).
"""

from __future__ import annotations

import os
import random
import socket

import numpy as np
import torch

__all__ = ["init_distributed", "seed_everything"]


def _env_from_slurm() -> None:
    """``srun python -m bert_ds.pretrain``: one task per rank, so Slurm's --signal reaches every rank directly (the
    deepspeed launcher would answer SIGTERM by killing its ranks before they can checkpoint)."""
    if "MASTER_ADDR" not in os.environ:
        raise ValueError("under srun without a launcher, export MASTER_ADDR (the first node's hostname) "
                         "and optionally MASTER_PORT")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                      LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    if os.environ.get("SLURM_NTASKS_PER_NODE", "").isdigit():
        os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["SLURM_NTASKS_PER_NODE"])


def _env_single_process() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


def init_distributed() -> tuple[int, int]:
    """Join the launcher's process group (or create a one-rank group); returns (rank, world size)."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    under_mpirun = "OMPI_COMM_WORLD_RANK" in os.environ
    if "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        _env_from_slurm()
    if "RANK" not in os.environ and not under_mpirun:
        _env_single_process()
    accel = get_accelerator()
    cpu = accel.device_name() == "cpu"
    if cpu and "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one host share its cores; more threads than cores per rank only adds contention.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    backend = "gloo" if cpu else accel.communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=under_mpirun)
    return dist.get_rank(), dist.get_world_size()


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (dropout draws from torch's)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
