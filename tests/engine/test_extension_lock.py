"""A torch-extension build lock never strands a start: bert_ds builds and loads extensions holding an OS file lock
that dies with its holder (``bert_ds.runtime.caches.holding_build_lock``), so torch's own lock file left by a killed
build is removed by the next start (which rebuilds, or finds the build done), and a live build is waited for out
loud."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from bert_ds.runtime import caches
from bert_ds.runtime.caches import HOLDER_LOCK_NAME, extensions_root, holding_build_lock
from tests.helpers import HANG_GUARD_S
from tests.helpers.runs import REPO, write_recipe


def _torch_lock(root, age_s: float = 0.0):
    lock = root / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_lock_without_a_live_holder_is_removed_at_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _torch_lock(tmp_path, age_s=60)  # a minute: no 30-minute staleness rule, the holder lock decides
    with caplog.at_level(logging.WARNING, logger="bert_ds.runtime.caches"), holding_build_lock(poll_s=0.1):
        assert not lock.exists()
        assert (tmp_path / HOLDER_LOCK_NAME).read_text().startswith(f"pid {os.getpid()} on ")
    assert any(f"removing {lock}: left by an extension build that was killed" in r.getMessage()
               for r in caplog.records)
    assert not any("waiting for" in r.getMessage() for r in caplog.records)


def test_a_brief_load_by_another_program_is_left_alone_and_a_young_orphan_goes_later(tmp_path, monkeypatch, caplog):
    """torch takes its lock for a moment on every load, also in programs that do not take bert_ds's holder lock: a
    young lock is waited on, not removed, while it lives; one that stays past BRIEF_LOCK_S is an orphan."""
    import threading

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    # Generous while the owner lives (its release may be late on a loaded machine), short for the orphan below.
    monkeypatch.setattr(caches, "BRIEF_LOCK_S", 600.0)
    brief = _torch_lock(tmp_path)
    removed_by_owner = []

    def owner_releases():
        brief.unlink()  # FileBaton.release: os.remove, which raises if someone else removed it first
        removed_by_owner.append(True)

    owner = threading.Timer(0.3, owner_releases)
    owner.start()
    with caplog.at_level(logging.WARNING, logger="bert_ds.runtime.caches"), holding_build_lock(poll_s=0.05):
        pass
    owner.join()
    assert removed_by_owner == [True] and "removing" not in caplog.text
    monkeypatch.setattr(caches, "BRIEF_LOCK_S", 0.5)
    orphan = _torch_lock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="bert_ds.runtime.caches"), holding_build_lock(poll_s=0.05):
        assert not orphan.exists()
    assert f"removing {orphan}" in caplog.text


@pytest.mark.parametrize("note_after_s", [0.2, 600.0], ids=["long-wait-named", "short-wait-quiet"])
def test_a_live_build_is_waited_for_and_its_lock_kept(tmp_path, monkeypatch, caplog, note_after_s):
    """Another process holds the build lock and torch's lock (a build in progress): the start waits, never touching
    that build's lock (the holder checks it is still there before it finishes), and names the holder once the wait
    passes WAIT_NOTE_AFTER_S -- not before: every start's other ranks wait a moment while the first loads."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(caches, "WAIT_NOTE_AFTER_S", note_after_s)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, pathlib, sys, time
        root = pathlib.Path({str(tmp_path)!r})
        fd = os.open(root / {HOLDER_LOCK_NAME!r}, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"pid {{os.getpid()}} on testhost\\n".encode())
        lock = root / "deepspeed_shm_comm" / "lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.touch()
        print("holding", flush=True)
        time.sleep(2)
        if not lock.exists():
            sys.exit(3)  # someone removed the lock of a live build
        lock.unlink()
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    with caplog.at_level(logging.WARNING, logger="bert_ds.runtime.caches"), holding_build_lock(poll_s=0.1):
        pass
    assert holder.wait(timeout=HANG_GUARD_S) == 0
    waits = [r.getMessage() for r in caplog.records if "waiting for the extension build" in r.getMessage()]
    if note_after_s < 2:  # the holder holds for 2 s
        assert len(waits) == 1 and f"pid {holder.pid} on testhost" in waits[0], caplog.text
    else:
        assert waits == [], caplog.text


@pytest.mark.e2e
def test_a_killed_build_costs_the_next_start_nothing_more(synthetic_data, tmp_path):
    """A real start on a build directory holding the finished build and torch's lock left by a killed one (2 hours
    old): the start removes the lock, loads the extension and trains (exit 0); it used to wait 30 minutes and exit
    2."""
    ext = tmp_path / "ext"
    shutil.copytree(extensions_root(), ext, symlinks=True, ignore=shutil.ignore_patterns(HOLDER_LOCK_NAME, "lock"))
    lock = _torch_lock(ext, age_s=7200)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(ext)}
    tokenizer = synthetic_data[0].parent / "tokenizer"
    proc = subprocess.run([sys.executable, "-m", "bert_ds.runtime.pretrain",
                           "--recipe", str(write_recipe(tmp_path / "r.json")), "--data", *map(str, synthetic_data),
                           "--tokenizer", str(tokenizer), "--output", str(tmp_path / "run"), "--max-steps", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not lock.exists()
    assert f"removing {lock}: left by an extension build that was killed" in proc.stderr, proc.stderr[-3000:]
