"""The run directory's own rules, without DeepSpeed ranks: one run per directory (lock), debris of killed saves and
prunes, retention of phase-end checkpoints, fsync order, free-space check, RNG files and the weights_only guard."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bert_ds import checkpoint as ckpt
from bert_ds.checkpoint import save as ckpt_save
from bert_ds.config import model_preset
from tests.helpers import HANG_GUARD_S
from tests.helpers.run_state import fake_run_state
from tests.helpers.runs import REPO


def _tag(ckpt_dir: Path, tag: str, phase_done: bool = False) -> Path:
    (ckpt_dir / tag).mkdir(parents=True)
    (ckpt_dir / tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
    (ckpt_dir / tag / ckpt.RUN_STATE_NAME).write_text(json.dumps(fake_run_state(phase_done=phase_done).to_dict()))
    return ckpt_dir / tag


# ------------------------------------------------------------------------------------------------------- lock
def test_second_lock_is_refused_naming_the_holder_and_free_after_release(tmp_path):
    first = ckpt.acquire_run_lock(tmp_path / "run")
    with pytest.raises(ckpt.RunLockedError) as err:
        ckpt.acquire_run_lock(tmp_path / "run")  # flock is per open file: a second open conflicts, even in-process
    msg = str(err.value)
    assert f"pid {os.getpid()}" in msg and str(tmp_path / "run" / ".lock") in msg and "\n" not in msg
    first.release()
    ckpt.acquire_run_lock(tmp_path / "run").release()


def _holder(run_dir: Path) -> subprocess.Popen:
    # Holds the lock until killed (or until this process exits and its stdin closes), not for a time that a slow
    # machine could outrun.
    code = ("import sys; from bert_ds.checkpoint import acquire_run_lock; acquire_run_lock(sys.argv[1]); "
            "print('locked', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_lock_of_a_killed_process_is_taken_over(tmp_path):
    holder = _holder(tmp_path)
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == holder.pid
    with pytest.raises(ckpt.RunLockedError, match=f"pid {holder.pid} on host"):
        ckpt.acquire_run_lock(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=HANG_GUARD_S)
    lock = ckpt.acquire_run_lock(tmp_path)  # the file is still there, the flock died with its holder
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


@pytest.mark.e2e
def test_second_training_run_on_one_output_exits_2_before_compute(tmp_path, synthetic_data):
    from tests.helpers.runs import run_pretrain, write_recipe

    run = tmp_path / "run"
    holder = _holder(run)
    try:
        proc = run_pretrain(["--recipe", str(write_recipe(tmp_path / "r.json")), "--data", *map(str, synthetic_data),
                             "--output", str(run)], check=False)
    finally:
        holder.kill()
        holder.wait(timeout=HANG_GUARD_S)
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and f"pid {holder.pid}" in errors[0] and "in use by another bert_ds run" in errors[0]
    assert "step 1 " not in proc.stdout and not (run / "checkpoints").exists() and not (run / "tensorboard").exists()


# ------------------------------------------------------------------------------------------------------- debris
def test_kill_during_prune_leaves_no_half_tag_and_debris_is_removed(tmp_path, monkeypatch):
    d = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _tag(d, f"phase1-step00000{step}")
    (d / "latest").write_text("phase1-step000003")
    real_rmtree = shutil.rmtree

    def killed_midway(path, ignore_errors=False):
        next(Path(path).iterdir()).unlink()  # one file gone, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune_checkpoints(d, keep_last_k=2)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    # the half-deleted tag is hidden: never listed, resumed or exported
    assert ckpt.list_tags(d) == ["phase1-step000002", "phase1-step000003"]
    assert (d / ".phase1-step000001.deleting").is_dir()
    assert ckpt.remove_debris(d) == [".phase1-step000001.deleting"]
    assert sorted(p.name for p in d.iterdir()) == ["latest", "phase1-step000002", "phase1-step000003"]


def test_remove_debris_deletes_leftovers_and_restores_an_orphaned_old_tag(tmp_path):
    d = tmp_path / "checkpoints"
    _tag(d, "phase1-step000002")
    _tag(d, "phase1-step000003")
    (d / "latest").write_text("phase1-step000004")  # a re-save of step 4 was killed between its two renames
    _tag(d, "phase1-step000005.tmp")                   # a save killed while writing
    _tag(d, ".phase1-step000003.old")                  # replaced, the new phase1-step000003 is in place
    _tag(d, ".phase1-step000004.old")                  # replaced, but the new one never arrived: the only copy
    _tag(d, ".phase1-step000001.deleting")
    (d / ".latest.tmp").write_text("phase1-step000005")
    (d / "notes.txt").write_text("a user's file")      # not ours: left alone
    removed = ckpt.remove_debris(d)
    assert sorted(removed) == sorted([".latest.tmp", ".phase1-step000001.deleting", ".phase1-step000003.old",
                                      ".phase1-step000004.old", "phase1-step000005.tmp"])
    assert ckpt.list_tags(d) == ["phase1-step000002", "phase1-step000003", "phase1-step000004"]
    assert ckpt.read_latest(d) == "phase1-step000004" and (d / "notes.txt").is_file()
    assert ckpt.remove_debris(d) == []


def test_phase_end_checkpoints_survive_retention(tmp_path):
    d = tmp_path / "checkpoints"
    _tag(d, "phase1-step000010")
    _tag(d, "phase1-step000020", phase_done=True)
    for step in (5, 10, 15):
        _tag(d, f"phase2-step0000{step:02d}")
    (d / "latest").write_text("phase2-step000015")
    assert ckpt.prune_checkpoints(d, keep_last_k=2) == ["phase1-step000010", "phase2-step000005"]
    assert ckpt.list_tags(d) == ["phase1-step000020", "phase2-step000010", "phase2-step000015"]
    assert not any(p.name.endswith(".deleting") for p in d.iterdir())


def test_publish_syncs_the_tag_before_latest_names_it(tmp_path, monkeypatch):
    d = tmp_path / "checkpoints"
    _tag(d, "phase1-step000001")
    (d / "latest").write_text("phase1-step000001")
    tmp = _tag(d, "phase1-step000002.tmp")
    (d / ".latest.tmp").write_text("phase1-step000002")
    events = []
    real_replace = os.replace
    monkeypatch.setattr(ckpt_save, "_fsync", lambda path: events.append(("fsync", Path(path).name)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", Path(a).name, Path(b).name)),
                                                          real_replace(a, b)))
    ckpt_save._publish(d, tmp.name, "phase1-step000002")
    assert events == [("rename", "phase1-step000002.tmp", "phase1-step000002"), ("fsync", "checkpoints"),
                      ("rename", ".latest.tmp", "latest"), ("fsync", "checkpoints")]
    assert ckpt.read_latest(d) == "phase1-step000002"


# --------------------------------------------------------------------------------------------------- save time
def test_a_save_records_its_duration_beside_the_tags_and_a_resume_reads_it(tmp_path, caplog):
    """What pre-emption grace a save needs: logged after the save and kept in ``last_save.json`` beside the tags (not
    in a tag: its files are sealed by their digests), where a resumed run reads it at start-up."""
    d = tmp_path / "checkpoints"
    tag_dir = _tag(d, "phase1-step000003")
    sealed = (tag_dir / ckpt.RUN_STATE_NAME).read_bytes()
    digests = {"mp_rank_00_model_states.pt": {"size": 3 * 2**20, "sha256": "0"}, "rng_rank00000.pt": {"size": 2**19,
                                                                                                    "sha256": "1"}}
    with caplog.at_level("INFO", logger="bert_ds.checkpoint"):
        ckpt_save._record_save_time(d, "phase1-step000003", 1.23156, 2, digests)
    line = ("checkpoint save took 1.23 s (phase1-step000003, 2 rank(s), 3.5 MiB); pre-emption grace (Slurm KillWait "
            "/ --signal lead time) must exceed it")
    assert line in caplog.text
    record = ckpt.read_last_save(d)
    assert {k: record[k] for k in ("tag", "seconds", "world_size", "bytes")} == {
        "tag": "phase1-step000003", "seconds": 1.232, "world_size": 2, "bytes": 3 * 2**20 + 2**19}
    assert ckpt.save_time_line(record) == line
    assert (tag_dir / ckpt.RUN_STATE_NAME).read_bytes() == sealed and ckpt.list_tags(d) == ["phase1-step000003"]
    # A killed write leaves only its temp file, which is debris; the record itself is not.
    (d / ".last_save.json.tmp").write_text("{")
    assert ckpt.remove_debris(d) == [".last_save.json.tmp"] and ckpt.read_last_save(d) == record
    for broken in ("{", '{"tag": "phase1-step000003"}', "[]"):
        (d / ckpt.LAST_SAVE_NAME).write_text(broken)
        assert ckpt.read_last_save(d) is None  # advisory: an unreadable record is no record
    assert ckpt.read_last_save(tmp_path / "nowhere") is None


# ------------------------------------------------------------------------------------------------------- space
def test_free_space_check_uses_the_newest_checkpoint_or_the_model_size(tmp_path, monkeypatch):
    config = model_preset("tiny", vocab_size=1000)
    params = ckpt.parameter_count(config)
    assert ckpt.check_free_space(tmp_path / "new" / "run", config) == int(1.1 * 16 * params)
    d = ckpt.checkpoint_dir(tmp_path / "run")
    _tag(d, "phase1-step000001")
    needed = ckpt.check_free_space(tmp_path / "run", config)
    assert needed == int(1.1 * (1000 + (d / "phase1-step000001" / ckpt.RUN_STATE_NAME).stat().st_size))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=needed - 1))
    with pytest.raises(ckpt.CheckpointError, match=rf"{d}: 0.0 MiB free .* checkpoint phase1-step000001"):
        ckpt.check_free_space(tmp_path / "run", config)


def test_parameter_count_matches_the_model():
    from bert_ds.model import BertForPreTraining

    config = model_preset("tiny", vocab_size=1003, pad_vocab_to_multiple_of=8)
    model = BertForPreTraining(config, kernels="torch")
    assert ckpt.parameter_count(config) == sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------------- RNG
def test_rng_file_restores_every_stream_and_loads_weights_only(tmp_path, monkeypatch):
    cuda_states = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in cuda_states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.extend(states))
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    ckpt.save_rng_state(tmp_path / "rng.pt")
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    ckpt.load_rng_state(tmp_path / "rng.pt")
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want
    assert all(torch.equal(a, b) for a, b in zip(restored, cuda_states, strict=True)) and len(restored) == 2
    assert all(torch.is_tensor(s) for s in ckpt.load_tensor_file(tmp_path / "rng.pt")["cuda"])
