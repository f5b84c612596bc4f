"""Process-group set-up for every launch path, and the per-rank seeding of the random streams.

Launch paths (README "Launching"): the ``deepspeed`` launcher (sets RANK/WORLD_SIZE/...), ``srun`` one task per rank
(Slurm variables, mapped here), ``mpirun`` (DeepSpeed's MPI discovery through mpi4py), and a bare
``python -m bert_ds.runtime.pretrain`` (a one-rank group on a free local port).
"""

from __future__ import annotations

import logging
import os
import random
import socket
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from bert_ds.deepspeed_internals import SHM_BUFFER_GLOB
from bert_ds.errors import BadInput
from bert_ds.runtime.caches import load_extensions, use_node_local_caches

__all__ = ["LAUNCHER_INTEGERS", "check_launcher_env", "check_master_addr", "free_port", "init_distributed",
           "join_gloo_group", "launch_path", "leave_process_group", "leave_process_group_at_exit",
           "release_shm_buffers", "seed_everything"]

log = logging.getLogger(__name__)

def launch_path(env: Mapping[str, str]) -> str:
    """Which launcher started this process: ``launcher`` (deepspeed/torchrun: RANK is set), ``mpirun`` (Open MPI's
    OMPI_COMM_WORLD_* variables), ``srun`` (a Slurm job step of more than one task) or ``single`` (this includes
    ``python`` run straight from an sbatch script: the batch shell has SLURM_NTASKS and SLURM_PROCID=0 but no step).
    mpirun comes before srun: inside a Slurm job mpirun's ranks inherit SLURM_* variables that are not theirs."""
    if "RANK" in env:
        return "launcher"
    if "OMPI_COMM_WORLD_RANK" in env:
        return "mpirun"
    if int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        return "srun"
    return "single"


def _env_from_slurm() -> None:
    """``srun python -m bert_ds.runtime.pretrain``: one task per rank, so Slurm's --signal reaches every rank directly
    (the deepspeed launcher would answer SIGTERM by killing its ranks before they can checkpoint). MASTER_ADDR
    defaults to the job's first node, MASTER_PORT to the job's port
    (``bert_ds.lifecycle.hostfile.slurm_master_port``)."""
    from bert_ds.lifecycle.hostfile import parse_tasks_per_node, slurm_hostnames, slurm_master_port

    if "MASTER_ADDR" not in os.environ:
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise BadInput("under srun without a launcher and without SLURM_JOB_NODELIST, export MASTER_ADDR "
                           "(the first node's hostname) and optionally MASTER_PORT")
        os.environ["MASTER_ADDR"] = slurm_hostnames(nodelist)[0]
    os.environ.setdefault("MASTER_PORT", str(slurm_master_port(os.environ)))
    os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_STEP_NUM_TASKS"],
                      LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
    if os.environ.get("SLURM_STEP_TASKS_PER_NODE"):  # e.g. "8(x4)": the fullest node sets the thread split
        per_node = max(parse_tasks_per_node(os.environ["SLURM_STEP_TASKS_PER_NODE"]))
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(per_node))


def _env_from_mpirun() -> int:
    """``mpirun -np N python -m bert_ds.runtime.pretrain``: DeepSpeed's MPI discovery (mpi4py) sets RANK, WORLD_SIZE,
    LOCAL_RANK and MASTER_ADDR (rank 0's ``hostname -I``) inside ``deepspeed.init_distributed``; here only the ranks
    per host (for the thread split) and the port: discovery would otherwise always take 29500, so a second job on a
    node would collide. Returns the port (``mpirun -x MASTER_PORT=...`` picks another)."""
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    port = os.environ.get("MASTER_PORT", "29500")
    if not port.isdigit():
        raise BadInput(f"MASTER_PORT={port!r} is not a port number; export MASTER_PORT as a free port")
    return int(port)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a process group's MASTER_PORT on this machine (the kernel picks
    it; another process may take it before the group binds it, which the caller's retry or failure then shows)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_single_process() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")


def check_master_addr(env: Mapping[str, str]) -> None:
    """Refuse a MASTER_ADDR this host cannot resolve (a typo, a stale export, a Slurm node name from another cluster):
    every rank would otherwise retry the rendezvous until its 30-minute timeout, printing only c10d warnings."""
    addr = env.get("MASTER_ADDR")
    if not addr:
        return
    try:
        socket.getaddrinfo(addr, None)
    except socket.gaierror as exc:
        raise BadInput(f"MASTER_ADDR={addr!r} does not resolve on {socket.gethostname()} ({exc.strerror}); export "
                       f"MASTER_ADDR as rank 0's hostname or IP address reachable from every node") from exc


LAUNCHER_INTEGERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
"""The launcher variables torch.distributed reads as integers (``env://`` rendezvous)."""


def check_launcher_env(env: Mapping[str, str]) -> None:
    """Refuse a launcher variable that is not what a launcher sets (a hand-written export, a wrapper script's typo):
    torch would otherwise fail deep inside the rendezvous with a ``ValueError`` that names no variable."""
    values = {}
    for var in LAUNCHER_INTEGERS:
        if var in env:
            try:
                values[var] = int(env[var])
            except ValueError:
                raise BadInput(f"{var}={env[var]!r} is not an integer; a launcher (deepspeed, torchrun, srun, mpirun) "
                               f"sets it, or unset it to run one process") from None
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if size in values and values[size] < 1:
            raise BadInput(f"{size}={values[size]} must be at least 1")
        if rank in values and size in values and not 0 <= values[rank] < values[size]:
            raise BadInput(f"{rank}={values[rank]} is outside 0..{values[size] - 1} ({size}={values[size]})")
    if "MASTER_PORT" in values and not 0 < values["MASTER_PORT"] < 65536:
        raise BadInput(f"MASTER_PORT={values['MASTER_PORT']} is not a TCP port (1..65535)")


def init_distributed(timeout_s: float | None = None) -> tuple[int, int]:
    """Join the launcher's process group (or create a one-rank group); returns (rank, world size). ``timeout_s``
    (recipe ``deepspeed.process_group_timeout_s``) bounds how long a collective waits for a late rank; None keeps
    DeepSpeed's default."""
    import datetime

    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    use_node_local_caches(os.environ)  # before anything compiles or takes a build lock
    path = launch_path(os.environ)
    port = 29500
    if path == "srun":
        _env_from_slurm()
    elif path == "mpirun":
        port = _env_from_mpirun()
    elif path == "single":
        _env_single_process()
    check_launcher_env(os.environ)
    accel = get_accelerator()
    cpu = accel.device_name() == "cpu"
    if cpu and "OMP_NUM_THREADS" not in os.environ:
        # Ranks on one host share its cores; more threads than cores per rank only adds contention.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    backend = "gloo" if cpu else accel.communication_backend_name()
    if path != "mpirun":  # mpirun: DeepSpeed's discovery sets MASTER_ADDR to rank 0's own address
        check_master_addr(os.environ)
    load_extensions()  # DeepSpeed's CPU backend would build its shm extension under torch's lock; loaded here
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    try:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=path == "mpirun", distributed_port=port,
                                   **timeout)
    except RuntimeError as exc:  # torch's DistNetworkError: rank 0's TCPStore server could not listen
        if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc).lower():
            raise
        raise BadInput(f"MASTER_PORT={os.environ.get('MASTER_PORT', port)} is already in use on "
                       f"{socket.gethostname()} (another job or process group listens there); export MASTER_PORT "
                       f"as a free port (deepspeed --master_port N)") from None
    leave_process_group_at_exit()
    return dist.get_rank(), dist.get_world_size()


def join_gloo_group() -> None:
    """Join DeepSpeed's gloo group from the launcher's variables as they are (a benchmark's or a test's worker ranks,
    which skip :func:`init_distributed`'s launcher handling), with the JIT extensions loaded from
    :func:`~bert_ds.runtime.caches.extensions_root` first: left to DeepSpeed, the CPU backend builds its shared-memory
    extension in torch's default directory, where processes of other kinds rebuilt it over each other (about a CPU
    minute each). The group is left at exit (:func:`leave_process_group_at_exit`)."""
    import deepspeed

    load_extensions()
    deepspeed.init_distributed(dist_backend="gloo")
    leave_process_group_at_exit()


def leave_process_group_at_exit() -> None:
    """Destroy the process group when the interpreter exits, however the rank ends (success, refusal, pre-emption,
    an error): left to C++ static destruction, gloo's threads abort the process ("terminate called without an active
    exception", SIGABRT) now and then, and a finished rank then reports failure."""
    import atexit

    atexit.unregister(leave_process_group)  # once, however often a process initialises
    atexit.register(leave_process_group)


def leave_process_group() -> None:
    """Destroy the default process group, if there is one, before this rank exits. Left to interpreter exit, gloo's
    threads are torn down by C++ static destruction, which can kill the rank with "terminate called without an
    active exception" (SIGABRT: the launcher then exits 250 instead of the rank's own code, a refusal's 2 included);
    torch's documentation asks for ``destroy_process_group()`` before exit."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def release_shm_buffers() -> list[Path]:
    """Unlink this rank's DeepSpeed CPU all-reduce buffers in /dev/shm (``deepspeed_allreduce_buffer_*_<addr>_<port>_
    <local rank>``, created by the deepspeed_shm_comm extension on CPU). DeepSpeed 0.19 never unlinks them, so every
    run leaks them into RAM-backed /dev/shm (measured: 335 segments, 22 GB after a day of test runs on 2 cores).
    Unlinking at exit is safe: ranks that still map a segment keep it until they unmap it."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    shm = Path("/dev/shm")
    if not addr or not port or not shm.is_dir():
        return []
    local_rank = os.environ.get("LOCAL_RANK", "0")
    removed = []
    for seg in shm.glob(SHM_BUFFER_GLOB.format(addr=addr, port=port, local_rank=local_rank)):
        try:
            seg.unlink()
            removed.append(seg)
        except OSError:
            continue
    return removed


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators (dropout draws from torch's)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
