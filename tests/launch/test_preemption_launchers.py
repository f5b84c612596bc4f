"""Pre-emption under the other documented launchers: the command a requeue script runs exits 75 after a checkpoint,
with no process left (issue 23 item 1). One node's ``bert-ds deepspeed`` is in
``tests/faults/test_fault_table_preemption.py``; here two ``bert-ds deepspeed --no_ssh --node_rank`` launchers on
this machine (two "nodes", each signalled as Slurm signals every node's step) and ``mpirun -np 2`` (Open MPI forwards
SIGUSR1 to the ranks; a TERM to ``mpirun`` ends the job, see docs/launching.md)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bert_ds import checkpoint as ckpt
from bert_ds.runtime.launch import hosts_from_list, write_hostfile
from tests.helpers import HANG_GUARD_S, child_env, free_port
from tests.helpers.faults import ORPHAN_GRACE_S, fault_recipe
from tests.helpers.ranks import PRETRAIN_SCRIPT, REPO

pytestmark = pytest.mark.e2e


def _args(tmp: Path, shards_128: Path, shards_512: Path, tokenizer: Path) -> list[str]:
    return ["--recipe", str(fault_recipe(tmp / "recipe.json")), "--data", str(shards_128), str(shards_512),
            "--tokenizer", str(tokenizer), "--output", str(tmp / "run"), "--num-workers", "1"]


def _run_and_signal(cmds: list[list[str]], logs: list[Path], sig: int, env: dict[str, str]) -> tuple[list[int], list]:
    """Start ``cmds`` (each its own session); at the first ``step 3 |`` in the first log send ``sig`` to each
    command; return their exit codes and the processes of their trees still alive after ``ORPHAN_GRACE_S``."""
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
        if not signalled and re.search(r"^step 3 \|", logs[0].read_text(), re.M):
            for p in procs:
                p.send_signal(sig)
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
    message = re.search(r"pre-empted: checkpointed at phase (\d) step (\d+); exit 75", text)
    assert message, text[-4000:]
    tag = f"phase{message[1]}-step{int(message[2]):06d}"
    assert ckpt.read_latest(run / "checkpoints") == tag
    return tag


def test_two_supervised_no_ssh_launchers_exit_75(shards_128, shards_512, tokenizer_dir, tmp_path):
    hostfile = write_hostfile(tmp_path / "hostfile", hosts_from_list("node0:1,node1:1"))
    port, args = free_port(), _args(tmp_path, shards_128, shards_512, tokenizer_dir)
    cmds = [[sys.executable, "-m", "bert_ds.runtime.supervise", "--hostfile", str(hostfile), "--no_ssh",
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
