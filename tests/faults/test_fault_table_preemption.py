"""Fault-table rows for pre-emption by a process-group SIGTERM (issue 16 item 4): what Slurm pre-emption, scancel,
systemd and ``docker stop`` do — every process of the job is signalled, the ranks' DataLoader workers included.

Real ranks (``deepspeed`` runner, 2 CPU ranks, gloo) on the shipped ``ds_configs/tiny_cpu.json`` cut short by
:func:`~tests.helpers.faults.fault_recipe` (dropout 0.1). The runner is started as a process-group leader so the test
can signal the whole group with ``os.killpg``, as the schedulers do. Rows go to ``$BERT_DS_FAULT_REPORT``.
"""
from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import psutil
import pytest
import torch

from bert_ds import checkpoint as ckpt
from tests.helpers.faults import FINAL_TAG, PHASE1_END, Launch, Trigger, execute, fault_recipe, report_row
from tests.helpers.ranks import rank_command
from tests.helpers.runs import weights

pytestmark = pytest.mark.e2e


def _args(recipe: Path, shards_128: Path, shards_512: Path, tokenizer: Path, run: Path, *extra: str) -> list[str]:
    return ["--recipe", str(recipe), "--data", str(shards_128), str(shards_512), "--tokenizer", str(tokenizer),
            "--output", str(run), *extra]


@pytest.fixture(scope="module")
def reference_run(shards_128, shards_512, tokenizer_dir, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank run (dropout 0.1) a resume must reproduce bit for bit."""
    root = tmp_path_factory.mktemp("preemption_reference")
    done = execute(Launch(rank_command(2, _args(fault_recipe(root / "recipe.json"), shards_128, shards_512,
                                                tokenizer_dir, root / "run"))))
    assert done.returncode == 0, done.text()[-4000:]
    return root / "run"


def _identical(run: Path, reference: Path) -> None:
    for tag in (PHASE1_END, FINAL_TAG):
        got, want = weights(run, tag), weights(reference, tag)
        differ = [name for name in want if not torch.equal(got[name], want[name])]
        assert not differ, f"{tag}: {len(differ)} of {len(want)} tensors differ from the uninterrupted run"


def _group_sigterm(launcher: psutil.Process) -> str:
    workers = [c.pid for c in launcher.children(recursive=True) if "multiprocessing" in " ".join(c.cmdline())]
    os.killpg(launcher.pid, signal.SIGTERM)
    return f"SIGTERM to process group {launcher.pid} (runner, launcher, ranks, loader workers {workers})"


def test_group_sigterm_checkpoints_exits_75_and_resumes_exactly(reference_run, shards_128, shards_512,
                                                                  tokenizer_dir, tmp_path):
    run = tmp_path / "run"
    recipe = fault_recipe(tmp_path / "recipe.json")
    args = _args(recipe, shards_128, shards_512, tokenizer_dir, run, "--num-workers", "1")
    out = execute(Launch(rank_command(2, args), Trigger(r"^step 3 \|", _group_sigterm), preexec=os.setsid))
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
        # The ranks exit 75; the runner, itself killed by the group's TERM, reports -15 (or 75 when it outlives them).
        assert out.returncode in (75, -signal.SIGTERM), (out.returncode, out.text()[-4000:])
        assert re.search(r"exits with return code = 75|exit 75", out.text()), out.text()[-4000:]
        done = execute(Launch(rank_command(2, _args(recipe, shards_128, shards_512, tokenizer_dir, run,
                                                    "--num-workers", "1", "--resume", "auto"))))
        assert done.returncode == 0 and not done.survivors, done.text()[-4000:]
        _identical(run, reference_run)
        lost = f"nothing: {tag} written; resumed to {FINAL_TAG} bit-identical to the uninterrupted run (dropout 0.1)"
    finally:
        report_row("group-sigterm-workers", "4", out, message, lost)


def _sigterm_runner(launcher: psutil.Process) -> str:
    launcher.send_signal(signal.SIGTERM)
    return f"SIGTERM to the deepspeed runner only (pid {launcher.pid}); DeepSpeed does not forward it"


def test_sigterm_to_the_runner_alone_checkpoints_exits_75_no_orphans(shards_128, shards_512, tokenizer_dir,
                                                                     tmp_path):
    """The ranks notice their runner is gone (bert_ds.runtime.watchdog), checkpoint and exit 75: nothing of the
    tree (launch.py, ranks, loader workers) outlives the harness's grace period."""
    run = tmp_path / "run"
    recipe = fault_recipe(tmp_path / "recipe.json")
    args = _args(recipe, shards_128, shards_512, tokenizer_dir, run, "--num-workers", "1")
    out = execute(Launch(rank_command(2, args), Trigger(r"^step 3 \|", _sigterm_runner)))
    # Polled about once a second: the tiny recipe runs several steps (possibly into phase 2) before the ranks notice.
    message = out.first_line(r"pre-empted: checkpointed at phase \d step \d+")
    lost = "not checked (an assertion above failed)"
    try:
        assert out.fault is not None, out.text()[-4000:]
        assert message is not None, out.text()[-4000:]
        assert "the deepspeed runner (pid" in out.text(), out.text()[-4000:]
        assert re.search(r"exits with return code = 75", out.text()), out.text()[-4000:]
        phase, step = map(int, re.search(r"phase (\d) step (\d+)", message).groups())
        tag = f"phase{phase}-step{step:06d}"
        assert ckpt.read_latest(run / "checkpoints") == tag
        assert not out.survivors, f"orphans: {out.survivors}"
        lost = f"nothing: {tag} written and loads; no orphan process"
        assert all(torch.isfinite(t).all() for t in weights(run, tag).values())
    finally:
        report_row("runner-sigterm", "4", out, message, lost)
