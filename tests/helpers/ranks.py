"""Starting real DeepSpeed CPU ranks from a test: the one way tests build and run a rank command.

N ranks run under ``bert-ds deepspeed`` (DeepSpeed's runner under bert_ds's supervisor, the README's launch
command) on a free port (it starts one process per "GPU", on CPU ranks with gloo, and ends every rank when one
fails); one rank runs without a launcher (``bert_ds.runtime.pretrain`` then sets up a one-rank group itself).
Every process gets :func:`tests.helpers.child_env`. Tests of the launch paths themselves (hostfile, mpirun, srun)
build those launchers' command lines around :data:`DEEPSPEED`.

Tests of what the ranks compute (resume exactness, checkpoints, recipes), not of how they are launched, start them
with :func:`spawn_ranks`: the test process sets the variables and the ``--local_rank`` argument DeepSpeed's
``launch.py`` hands each rank and starts the ranks itself. The three launcher interpreters of a ``bert-ds deepspeed``
launch (supervisor, runner, ``launch.py``, each importing torch and DeepSpeed) cost about 4 of its 19 CPU seconds on
2 cores; the ranks, DeepSpeed's engine and gloo are the same. Those ranks (and one-rank ``python -m
bert_ds.runtime.pretrain`` runs through :func:`run_ranks`) are forked from an interpreter that has already imported
torch, DeepSpeed and bert_ds (:mod:`tests.helpers.rank_zygote`; ``BERT_DS_TESTS_FORK_RANKS=0`` turns it off): those
imports are most of a tiny rank's CPU time.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tests.helpers import HANG_GUARD_S, child_env, free_port
from tests.helpers.rank_zygote import THIRD_PARTY, fork_rank

__all__ = ["DEEPSPEED", "PRETRAIN_SCRIPT", "REPO", "VENV_BIN", "rank_command", "run_module_ranks", "run_ranks",
           "spawn_ranks"]

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
    proc = _run_forked(cmd, child_env(**env), timeout) if cmd[1:3] == ["-m", "bert_ds.runtime.pretrain"] else None
    if proc is None:
        proc = subprocess.run(cmd, cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def _run_forked(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    """``cmd`` (``python -m bert_ds.runtime.pretrain ARGS``) forked from the test worker's rank zygote and run to its
    end, as ``subprocess.run`` with ``capture_output`` would; None with ``BERT_DS_TESTS_FORK_RANKS=0``."""
    with tempfile.TemporaryDirectory(prefix="bert_ds-rank-") as logs:
        out, err = Path(logs) / "out", Path(logs) / "err"
        out.touch()
        err.touch()
        rank = fork_rank(cmd[1:], env, REPO, str(out), str(err), ready_timeout=timeout)
        if rank is None:
            return None
        try:
            code = rank.wait(timeout)
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.wait()
            raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text()) from None
        return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())


def _launcher_env(rank: int, nprocs: int, port: int) -> dict[str, str]:
    """What DeepSpeed's ``launch.py`` sets for local rank ``rank`` of ``nprocs`` on one node."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nprocs), "CROSS_RANK": "0",
            "CROSS_SIZE": "1", "LOCAL_SIZE": str(nprocs), "RANK": str(rank), "LOCAL_RANK": str(rank)}


def _end_all(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """SIGTERM every live process, SIGKILL what is left after ``grace`` seconds (as ``launch.py`` ends its ranks)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(argv: list[str], env: dict[str, str], out, err, timeout: float):
    """The rank: the pre-training script forked from the test worker's zygote (:mod:`tests.helpers.rank_zygote`),
    anything else (or with ``BERT_DS_TESTS_FORK_RANKS=0``) its own interpreter."""
    if argv[2] == str(PRETRAIN_SCRIPT):
        rank = fork_rank(argv[2:], env, REPO, out.name, err.name, ready_timeout=timeout)
        if rank is not None:
            return rank
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=err)


def spawn_ranks(nprocs: int, args: Sequence[str] = (), script: str | Path | None = None, *,
                timeout: float = HANG_GUARD_S, check: bool = False, **env: str) -> subprocess.CompletedProcess:
    """Run ``python -u SCRIPT --local_rank=I ARGS`` for I in 0..N-1 as DeepSpeed's ``launch.py`` would, without the
    launchers: when one rank fails the others are ended and its exit code is returned (the first failure's); on
    the hang guard every rank is killed and ``subprocess.TimeoutExpired`` raised. stdout and stderr hold each rank's
    output in rank order. ``check``: as :func:`run_ranks`."""
    def argv(rank: int | str) -> list[str]:
        return [sys.executable, "-u", str(script or PRETRAIN_SCRIPT), f"--local_rank={rank}", *args]

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bert_ds-ranks-") as logs:
        outs = [open(Path(logs) / f"{r}.out", "w+") for r in range(nprocs)]  # noqa: SIM115 - closed below
        errs = [open(Path(logs) / f"{r}.err", "w+") for r in range(nprocs)]  # noqa: SIM115 - closed below
        procs = [_start(argv(r), child_env(**_launcher_env(r, nprocs, port), **env), outs[r], errs[r], timeout)
                 for r in range(nprocs)]
        deadline, code = time.monotonic() + timeout, 0
        try:
            while code == 0 and any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(argv("I"), timeout)
                code = next((p.returncode for p in procs if p.returncode not in (None, 0)), 0)
                time.sleep(0.05)
            code = code or next((p.returncode for p in procs if p.returncode), 0)
        finally:
            _end_all(procs)
        text = []
        for files in (outs, errs):
            for f in files:
                f.seek(0)
            text.append("".join(f.read() for f in files))
            for f in files:
                f.close()
    proc = subprocess.CompletedProcess(argv("I"), code, *text)
    if check and code != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {code} (ranks spawned directly)\n--- stdout\n"
                             f"{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_module_ranks(world_size: int, out_dir: Path, module: str, args: list[str]) -> None:
    """Run ``python -m module args`` on ``world_size`` CPU ranks (gloo), one process per rank; raise with the failed
    ranks' log tails. Ranks are spawned directly with the torch.distributed env variables (what the ``deepspeed``
    launcher sets) to keep runs short on a shared 2-core machine. These modules start DeepSpeed without
    ``bert_ds.runtime``, which would pin its extension directory: they are pointed at the same one
    (:func:`~bert_ds.runtime.caches.extensions_root`, built by ``make venv``, and the venv's ninja first on ``PATH``,
    :func:`~bert_ds.runtime.caches.build_tools_path`), not torch's default, where DeepSpeed would compile its
    shared-memory extension again (a minute of both cores). They are forked from a zygote that imported torch and
    DeepSpeed alone (:data:`~tests.helpers.rank_zygote.THIRD_PARTY`), not bert_ds."""
    from bert_ds.runtime.caches import build_tools_path, extensions_root

    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO),
                   TORCH_EXTENSIONS_DIR=str(extensions_root()),
                   PATH=build_tools_path())
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-m", module, *args]
        forked = fork_rank(cmd[1:], env, REPO, log.name, log.name, ready_timeout=HANG_GUARD_S, preload=THIRD_PARTY)
        procs.append((forked or subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log))
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
