"""The run directory's lock (one live run per ``--output``) and the disk space a checkpoint needs.

``RUN_DIR/.lock`` (``flock``, held by rank 0 for the run's life, :func:`hold_run_dir`) refuses a second run on the same
``--output``, naming the holder; the kernel drops the lock of a dead process, so a stale one is taken over. Pre-flight
(:func:`check_free_space`) refuses a run whose filesystem cannot hold one more checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bert_ds.checkpoint.layout import (
    RunLockedError,
    _any_rank,
    checkpoint_dir,
    list_tags,
    remove_debris,
    resolve_tag,
)
from bert_ds.config import BertConfig
from bert_ds.safe_load import CheckpointError

__all__ = ["BYTES_PER_PARAMETER", "LOCK_NAME", "RunLock", "acquire_run_lock", "bytes_needed", "check_free_space",
           "hold_run_dir", "parameter_count", "reader_lock_path", "reading_tag", "try_exclusive_tag"]

LOCK_NAME = ".lock"
BYTES_PER_PARAMETER = 16
"""Checkpoint bytes per model parameter when no checkpoint exists yet to measure: fp32 ZeRO 1/2 writes the module's
weights (4) + the fp32 master partition (4) + two optimizer moments (8); fp16/bf16 write 2 + 4 + 8."""


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bytes_needed(ckpt_dir: Path, num_parameters: int) -> tuple[int, str]:
    """Bytes one more checkpoint needs, and how that was estimated: 1.1 x the newest complete tag, or
    :data:`BYTES_PER_PARAMETER` x the model's parameters before the first."""
    tags = list_tags(ckpt_dir)
    if tags:
        return int(1.1 * _tree_bytes(ckpt_dir / tags[-1])), f"1.1 x checkpoint {tags[-1]}"
    return int(1.1 * (BYTES_PER_PARAMETER * num_parameters)), f"{BYTES_PER_PARAMETER} B x {num_parameters:,} parameters"


def parameter_count(config: BertConfig) -> int:
    """Parameters of :class:`bert_ds.model.BertForPreTraining` for ``config`` (decoder weight tied to the word
    embeddings), without building the model."""
    h, i, v = config.hidden_size, config.intermediate_size, config.padded_vocab_size
    embeddings = (v + config.max_position_embeddings + config.type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h  # q, k, v, out; FFN in, out; two LayerNorms
    heads = (h * h + h) + (h * h + h) + 2 * h + v + (2 * h + 2)  # pooler; MLM transform + LayerNorm + bias; NSP
    return embeddings + config.num_hidden_layers * layer + heads


def check_free_space(run_dir: str | Path, model_config: BertConfig) -> int:
    """Pre-flight: the run directory's filesystem must hold one more checkpoint (:func:`bytes_needed`). Returns the
    bytes needed; raises CheckpointError naming the directory, what is free and what is needed."""
    ckpt = checkpoint_dir(run_dir)
    needed, basis = bytes_needed(ckpt, parameter_count(model_config))
    existing = Path(run_dir).absolute()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise CheckpointError(f"{ckpt}: {free / 2**20:,.1f} MiB free on its filesystem, but a checkpoint needs about "
                              f"{needed / 2**20:,.1f} MiB ({basis}); free space or choose another --output")
    return needed


@dataclass
class RunLock:
    """``RUN_DIR/.lock`` held with ``flock`` until :meth:`release` or the process ends (the kernel then drops it)."""

    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock; the file stays (deleting it would race)
            self.fd = None


def acquire_run_lock(run_dir: str | Path) -> RunLock:
    """Lock ``run_dir`` for this process, recording host, pid and start time in the lock file; RunLockedError naming
    the holder when a live process holds it. A lock file left by a dead process is not held (flock dies with its
    holder) and is taken over silently. On NFS, Linux maps flock to POSIX locks, which the server arbitrates."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        try:
            h = json.loads(holder)
            who = f"pid {h['pid']} on host {h['host']}, started {h['started']}"
        except (ValueError, KeyError, TypeError):
            who = "a process that is still starting"
        raise RunLockedError(f"{run_dir} is in use by another bert_ds run ({who}; lock file {path}): two runs on one "
                             f"--output would overwrite each other's checkpoints. Wait for it to end or choose "
                             f"another --output") from None
    info = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    return RunLock(path, fd)


def hold_run_dir(run_dir: str | Path, rank: int) -> RunLock | None:
    """Every rank calls this before the run writes anything: rank 0 takes :func:`acquire_run_lock` and removes the
    debris of interrupted saves; all ranks agree, so when the lock is held elsewhere every rank raises
    RunLockedError (exit 2, nothing computed). Returns rank 0's lock (release it when the run ends), None elsewhere."""
    lock, refusal = None, None
    if rank == 0:
        try:
            lock = acquire_run_lock(run_dir)
        except RunLockedError as exc:
            refusal = exc
    if _any_rank(refusal is not None):
        raise refusal or RunLockedError(f"{run_dir}: rank 0 could not lock it (another run holds it; see rank 0's "
                                        f"error)")
    if lock is not None:
        remove_debris(checkpoint_dir(run_dir))
    return lock


# ---- readers against pruning ----------------------------------------------------------------------------------------
# A reader (converter, evaluation) holds a shared flock on CKPT/.<tag>.readers while it reads the tag; pruning tries an
# exclusive, non-blocking flock on the same file and skips the tag when a reader holds it (the next save's prune takes
# it). A plain file beside the tag, not the tag directory: Linux maps flock to POSIX locks on NFS, which need a file
# opened for writing.


def reader_lock_path(ckpt_dir: str | Path, tag: str) -> Path:
    return Path(ckpt_dir) / f".{tag}.readers"


@contextlib.contextmanager
def try_exclusive_tag(ckpt_dir: str | Path, tag: str) -> Iterator[bool]:
    """Pruning: yields True holding the tag's reader lock exclusively (no reader; the lock file is removed on the way
    out, with the tag), False when a reader holds it."""
    path = reader_lock_path(ckpt_dir, tag)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            path.unlink(missing_ok=True)  # before the flock goes: a reader waiting on it then sees its tag is gone
    finally:
        os.close(fd)


@contextlib.contextmanager
def reading_tag(ckpt_dir: str | Path, tag: str | None = None) -> Iterator[str]:
    """Resolve ``tag`` (``latest`` unless given) and hold it against pruning while the body reads it; yields the tag.
    A tag pruned between resolving and locking: ``latest`` is resolved again; an explicit tag is a CheckpointError
    naming it (one line, exit 2). The last reader out removes the lock file."""
    ckpt_dir = Path(ckpt_dir)
    for _ in range(5):
        resolved = resolve_tag(ckpt_dir, tag)
        path = reader_lock_path(ckpt_dir, resolved)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # a read-only copy of a run: nobody prunes it
            yield resolved
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a prune deletes this very tag
            if not (ckpt_dir / resolved).is_dir():
                if tag is not None:
                    raise CheckpointError(f"{ckpt_dir / resolved}: pruned by the training writing this run while it "
                                          f"was being opened; pass a tag training keeps (phase ends are never "
                                          f"pruned), or run again")
                continue
            if not _same_file(path, fd):  # a reader leaving removed the file after we opened it: lock the new one
                continue
            try:
                yield resolved
            finally:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other reader: tidy up
                    path.unlink(missing_ok=True)
                except BlockingIOError:
                    pass
            return
        finally:
            os.close(fd)
    raise CheckpointError(f"{ckpt_dir}: the newest tag kept being pruned while it was being opened; run again")


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False
