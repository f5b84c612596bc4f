"""Pre-emption under the other documented launchers: the command a requeue script runs exits 75 after a checkpoint,
with no process left (issue 23 item 1). One node's ``bert-ds deepspeed`` is in
``tests/faults/test_fault_table_preemption.py``; here two ``bert-ds deepspeed --no_ssh --node_rank`` launchers on
this machine (two "nodes", each signalled as Slurm signals every node's step), ``mpirun -np 2`` with SIGUSR1 (Open MPI
forwards it to the ranks) and ``bert-ds mpirun -np 2`` with SIGTERM to the command, its group, ``mpirun`` alone or every
process of the tree at once, as Slurm's TERM-only pre-emption signals a step (a bare ``mpirun`` ends the job on TERM:
exit 1, ranks killed a second after its own SIGTERM; see docs/launching.md)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from bert_ds import checkpoint as ckpt
from bert_ds.lifecycle.hostfile import hosts_from_list, write_hostfile
from tests.helpers import HANG_GUARD_S, child_env, free_port
from tests.helpers.faults import ORPHAN_GRACE_S, fault_recipe
from tests.helpers.ranks import PRETRAIN_SCRIPT, REPO
from tests.helpers.runs import weights

pytestmark = pytest.mark.e2e


def _args(tmp: Path, shards_128: Path, shards_512: Path, tokenizer: Path, **recipe_changes) -> list[str]:
    return ["--recipe", str(fault_recipe(tmp / "recipe.json", **recipe_changes)), "--data", str(shards_128),
            str(shards_512), "--tokenizer", str(tokenizer), "--output", str(tmp / "run"), "--num-workers", "1"]


def _run_and_signal(cmds: list[list[str]], logs: list[Path], sig: int | Callable[[subprocess.Popen], None],
                    env: dict[str, str], ready: str = r"^step 3 \|") -> tuple[list[int], list]:
    """Start ``cmds`` (each its own session); at the first line matching ``ready`` in the first log send ``sig`` to
    each command (or call ``sig(process)``); return their exit codes and the processes of their trees still alive after
    ``ORPHAN_GRACE_S``."""
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for cmd, log in zip(cmds, logs, strict=True)]
    seen: dict[int, psutil.Process] = {}
    deadline, signalled = time.monotonic() + HANG_GUARD_S, False
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        for p in procs:
            try:
                seen.update({c.pid: c for c in psutil.Process(p.pid).children(recursive=True)})
            except psutil.Error:
                pass
        if not signalled and re.search(ready, logs[0].read_text(), re.M):
            for p in procs:
                sig(p) if callable(sig) else p.send_signal(sig)
            signalled = True
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    codes = [p.wait() for p in procs]
    end = time.monotonic() + ORPHAN_GRACE_S
    while time.monotonic() < end and any(q.is_running() and q.status() != psutil.STATUS_ZOMBIE for q in seen.values()):
        time.sleep(0.2)
    left = [q for q in seen.values() if q.is_running() and q.status() != psutil.STATUS_ZOMBIE]
    for q in left:
        q.kill()
    assert signalled, "\n".join(log.read_text()[-3000:] for log in logs)
    return codes, left


def _preempted_tag(run: Path, text: str) -> str:
    """The tag a pre-empted run left: the one it saved, or (signalled between a phase's end and the next phase's
    first step) the one it stopped after."""
    saved = re.search(r"pre-empted: checkpointed at phase (\d) step (\d+); exit 75", text)
    before = re.search(r"pre-empted before phase \d step 1 \(.*\): nothing trained or written since (\S+); exit 75",
                       text)
    assert saved or before, text[-4000:]
    tag = f"phase{saved[1]}-step{int(saved[2]):06d}" if saved else before[1]
    assert ckpt.read_latest(run / "checkpoints") == tag
    return tag


def test_two_supervised_no_ssh_launchers_exit_75(shards_128, shards_512, tokenizer_dir, tmp_path):
    hostfile = write_hostfile(tmp_path / "hostfile", hosts_from_list("node0:1,node1:1"))
    port, args = free_port(), _args(tmp_path, shards_128, shards_512, tokenizer_dir)
    cmds = [[sys.executable, "-m", "bert_ds.lifecycle.supervise", "--hostfile", str(hostfile), "--no_ssh",
             "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(PRETRAIN_SCRIPT), *args] for node in (0, 1)]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    codes, left = _run_and_signal(cmds, logs, signal.SIGTERM, child_env())
    text = "".join(log.read_text() for log in logs)
    assert codes == [75, 75], (codes, text[-4000:])
    assert not left, left
    _preempted_tag(tmp_path / "run", text)


@pytest.mark.mpi
def test_mpirun_usr1_exits_75(shards_128, shards_512, tokenizer_dir, tmp_path):
    args = _args(tmp_path, shards_128, shards_512, tokenizer_dir)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_PORT", "-x", "PYTHONPATH",
           "-x", "OMP_NUM_THREADS", sys.executable, "-m", "bert_ds.runtime.pretrain", *args]
    log = tmp_path / "mpirun.log"
    codes, left = _run_and_signal([cmd], [log], signal.SIGUSR1, child_env(MASTER_PORT=str(free_port())))
    assert codes == [75], (codes, log.read_text()[-4000:])
    assert not left, left
    _preempted_tag(tmp_path / "run", log.read_text())


def _mpirun_args(tmp: Path, shards_128: Path, shards_512: Path, tokenizer: Path, **recipe_changes) -> list[str]:
    return ["--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_PORT", "-x", "PYTHONPATH", "-x",
            "OMP_NUM_THREADS", sys.executable, "-m", "bert_ds.runtime.pretrain",
            *_args(tmp, shards_128, shards_512, tokenizer, **recipe_changes)]


def _term_mpirun(proc: subprocess.Popen) -> None:
    """``kill <pid of mpirun>``: the TERM reaches ``mpirun`` and nothing else."""
    next(p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "mpirun").terminate()


def _term_every_process(proc: subprocess.Popen) -> None:
    """Slurm's TERM-only pre-emption: every process of the step at once (supervisor, mpirun, ranks, loader workers)."""
    for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
        p.terminate()


# A TERM to mpirun alone reaches the ranks supervise_mpirun.SIGKILL_TIMEOUT_S (10) s later, from Open MPI: they train
# on meanwhile, so that row's phase 1 is long enough not to end first.
LONG_PHASE_1 = {"phases.0.steps": 300, "phases.0.checkpoint_interval": 100, "phases.0.eval_interval": 100}


@pytest.mark.mpi
@pytest.mark.parametrize("target", ["command", "group", "mpirun", "every"])
def test_supervised_mpirun_sigterm_exits_75_and_resumes_exactly(target, shards_128, shards_512, tokenizer_dir,
                                                                 fault_reference_run, tmp_path):
    changes = LONG_PHASE_1 if target == "mpirun" else {}
    cmd = [sys.executable, "-m", "bert_ds.cli", "mpirun", *_mpirun_args(tmp_path, shards_128, shards_512,
                                                                        tokenizer_dir, **changes)]
    log = tmp_path / "mpirun.log"
    send = {"command": lambda p: p.send_signal(signal.SIGTERM), "group": lambda p: os.killpg(p.pid, signal.SIGTERM),
            "mpirun": _term_mpirun, "every": _term_every_process}[target]
    env = child_env(MASTER_PORT=str(free_port()))
    codes, left = _run_and_signal([cmd], [log], send, env)
    text = log.read_text()
    assert codes == [75], (codes, text[-4000:])
    assert not left, left
    if target in ("mpirun", "every"):
        # mpirun, TERMed itself, exits 1 (and under Slurm was seen to drop the ranks' last lines): the supervisor's line
        # says what decided the 75
        assert re.search(r"^bert-ds mpirun: mpirun exited 1; the ranks on this node reported 75, 75: exit 75$", text,
                         re.M), text[-3000:]
        tag = ckpt.read_latest(tmp_path / "run" / "checkpoints")
    else:
        tag = _preempted_tag(tmp_path / "run", text)
    if target != "command":  # the checkpoint is the same collective save whoever got the TERM: one row resumes, the
        return  # one with the short phase 1 (resuming the mpirun row's 300 steps twice cost 200 s of the suite)
    # --resume auto reproduces the uninterrupted run of the same recipe and data bit for bit (the fault tables' one,
    # trained on 2 ranks started as launch.py starts them: mpirun's ranks compute the same, test_launch_paths)
    done = subprocess.run(cmd + ["--resume", "auto"], cwd=REPO, env=child_env(MASTER_PORT=str(free_port())),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, (tag, done.stdout[-3000:], done.stderr[-3000:])
    final = ckpt.read_latest(fault_reference_run / "checkpoints")
    assert ckpt.read_latest(tmp_path / "run" / "checkpoints") == final
    got, want = weights(tmp_path / "run", final), weights(fault_reference_run, final)
    assert all(torch.equal(got[k], want[k]) for k in want), "the resumed run differs from the uninterrupted one"


SLOW_SAVER = """
import sys, time
from bert_ds.lifecycle import supervise
from bert_ds.lifecycle.preemption import Preemption
preemption = Preemption().arm()
supervise.arm()
print("armed", flush=True)
while not preemption.requested:
    time.sleep(0.05)
time.sleep(float(sys.argv[1]))  # the rest of the step and the save
print("saved", flush=True)
supervise.report_exit(75)
sys.exit(75)
"""
"""A rank whose step and save take ``argv[1]`` seconds after a pre-emption signal, with bert_ds's own handler."""


@pytest.mark.mpi
@pytest.mark.parametrize(("launcher", "want"), [(["mpirun"], 1), ([sys.executable, "-m", "bert_ds.cli", "mpirun"], 75)])
def test_term_to_mpirun_leaves_the_ranks_time_to_save(launcher, want, tmp_path):
    """TERM to ``mpirun`` alone, ranks that need 3 s to save: a bare ``mpirun`` (Open MPI's 1 s from its SIGTERM to its
    SIGKILL) kills them unsaved and exits 1; under ``bert-ds mpirun`` they save and the command exits 75."""
    cmd = [*launcher, "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH", sys.executable, "-c",
           SLOW_SAVER, "3"]
    log = tmp_path / "mpirun.log"
    send = (lambda p: p.terminate()) if launcher == ["mpirun"] else _term_mpirun
    codes, left = _run_and_signal([cmd], [log], send, child_env(), ready=r"^armed")
    assert codes == [want], (codes, log.read_text()[-3000:])
    assert not left, left
    assert log.read_text().count("saved\n") == (2 if want == 75 else 0), log.read_text()[-3000:]
