"""Fault-table row for a hang (issue 23 item 4): one rank stops making progress (SIGSTOP), the other blocks in the
step's all-reduce; the hang watchdog (``bert_ds.lifecycle.hang_watchdog``) ends the job with exit 124 and a line
naming the stopped rank's host, local rank and pid.

Real ranks (``deepspeed`` runner, 2 CPU ranks, gloo) on ``ds_configs/tiny_cpu.json`` cut by
:func:`~tests.helpers.faults.fault_recipe`, with phase 1 long enough that the run is still training when the rank
stops and no checkpoint or evaluation due meanwhile (a save is a slow stretch, allowed ``SLOW_FLOOR_S``). Without the
watchdog (``--step-timeout 0``) the same fault leaves the job waiting for the process-group timeout (10 minutes) and
then failing without naming a rank. The row goes to ``$BERT_DS_FAULT_REPORT``.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import psutil
import pytest

from bert_ds import checkpoint as ckpt
from bert_ds.exit_codes import ExitCode
from bert_ds.lifecycle import hang_watchdog
from tests.helpers.faults import Launch, Trigger, execute, fault_recipe, ranks, report_row
from tests.helpers.ranks import rank_command, spawn_ranks

# waits: the step timeout, then the launcher's grace before it kills the stopped rank
pytestmark = [pytest.mark.e2e, pytest.mark.waits]

STEP_TIMEOUT_S = 20
SLACK_S = 150
"""Beyond the bound: the watchdog's naming window (5 s at this bound), the launcher's 1 s poll, its 30 s wait before it
SIGKILLs the stopped rank (a stopped process ignores SIGTERM), a loaded 2-core machine. Far below the 10-minute
process-group timeout that would otherwise end the job."""


def _stop_rank_in_a_step(run: Path, rank: int, stopped: dict):
    """SIGSTOP ``rank`` once its heartbeat (written every beat, 1 s at this bound) shows it in a training step after
    the first of the run: a tiny step takes a fraction of a beat, so the console line alone may come before it."""
    def act(launcher: psutil.Process) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            hb = hang_watchdog.read_heartbeats(run, 2)[rank]
            step = re.search(r"step (\d+): training step", hb.doing) if hb else None
            if step and int(step.group(1)) >= 5:
                break
            time.sleep(0.05)
        target = ranks(launcher)[rank]
        target.suspend()  # SIGSTOP
        stopped.update(pid=target.pid)
        return f"SIGSTOP to rank {rank} (pid {target.pid})"
    return act


def test_sigstop_of_one_rank_exits_124_naming_it(shards_128, shards_512, tokenizer_dir, tmp_path):
    run = tmp_path / "run"
    # A long phase 1, no checkpoint on the way: the stop lands in a training step, not in a save.
    recipe = fault_recipe(tmp_path / "recipe.json", **{"phases.0.steps": 400, "phases.0.checkpoint_interval": 0})
    base = ["--recipe", str(recipe), "--data", str(shards_128), str(shards_512), "--tokenizer", str(tokenizer_dir),
            "--output", str(run)]
    spawn_ranks(2, [*base, "--max-steps", "2"], check=True)  # the checkpoint the stalled run resumes (not under test)
    stopped: dict = {}
    out = execute(Launch(rank_command(2, [*base, "--resume", "auto", "--step-timeout", str(STEP_TIMEOUT_S)]),
                         Trigger(r"^step 4 \|", _stop_rank_in_a_step(run, 1, stopped))))
    message = out.first_line(r"^bert_ds\.runtime\.pretrain: error: stalled:")
    lost = "not checked (an assertion above failed)"
    try:
        assert out.fault is not None, out.text()[-4000:]
        assert out.returncode == ExitCode.STALLED == 124, f"exit {out.returncode}\n{out.text()[-5000:]}"
        assert message is not None, out.text()[-5000:]
        named = f"rank 1 (host {socket.gethostname()}, local rank 1, pid {stopped['pid']}) last did 'phase 1 step "
        assert message.startswith(f"bert_ds.runtime.pretrain: error: stalled: {named}"), out.text()[-8000:]
        assert "training step" in message and "not responding" in message and "seen by rank 0" in message, message
        assert out.seconds < STEP_TIMEOUT_S + SLACK_S, f"{out.seconds:.0f} s from SIGSTOP to exit"
        assert not out.survivors, f"processes outlived the command: {out.survivors}"
        assert not psutil.pid_exists(stopped["pid"]) or psutil.Process(stopped["pid"]).status() == "zombie"
        # Nothing lost: the checkpoint before the stall is still the newest, intact; the run resumes from it.
        ckpt_dir = run / "checkpoints"
        assert ckpt.read_latest(ckpt_dir) == "phase1-step000002"
        assert not [p.name for p in ckpt_dir.iterdir() if p.name.endswith((".tmp", ".old", ".deleting"))]
        assert ckpt.verify_tag(ckpt_dir / "phase1-step000002") == []
        done = spawn_ranks(2, [*base, "--resume", "auto", "--max-steps", "4"], check=True)
        assert re.search(r"resumed phase1-step000002", done.stdout + done.stderr) and ckpt.read_latest(ckpt_dir) == \
            "phase1-step000004", done.stderr[-4000:]
        lost = ("nothing: latest=phase1-step000002 intact, no partial tag; --resume auto continued to "
                "phase1-step000004; no process left")
    finally:
        report_row("sigstop-rank1", "23.4", out, message, lost)
