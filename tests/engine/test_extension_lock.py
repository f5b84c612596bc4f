"""A torch-extension build lock never makes a start wait silently: a stale one is one error naming the file (exit 2,
before compute); a fresh one (a build in progress) is waited for with a log line and passes once it goes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from bert_ds.runtime.caches import wait_for_extension_builds
from bert_ds.runtime.pretrain import EXIT_BAD_INPUT
from tests.helpers import HANG_GUARD_S
from tests.helpers.runs import REPO, write_recipe


def _lock(root, age_s: float):
    lock = root / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


@pytest.mark.e2e
def test_stale_lock_stops_a_real_start_naming_the_file(synthetic_data, tmp_path):
    lock = _lock(tmp_path / "ext", age_s=7200)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    tokenizer = synthetic_data[0].parent / "tokenizer"
    proc = subprocess.run([sys.executable, "-m", "bert_ds.runtime.pretrain",
                           "--recipe", str(write_recipe(tmp_path / "r.json")),
                           "--data", *map(str, synthetic_data), "--tokenizer", str(tokenizer),
                           "--output", str(tmp_path / "run")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("bert_ds.runtime.pretrain: error:")]
    assert len(error) == 1 and f"rm {lock}" in error[0], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_build_in_progress_is_waited_for_out_loud(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _lock(tmp_path, age_s=5)
    threading.Timer(1.0, lock.unlink).start()  # the "build" finishes after a second
    with caplog.at_level(logging.WARNING, logger="bert_ds.runtime.caches"):
        wait_for_extension_builds(stale_after_s=600, poll_s=0.1)
    assert not lock.exists() and any(str(lock) in r.getMessage() for r in caplog.records)


def test_lock_turning_stale_while_waiting_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    _lock(tmp_path, age_s=0)
    with pytest.raises(ValueError, match="BERT_DS_EXTENSION_LOCK_STALE_S"):
        wait_for_extension_builds(stale_after_s=0.5, poll_s=0.1)
