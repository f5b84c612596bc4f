"""Starting real DeepSpeed CPU ranks from a test: the one way tests build and run a rank command.

N ranks run under ``bert-ds deepspeed`` (DeepSpeed's runner under bert_ds's supervisor, the README's launch
command) on a free port (it starts one process per "GPU", on CPU ranks with gloo, and ends every rank when one
fails); one rank runs without a launcher (``bert_ds.runtime.pretrain`` then sets up a one-rank group itself).
Every process gets :func:`tests.helpers.child_env`. Tests of the launch paths themselves (hostfile, mpirun, srun)
build those launchers' command lines around :data:`DEEPSPEED`.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.helpers import HANG_GUARD_S, child_env, free_port

__all__ = ["DEEPSPEED", "PRETRAIN_SCRIPT", "REPO", "VENV_BIN", "rank_command", "run_module_ranks", "run_ranks"]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
DEEPSPEED = VENV_BIN / "deepspeed"
PRETRAIN_SCRIPT = REPO / "bert_ds" / "runtime" / "pretrain.py"


def rank_command(nprocs: int, args: Sequence[str] = (), script: str | Path | None = None) -> list[str]:
    """``bert-ds deepspeed --num_gpus N --master_port P SCRIPT ARGS`` for N > 1 CPU ranks (run as ``python -m
    bert_ds.lifecycle.supervise`` so this checkout's code runs; ``--max-restarts 0``: a test's fault ends the command,
    the restarts are tests/lifecycle/test_restart_ranks.py's), ``python SCRIPT ARGS`` for one; ``script`` defaults to
    ``bert_ds.runtime.pretrain`` (run as ``python -m`` on one rank)."""
    if nprocs == 1:
        return [sys.executable, *([str(script)] if script else ["-m", "bert_ds.runtime.pretrain"]), *args]
    return [sys.executable, "-m", "bert_ds.lifecycle.supervise", "--max-restarts", "0", "--num_gpus", str(nprocs),
            "--master_port", str(free_port()), str(script or PRETRAIN_SCRIPT), *args]


def run_ranks(cmd: list[str], *, timeout: float = HANG_GUARD_S, check: bool = False,
              **env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the checkout to its end with :func:`~tests.helpers.child_env` (plus ``env``), capturing
    stdout and stderr; with ``check``, an exit code other than 0 fails the test showing both."""
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_module_ranks(world_size: int, out_dir: Path, module: str, args: list[str]) -> None:
    """Run ``python -m module args`` on ``world_size`` CPU ranks (gloo), one process per rank; raise with the failed
    ranks' log tails. Ranks are spawned directly with the torch.distributed env variables (what the ``deepspeed``
    launcher sets) to keep runs short on a shared 2-core machine."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", module, *args]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log))
    try:
        for p, _ in procs:
            p.wait(timeout=HANG_GUARD_S)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    failed = [r for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        logs = "\n".join((out_dir / f"rank{r}.log").read_text()[-3000:] for r in failed)
        raise RuntimeError(f"ranks {failed} failed:\n{logs}")
