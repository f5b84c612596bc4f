"""Start-up refusals of ``bert_ds.runtime.pretrain`` (issue 16 item 7): one line naming the cause, exit 2."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import HANG_GUARD_S, child_env

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def _pretrain(tmp_path: Path, output: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bert_ds.runtime.pretrain", "--recipe",
                           str(REPO / "ds_configs" / "tiny_cpu.json"), "--data", str(tmp_path), str(tmp_path),
                           "--tokenizer", str(tmp_path), "--output", str(output)],
                          cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_master_port_in_use_is_one_line_exit_2(tmp_path):
    """Rank 0 cannot listen on a MASTER_PORT another process holds: one line naming the port, exit 2 (was torch's
    multi-line DistNetworkError traceback, exit 1)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = _pretrain(tmp_path, tmp_path / "run", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [f"bert_ds.runtime.pretrain: error: MASTER_PORT={port} is already in use on "
                      f"{socket.gethostname()} (another job or process group listens there); export MASTER_PORT as "
                      f"a free port (deepspeed --master_port N)"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def _one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def test_output_that_is_a_file_is_one_line_exit_2(tmp_path):
    output = tmp_path / "run"
    output.write_text("not a run directory\n")
    line = _one_error(_pretrain(tmp_path, output))
    assert line == (f"bert_ds.runtime.pretrain: error: --output {output}: {output} is a file, not a directory; name "
                    f"a run directory")
    assert output.read_text() == "not a run directory\n"


def test_output_on_a_read_only_file_system_is_one_line_exit_2(tmp_path):
    """A real read-only mount (tmpfs, ro): needs root to mount; skipped elsewhere."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True,
                             timeout=60)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        line = _one_error(_pretrain(tmp_path, mnt / "run"))
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=60)
    assert line == (f"bert_ds.runtime.pretrain: error: --output {mnt / 'run'}: {mnt} is on a read-only file system; "
                    f"name a writable run directory")
