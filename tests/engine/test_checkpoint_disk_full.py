"""A checkpoint save that runs out of space: one line naming the directory and the space needed (exit 2), the partial
``<tag>.tmp`` removed, ``latest`` and the previous checkpoint intact. Writes really fail: a file-size limit on one
rank of two (EFBIG, both ranks must agree), and a full tmpfs (ENOSPC) where the test may mount one."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from bert_ds import checkpoint as ckpt
from tests.helpers import HANG_GUARD_S, child_env
from tests.helpers.ranks import REPO, rank_command, run_ranks
from tests.helpers.runs import run_pretrain

_LIMITED_RANK = """\
import os, resource, runpy, signal, sys
if os.environ.get("RANK") == "1":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
sys.argv[0] = "bert_ds/runtime/pretrain.py"
runpy.run_module("bert_ds.runtime.pretrain", run_name="__main__")
"""


def _recipe(path: Path) -> Path:
    recipe = json.loads((REPO / "ds_configs" / "tiny_cpu.json").read_text())  # shipped, dropout on, ZeRO 2
    path.write_text(json.dumps(recipe))
    return path


def _assert_failed_cleanly(proc: subprocess.CompletedProcess, run: Path, lines_expected: int) -> None:
    ckpt_dir = run / "checkpoints"
    errors = [ln for ln in proc.stderr.splitlines() if "cannot save checkpoint phase1-step000002" in ln]
    assert proc.returncode == 74, proc.stderr[-4000:]  # ExitCode.IO_ERROR: the storage failed, not the input
    assert len(errors) == lines_expected, proc.stderr[-4000:]
    assert f" in {ckpt_dir} (" in errors[0] and "MiB free there, a checkpoint of this run needs about" in errors[0]
    assert "'latest' still names phase1-step000001" in errors[0] and "Traceback" not in proc.stderr
    assert sorted(p.name for p in ckpt_dir.iterdir() if "phase" in p.name) == ["phase1-step000001"]
    assert not (ckpt_dir / ".latest.tmp").exists()
    assert ckpt.read_latest(ckpt_dir) == "phase1-step000001"
    assert ckpt.consolidated_state_dict(ckpt_dir, "phase1-step000001")  # the previous checkpoint still loads


@pytest.mark.e2e
def test_one_rank_cannot_write_its_partition(tmp_path, synthetic_data):
    recipe, run = _recipe(tmp_path / "r.json"), tmp_path / "run"
    args = ["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--output", str(run),
            "--tokenizer", str(synthetic_data[0].parent / "tokenizer")]
    run_pretrain([*args, "--max-steps", "1"], nprocs=2)
    script = tmp_path / "limited_rank.py"
    script.write_text(_LIMITED_RANK)
    proc = run_ranks(rank_command(2, [*args, "--resume", "auto", "--max-steps", "2"], script=script))
    _assert_failed_cleanly(proc, run, lines_expected=2)  # each rank says it; rank 1 names the failed write
    causes = sorted(ln.split(" (", 1)[1].split(")")[0][:12] for ln in proc.stderr.splitlines()
                    if "cannot save checkpoint" in ln)
    assert causes == ["RuntimeError", "the save fai"], causes  # torch.save's error on rank 1; rank 0 agreed


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96M", "tmpfs", str(mnt)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root): the file-size-limit test covers the failure path")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def _resume_filling_the_disk(args: list[str], mnt: Path, leave_bytes: int) -> subprocess.CompletedProcess:
    """Resume to step 2; once pre-flight has passed (the "resumed" log line), fill the filesystem up to
    ``leave_bytes`` so that the step-2 save runs out of space mid-write (ENOSPC), as when another job fills it."""
    cmd = rank_command(1, [*args, "--resume", "auto", "--max-steps", "2",
                           "--tokenizer", str(Path(args[args.index("--data") + 1]).parent / "tokenizer")])
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    stderr = []
    for line in proc.stderr:
        stderr.append(line)
        if "resumed phase1-step000001" in line:
            with open(mnt / "filler", "wb") as f:
                f.write(b"\0" * max(0, shutil.disk_usage(mnt).free - leave_bytes))
            break
    stdout, rest = proc.communicate(timeout=HANG_GUARD_S)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, "".join(stderr) + rest)


@pytest.mark.e2e
def test_full_filesystem(small_tmpfs, tmp_path, synthetic_data):
    """One rank, ZeRO 2, a 96 MB tmpfs. Pre-flight refuses a run with no room for one more checkpoint (nothing
    written); when the disk fills only after pre-flight, the save runs out of space mid-write and fails cleanly."""
    recipe, run = _recipe(tmp_path / "r.json"), small_tmpfs / "run"
    args = ["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--output", str(run)]
    run_pretrain([*args, "--max-steps", "1"])
    (small_tmpfs / "ballast").write_bytes(b"\0" * (shutil.disk_usage(small_tmpfs).free - 8 * 2**20))
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = run_pretrain([*args, "--resume", "auto", "--max-steps", "2"], check=False)
    assert proc.returncode == 2 and "free on its filesystem, but a checkpoint needs about" in proc.stderr, proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before  # refused before compute
    (small_tmpfs / "ballast").unlink()

    used = shutil.disk_usage(small_tmpfs).used
    proc = _resume_filling_the_disk(args, small_tmpfs, leave_bytes=4 * 2**20)
    (small_tmpfs / "filler").unlink()
    _assert_failed_cleanly(proc, run, lines_expected=1)
    assert "RuntimeError" in proc.stderr or "OSError" in proc.stderr, proc.stderr[-3000:]
    assert shutil.disk_usage(small_tmpfs).used <= used + 2**20  # the partial tag no longer holds the disk
