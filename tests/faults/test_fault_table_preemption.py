"""Fault-table rows for pre-emption by a process-group SIGTERM (issue 16 item 4): what Slurm pre-emption, scancel,
systemd and ``docker stop`` do — every process of the job is signalled, the ranks' DataLoader workers included.

Real ranks (``bert-ds deepspeed``: DeepSpeed's runner under bert_ds's supervisor, 2 CPU ranks, gloo) on the shipped
``ds_configs/tiny_cpu.json`` cut short by :func:`~tests.helpers.faults.fault_recipe` (dropout 0.1). The command is
started as a process-group leader so the test can signal the whole group with ``os.killpg``, as the schedulers do.
Every case asserts the command's own exit code is 75 (what a requeue script reads), with no process left. Rows go to
``$BERT_DS_FAULT_REPORT``.
"""
from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch

from bert_ds import checkpoint as ckpt
from tests.helpers.faults import FINAL_TAG, PHASE1_END, Launch, Trigger, execute, fault_recipe, report_row
from tests.helpers.ranks import rank_command, spawn_ranks
from tests.helpers.runs import weights

pytestmark = pytest.mark.e2e


def _args(recipe: Path, shards_128: Path, shards_512: Path, tokenizer: Path, run: Path, *extra: str) -> list[str]:
    return ["--recipe", str(recipe), "--data", str(shards_128), str(shards_512), "--tokenizer", str(tokenizer),
            "--output", str(run), *extra]


def _identical(run: Path, reference: Path) -> None:
    for tag in (PHASE1_END, FINAL_TAG):
        got, want = weights(run, tag), weights(reference, tag)
        differ = [name for name in want if not torch.equal(got[name], want[name])]
        assert not differ, f"{tag}: {len(differ)} of {len(want)} tensors differ from the uninterrupted run"


def _signalled_run(tmp_path: Path, shards_128: Path, shards_512: Path, tokenizer: Path, trigger: Trigger):
    """The 2-rank run (a loader worker per rank), started as a process-group leader and signalled by ``trigger``;
    returns its run directory, recipe and outcome."""
    run, recipe = tmp_path / "run", fault_recipe(tmp_path / "recipe.json")
    args = _args(recipe, shards_128, shards_512, tokenizer, run, "--num-workers", "1")
    return run, recipe, execute(Launch(rank_command(2, args), trigger, preexec=os.setsid))


def _resumes_exactly(run: Path, recipe: Path, shards_128: Path, shards_512: Path, tokenizer: Path,
                     reference: Path) -> None:
    spawn_ranks(2, _args(recipe, shards_128, shards_512, tokenizer, run, "--num-workers", "1", "--resume", "auto"),
                check=True)
    _identical(run, reference)


def _group_sigterm(launcher: psutil.Process) -> str:
    workers = [c.pid for c in launcher.children(recursive=True) if "multiprocessing" in " ".join(c.cmdline())]
    os.killpg(launcher.pid, signal.SIGTERM)
    return f"SIGTERM to process group {launcher.pid} (the command; its ranks' loader workers {workers})"


def _tree_sigterm(launcher: psutil.Process) -> str:
    """What Slurm's cgroup-wide pre-emption and ``docker stop``'s PID-namespace signal do: TERM to every process of
    the job at once, whatever its session (the supervisor, DeepSpeed's runner and launch.py, the ranks, workers)."""
    procs = [launcher, *launcher.children(recursive=True)]
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    return f"SIGTERM to every process of the job ({len(procs)}: command, runner, launch.py, ranks, workers)"


@pytest.mark.parametrize("deliver", [_group_sigterm, _tree_sigterm], ids=["group", "every-process"])
def test_group_sigterm_checkpoints_exits_75_and_resumes_exactly(fault_reference_run, shards_128, shards_512,
                                                                  tokenizer_dir, tmp_path, deliver):
    run, recipe, out = _signalled_run(tmp_path, shards_128, shards_512, tokenizer_dir, Trigger(r"^step 3 \|", deliver))
    message = out.first_line(r"pre-empted: checkpointed at phase 1 step \d+")
    lost = "not checked (an assertion above failed)"
    try:
        assert out.fault is not None, out.text()[-4000:]
        assert "a DataLoader worker died" not in out.text() and "worker" not in (message or ""), out.text()[-4000:]
        assert message is not None, out.text()[-4000:]
        step = int(re.search(r"phase 1 step (\d+)", message).group(1))
        tag = f"phase1-step{step:06d}"
        assert ckpt.read_latest(run / "checkpoints") == tag
        assert not out.survivors, out.survivors
        assert out.returncode == 75, (out.returncode, out.text()[-4000:])
        assert re.search(r"exits with return code = 75|exit 75", out.text()), out.text()[-4000:]
        _resumes_exactly(run, recipe, shards_128, shards_512, tokenizer_dir, fault_reference_run)
        lost = f"nothing: {tag} written; resumed to {FINAL_TAG} bit-identical to the uninterrupted run (dropout 0.1)"
    finally:
        report_row(f"{deliver.__name__.strip('_').replace('_', '-')}-workers", "4", out, message, lost)


def _sigterm_command(launcher: psutil.Process) -> str:
    launcher.send_signal(signal.SIGTERM)
    return f"SIGTERM to the command only (pid {launcher.pid}, what a supervisor signalling its child does)"


def _sigterm_deepspeed_runner(launcher: psutil.Process) -> str:
    runner = next(p for p in launcher.children() if "deepspeed.launcher.runner" in " ".join(p.cmdline()))
    runner.send_signal(signal.SIGTERM)
    return f"SIGTERM to DeepSpeed's runner only (pid {runner.pid}); DeepSpeed does not forward it"


@pytest.mark.parametrize("deliver", [_sigterm_command, _sigterm_deepspeed_runner], ids=["command", "ds-runner"])
def test_sigterm_to_the_runner_alone_checkpoints_exits_75_no_orphans(shards_128, shards_512, tokenizer_dir,
                                                                     tmp_path, deliver):
    """TERM to the command alone (the supervisor passes it to the ranks), or to DeepSpeed's runner alone (the ranks
    notice their runner is gone, bert_ds.lifecycle.runner_watch): the ranks checkpoint, the command exits 75 and
    nothing of the tree (launch.py, ranks, loader workers) outlives the harness's grace period."""
    run = tmp_path / "run"
    # The runner is polled about once a second, and the tiny recipe's 6 + 2 steps after step 3 take about as long
    # (seen: the run finished, every rank exit 0, before the ranks saw the runner gone): phase 1 runs long enough that
    # the stop always comes inside it; it ends the run at the next step boundary.
    recipe = fault_recipe(tmp_path / "recipe.json", **{"phases.0.steps": 200})
    args = _args(recipe, shards_128, shards_512, tokenizer_dir, run, "--num-workers", "1")
    out = execute(Launch(rank_command(2, args), Trigger(r"^step 3 \|", deliver)))
    message = out.first_line(r"pre-empted: checkpointed at phase \d step \d+")
    lost = "not checked (an assertion above failed)"
    try:
        assert out.fault is not None, out.text()[-4000:]
        assert message is not None, out.text()[-4000:]
        if deliver is _sigterm_deepspeed_runner:
            assert "the deepspeed runner (pid" in out.text(), out.text()[-4000:]
        assert out.returncode == 75, (out.returncode, out.text()[-4000:])
        phase, step = map(int, re.search(r"phase (\d) step (\d+)", message).groups())
        assert phase == 1 and "checkpointed" in message, message  # inside the long phase 1
        tag = f"phase1-step{step:06d}"
        assert ckpt.read_latest(run / "checkpoints") == tag
        assert not out.survivors, f"orphans: {out.survivors}"
        lost = f"nothing: {tag} written and loads; no orphan process"
        assert all(torch.isfinite(t).all() for t in weights(run, tag).values())
    finally:
        report_row(f"{deliver.__name__.strip('_').replace('_', '-')}", "4", out, message, lost)


@pytest.mark.parametrize("deliver", [_group_sigterm, _tree_sigterm], ids=["group", "every-process"])
def test_sigterm_during_startup_exits_75_having_written_nothing(fault_reference_run, shards_128, shards_512,
                                                                tokenizer_dir, tmp_path, deliver):
    """TERM as DeepSpeed's runner logs its command line, before any rank exists or trains: the command exits 75, no
    checkpoint is written, nothing survives, and ``--resume auto`` then trains the whole run bit for bit."""
    run, recipe, out = _signalled_run(tmp_path, shards_128, shards_512, tokenizer_dir,
                                      Trigger(r"runner\.py.*cmd = ", deliver))
    message = out.first_line(r"pre-empted |bert-ds deepspeed: SIGTERM")
    lost = "not checked (an assertion above failed)"
    try:
        assert out.fault is not None, out.text()[-4000:]
        assert out.returncode == 75, (out.returncode, out.text()[-4000:])
        assert "Traceback" not in out.text(), out.text()[-4000:]
        assert not out.survivors, out.survivors
        tags = sorted(p.name for p in (run / "checkpoints").glob("phase*")) if (run / "checkpoints").is_dir() else []
        assert tags == [], tags
        _resumes_exactly(run, recipe, shards_128, shards_512, tokenizer_dir, fault_reference_run)
        lost = f"nothing: no checkpoint written; the resumed run's {FINAL_TAG} bit-identical to the uninterrupted run"
    finally:
        report_row(f"startup-{deliver.__name__.strip('_').replace('_', '-')}", "4", out, message, lost)


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (``SigCgt`` in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
    return bool(mask >> (sig - 1) & 1)


def _signal_while_importing(cmd: list[str], sig: int) -> tuple[int, str]:
    """Start ``cmd`` and send ``sig`` the moment its process has a handler for it; its exit code and output."""
    import subprocess

    from tests.helpers import HANG_GUARD_S, child_env
    from tests.helpers.ranks import REPO

    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while proc.poll() is None and not _catches(proc.pid, sig):
            time.sleep(0.001)  # the window between that handler and main is the import of torch (seconds)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["TERM", "USR1"])
def test_a_signal_while_a_rank_imports_exits_75_having_written_nothing(shards_128, shards_512, tokenizer_dir, tmp_path,
                                                                       sig):
    """What Slurm's TERM-only pre-emption does to a rank ``srun`` has just started (``slurm/pretrain_common.sh`` runs
    ``python -m bert_ds.runtime.pretrain``): the signal arrives while it still imports torch and DeepSpeed, seconds
    before ``main`` arms its handler. Sent as soon as the module's first lines installed the recording handler
    (bert_ds.lifecycle.early_signals), it ends the rank with 75 before it joins a process group, nothing written; the
    line says the signal came while importing (without the early handler the rank died of it: 143, or the handler
    seen first was main's, "during start-up"). A machine so loaded that the signal reached the rank only after its
    imports is retried (up to 3 times): every attempt must still exit 75 having written nothing."""
    name = signal.Signals(sig).name
    for attempt in range(3):
        run, recipe = tmp_path / f"run{attempt}", fault_recipe(tmp_path / "recipe.json")
        code, out = _signal_while_importing(rank_command(1, _args(recipe, shards_128, shards_512, tokenizer_dir, run)),
                                            sig)
        assert code == 75, (code, out[-4000:])
        assert "Traceback" not in out, out[-4000:]
        assert not run.exists() or not list((run / "checkpoints").glob("phase*")), sorted(run.rglob("*"))
        line = re.search(rf"^pre-empted before joining the process group \({name} (while the rank was still importing|"
                         r"during start-up)\): nothing trained or written since the start; exit 75$", out, re.M)
        assert line, out[-4000:]
        if line[1].startswith("while"):
            return
    raise AssertionError(f"in 3 attempts {name} never reached a rank while it imported: {out[-2000:]}")
