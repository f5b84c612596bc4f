"""Restarts inside the allocation with real ranks (issue 34): ``bert-ds deepspeed --max-restarts N`` on two DeepSpeed
CPU ranks (gloo), the shipped ``ds_configs/tiny_cpu.json`` (dropout 0.1, ZeRO-2, LAMB) cut to phase 1's 4 steps with a
checkpoint every 2 (:func:`_recipe`), so a fault on "step 3" lands mid-phase, after ``phase1-step000002``. Every
finished run is compared tensor for tensor with ONE uninterrupted run (the module's ``reference`` fixture).

Faults are injected from outside, as in ``tests/faults/``: SIGKILL or SIGSTOP to a rank process
(``tests.helpers.faults``), SIGTERM to the command. The policy without ranks: ``tests/lifecycle/test_restart.py``."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from bert_ds import checkpoint as ckpt
from bert_ds.lifecycle import restart
from bert_ds.lifecycle.hostfile import hosts_from_list, write_hostfile
from tests.helpers import HANG_GUARD_S, child_env, free_port
from tests.helpers.faults import Launch, Trigger, execute, fault_recipe, kill_rank, ranks
from tests.helpers.ranks import PRETRAIN_SCRIPT, REPO, spawn_ranks
from tests.helpers.runs import weights

pytestmark = pytest.mark.e2e

FINAL = "phase1-step000004"
BACKOFF = ("--restart-backoff", "1")


def _recipe(tmp: Path) -> Path:
    return fault_recipe(tmp / "recipe.json", **{"phases.0.steps": 4, "phases.0.checkpoint_interval": 2,
                                                  "phases.0.eval_interval": 0})


def _args(tmp: Path, data: tuple[Path, Path, Path], *extra: str) -> list[str]:
    s128, s512, tokenizer = data
    return ["--recipe", str(_recipe(tmp)), "--data", str(s128), str(s512), "--tokenizer", str(tokenizer),
            "--output", str(tmp / "run"), "--phase", "1", *extra]


def _supervised(max_restarts: int, args: list[str], *launcher: str) -> list[str]:
    """``bert-ds deepspeed --max-restarts N --restart-backoff 1 [launcher options] pretrain.py ARGS``."""
    launcher = launcher or ("--num_gpus", "2", "--master_port", str(free_port()))
    return [sys.executable, "-m", "bert_ds.lifecycle.supervise", "--max-restarts", str(max_restarts), *BACKOFF,
            *launcher, str(PRETRAIN_SCRIPT), *args]


@pytest.fixture(scope="module")
def data(shards_128, shards_512, tokenizer_dir) -> tuple[Path, Path, Path]:
    return shards_128, shards_512, tokenizer_dir


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final weights (2 ranks spawned directly, no supervisor: nothing to restart)."""
    tmp = tmp_path_factory.mktemp("reference")
    spawn_ranks(2, _args(tmp, data), check=True)
    assert ckpt.read_latest(tmp / "run" / "checkpoints") == FINAL
    return weights(tmp / "run", FINAL)


def _equal(run: Path, reference: dict[str, torch.Tensor]) -> None:
    assert ckpt.read_latest(run / "checkpoints") == FINAL
    got = weights(run, FINAL)
    differ = [k for k in reference if not torch.equal(got[k], reference[k])]
    assert not differ, f"{len(differ)} of {len(reference)} tensors differ from the uninterrupted run: {differ[:3]}"


def _records(run: Path) -> list[dict]:
    path = run / restart.LOG_NAME
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_kill9_of_rank1_restarts_once_and_matches(data, reference, tmp_path):
    out = execute(Launch(_supervised(2, _args(tmp_path, data)), Trigger(r"^step 3 \|", kill_rank(1))))
    text = out.text()
    assert out.fault is not None and out.returncode == 0, (out.returncode, text[-5000:])
    assert not out.survivors, out.survivors
    restarts = [r for r in _records(tmp_path / "run") if "restart" in r]
    assert len(restarts) == 1, restarts
    record = restarts[0]
    assert (record["restart"], record["of"], record["signal"], record["attempt"]["code"]) == (1, 2, "SIGKILL", 137)
    assert record["attempt"]["failing"].startswith("rank 1 (host "), record
    assert record["resumed"] == "phase1-step000002" and record["seconds_lost"] > 0, record
    line = out.first_line(r"^bert-ds deepspeed: restart 1 of 2: ")
    assert line and "rank 1 (host" in line and "killed by SIGKILL (exit 137)" in line and "phase1-step000002" in line
    assert re.search(r"^bert-ds deepspeed: 2 attempt\(s\), done: attempt 1: .*exit 0$", text, re.M), text[-3000:]
    events = list((tmp_path / "run" / "tensorboard").glob("*.restarts"))
    assert events and events[0].stat().st_size > 0, "no TensorBoard record of the restart"
    _equal(tmp_path / "run", reference)


def _stop_rank1_in_step(launcher: psutil.Process) -> str:
    target = ranks(launcher)[1]
    target.suspend()  # SIGSTOP: alive, silent; its peer waits in the step's all-reduce
    return f"SIGSTOP to rank 1 (pid {target.pid})"


@pytest.mark.waits  # the step timeout, then the launcher's grace before it kills the stopped rank
def test_sigstop_stall_is_restarted_and_matches(data, reference, tmp_path):
    cmd = _supervised(1, _args(tmp_path, data, "--step-timeout", "5"))
    out = execute(Launch(cmd, Trigger(r"^step 3 \|", _stop_rank1_in_step)))
    text = out.text()
    assert out.fault is not None and out.returncode == 0, (out.returncode, text[-5000:])
    assert not out.survivors, out.survivors  # the stopped rank was SIGKILLed, not left stopped
    assert re.search(r"^bert_ds\.runtime\.pretrain: error: stalled: rank 1 ", text, re.M), text[-4000:]
    (record,) = [r for r in _records(tmp_path / "run") if "restart" in r]
    assert record["attempt"]["code"] == 124 and record["attempt"]["failing"].startswith("stalled rank 1 "), record
    _equal(tmp_path / "run", reference)


def _kill_every_attempt(cmd: list[str], log: Path) -> tuple[int, list[int]]:
    """Run ``cmd``; SIGKILL every rank process as soon as it appears (each attempt fails before its first step).
    Returns the exit code and the pids killed."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)
    root, killed = psutil.Process(proc.pid), []
    deadline = time.monotonic() + HANG_GUARD_S
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            for rank in ranks(root).values():
                rank.kill()
                killed.append(rank.pid)
        except psutil.Error:
            pass
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    return proc.wait(), killed


def test_three_failures_end_with_the_last_code_and_a_summary(data, tmp_path):
    code, killed = _kill_every_attempt(_supervised(2, _args(tmp_path, data)), tmp_path / "log")
    text = (tmp_path / "log").read_text()
    assert code == 137, (code, text[-4000:])
    summary = re.search(r"^bert-ds deepspeed: 3 attempt\(s\), --max-restarts 2 used up: (.*); exit 137$", text, re.M)
    assert summary, text[-4000:]
    assert [int(n) for n in re.findall(r"attempt (\d): ", summary[1])] == [1, 2, 3], summary[1]
    assert summary[1].count("killed by SIGKILL (exit 137)") == 3, summary[1]
    records = _records(tmp_path / "run")
    assert [r.get("restart") for r in records] == [1, 2, None] and records[-1]["exit"] == 137, records
    assert len(set(killed)) >= 3, killed


def test_bad_recipe_is_not_restarted(data, tmp_path):
    args = _args(tmp_path, data)
    fault_recipe(tmp_path / "recipe.json", **{"phases.0.steps": 4, "phases.0.lr": -1.0})
    out = execute(Launch(_supervised(2, args)))
    assert out.returncode == 2, (out.returncode, out.text()[-4000:])
    assert not out.first_line(r"^bert-ds deepspeed: restart ") and not _records(tmp_path / "run"), out.text()[-4000:]


def test_preemption_is_not_restarted(data, tmp_path):
    def term(launcher: psutil.Process) -> str:
        launcher.send_signal(signal.SIGTERM)
        return "SIGTERM to the command"

    out = execute(Launch(_supervised(2, _args(tmp_path, data)), Trigger(r"^step 2 \|", term)))
    assert out.returncode == 75, (out.returncode, out.text()[-4000:])
    assert not out.first_line(r"^bert-ds deepspeed: restart ") and not _records(tmp_path / "run"), out.text()[-4000:]
    assert not out.survivors, out.survivors


def _kill_node1_rank_on(pattern: str, node0: subprocess.Popen, node1: psutil.Process, log: Path) -> int | None:
    """Copy node 0's output to ``log``; SIGKILL node 1's rank on node 0's first line matching ``pattern``. The target
    is found on the lines before it (rank 0 prints only after the rendezvous), so the kill costs one system call
    when the line arrives: the phase's last steps take well under a second and must not finish first. Returns the
    pid killed (None: the pattern never came)."""
    target, killed = None, None
    with log.open("w") as out:
        for line in node0.stdout:
            out.write(line)
            out.flush()
            if killed is None and target is None:
                with contextlib.suppress(psutil.Error, KeyError):
                    target = ranks(node1)[0]
            if killed is None and target is not None and re.search(pattern, line):
                target.kill()
                killed = target.pid
    return killed


def _tree_of(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [*root.children(recursive=True), root]
    except psutil.Error:
        return []


def test_two_nodes_restart_together_and_match(data, reference, tmp_path):
    """Two ``--no_ssh --node_rank`` supervisors (one rank each) on this machine; node 1's rank is killed: node 0's
    rank fails in its next collective (exit 1), each supervisor restarts its node and they meet on the same port."""
    hostfile = write_hostfile(tmp_path / "hostfile", hosts_from_list("node0:1,node1:1"))
    port, args = str(free_port()), _args(tmp_path, data)
    cmds = [_supervised(2, args, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node), "--master_addr",
                        "127.0.0.1", "--master_port", port) for node in (0, 1)]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    node1 = subprocess.Popen(cmds[1], cwd=REPO, env=child_env(), stdout=logs[1].open("w"), stderr=subprocess.STDOUT)
    node0 = subprocess.Popen(cmds[0], cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, errors="replace")
    trees, killed = [psutil.Process(p.pid) for p in (node0, node1)], []
    reader = threading.Thread(target=lambda: killed.append(_kill_node1_rank_on(r"^step 3 \|", node0, trees[1],
                                                                                logs[0])), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + HANG_GUARD_S  # a stuck supervisor fails this test, not its xdist worker
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in (node0, node1)]
    finally:
        for proc in [*_tree_of(trees[0]), *_tree_of(trees[1])]:  # no process of this test outlives it
            with contextlib.suppress(psutil.Error):
                proc.kill()
        reader.join(timeout=60)
    text = "".join(log.read_text() for log in logs)
    assert killed and killed[0] is not None and codes == [0, 0], (codes, text[-6000:])
    restarts = [r for r in _records(tmp_path / "run") if "restart" in r]
    assert len(restarts) == 2 and {r["restart"] for r in restarts} == {1}, restarts  # one per node
    assert any(r["attempt"]["code"] == 137 for r in restarts), restarts
    _equal(tmp_path / "run", reference)


def _slurm_rank(run: Path, procid: str) -> psutil.Process | None:
    """The ``srun`` task ``procid`` of the job training into ``run`` (its loader workers, which show the same command
    line, are its children)."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            cmd = proc.cmdline()
            if "bert_ds.runtime.pretrain" in cmd and str(run) in cmd and \
                    proc.environ().get("SLURM_PROCID") == procid and "bert_ds.runtime.pretrain" not in \
                    proc.parent().cmdline():
                return proc
    return None


@pytest.mark.slurm
def test_slurm_step_is_restarted_in_the_allocation_and_matches(data, reference, tmp_path):
    """``sbatch slurm/pretrain_base.sh`` on the one-node Slurm; rank 1 SIGKILLed on "step 3": the script starts the
    step again inside the same job (no requeue), the job completes, equal."""
    from bert_ds.runtime.caches import extensions_root

    args = _args(tmp_path, data)
    run, log = tmp_path / "run", tmp_path / "job.out"
    env = child_env(RECIPE=args[1], DATA128=str(data[0]), DATA512=str(data[1]), TOKENIZER=str(data[2]),
                    RUN_DIR=str(run), PYTHON=sys.executable, PHASE="1", MAX_RESTARTS="2", RESTART_BACKOFF="1",
                    TORCH_EXTENSIONS_DIR=str(extensions_root()))
    cmd = ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=20",
           f"--output={log}", f"--chdir={REPO}", str(REPO / "slurm" / "pretrain_base.sh")]
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    deadline, killed, rank = time.monotonic() + HANG_GUARD_S, None, None
    try:
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace") if log.exists() else ""
            rank = rank or (_slurm_rank(run, "1") if "progress watchdog" in text else None)  # found before step 3
            if killed is None and rank is not None and re.search(r"^step 3 \|", text, re.M):
                rank.kill()  # at once: steps 3 and 4 and the last save take a second
                killed = rank.pid
            if "ends for good" in text or "requeued" in text:
                break
            time.sleep(0.05)
    finally:
        subprocess.run(["scancel", job], capture_output=True) if time.monotonic() >= deadline else None
    time.sleep(1)
    text = log.read_text(errors="replace")
    assert killed is not None, text[-4000:]
    assert (run / "slurm" / f"exit-{job}").read_text().strip() == "0", text[-6000:]
    (record,) = [r for r in _records(run) if "restart" in r]
    assert record["restart"] == 1 and restart.retryable(record["attempt"]["code"]), record
    assert record["resumed"] == "phase1-step000002", record
    assert re.search(r"^bert_ds: 2 attempt\(s\) in this allocation \(MAX_RESTARTS=2\): attempt 1: exit \d+ after",
                     text, re.M), text[-4000:]
    _equal(run, reference)
