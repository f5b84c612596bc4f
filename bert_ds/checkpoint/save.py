"""Saving a checkpoint: every rank writes, all agree, then ``latest`` moves; pruning of old tags.

ZeRO 1/2 run with ``elastic_checkpoint`` so the optimizer partitions can be merged and re-cut when the number of ranks
changes between save and resume (:mod:`bert_ds.checkpoint.restore`). Durability and failure:

* A save that fails on any rank (disk full: ``OSError`` / torch's ``RuntimeError``) is agreed on by all ranks, its
  ``<tag>.tmp`` removed, ``latest`` and the previous tags left as they were, and one :class:`CheckpointSaveError`
  naming the directory and the space needed is raised (a ValueError: ``bert_ds.runtime.pretrain`` exits 2).
* Files of a tag, then the tag directory, then ``latest`` (temp file, fsync, rename, fsync of the directory) reach the
  disk in that order, so after a power loss ``latest`` never names data that was not written.
* Pruning renames a tag to ``.<tag>.deleting`` before deleting it; phase-end checkpoints (``phase_done``) are never
  pruned. :func:`bert_ds.checkpoint.layout.remove_debris` (start of every save, and when the run takes its lock)
  deletes what killed saves and prunes left.

After every save rank 0 logs its duration and records it beside the tags (``last_save.json``): a pre-empted rank must
finish the save within Slurm's grace time.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from bert_ds.checkpoint.integrity import CLIENT_STATE_KEY, file_digest, files_of_rank, gather_digests, seal_run_state
from bert_ds.checkpoint.layout import (
    LAST_SAVE_NAME,
    RUN_STATE_NAME,
    TAG_VOCAB_NAME,
    TOKENIZER_DIR_NAME,
    CheckpointSaveError,
    RunState,
    _any_rank,
    _fsync,
    _write_synced,
    checkpoint_dir,
    list_tags,
    read_latest,
    read_run_state,
    remove_debris,
    rng_file,
    save_time_line,
)
from bert_ds.checkpoint.lock import bytes_needed, try_exclusive_tag

__all__ = ["prune_checkpoints", "save_checkpoint", "save_rng_state"]

log = logging.getLogger(__name__)

def save_rng_state(path: Path) -> None:
    """This rank's Python, NumPy, torch CPU and (with CUDA) every CUDA device's generator state, in types
    ``weights_only`` loading accepts (the CUDA states are uint8 tensors)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(state, path)


_RANK_IN_NAME = re.compile(r"(?:pp_rank_|rng_rank)(\d+)")


def _writer_of(name: str) -> int:
    """The rank that wrote a tag's file: ``[bf16_]zero_pp_rank_<r>_*`` and ``rng_rank<r>`` are rank r's, the rest (e.g.
    ``mp_rank_00_model_states.pt``) rank 0's."""
    m = _RANK_IN_NAME.search(name)
    return int(m.group(1)) if m else 0


def _sync_and_hash_own_files(tag_dir: Path, rank: int) -> dict[str, dict]:
    """fsync the files this rank wrote (on a shared filesystem only the writer's fsync flushes its client cache), then
    hash them (:mod:`bert_ds.checkpoint.integrity`): each rank reads back only its own share."""
    own = files_of_rank(tag_dir, rank, _writer_of)
    for f in own:
        _fsync(f)
    return {f.name: file_digest(f) for f in own}


def _write_tag(engine, ckpt: Path, tmp_tag: str, run_state: dict, rank: int) -> tuple[Exception | None, dict]:
    """Everything this rank writes, and the digests of its files; returns the error instead of raising so all ranks
    can agree."""
    import deepspeed.comm as dist

    try:
        engine.save_checkpoint(str(ckpt), tag=tmp_tag, client_state={CLIENT_STATE_KEY: run_state}, save_latest=False)
    except (OSError, RuntimeError) as exc:  # torch.save on a full disk: RuntimeError "basic_ios::clear" / "file write"
        # DeepSpeed 0.19 (runtime/engine.py save_checkpoint) writes every file between its tag-validation all-reduce
        # and one closing barrier, where the other ranks now wait: stand in for it before agreeing.
        dist.barrier()
        return exc, {}
    try:
        save_rng_state(rng_file(ckpt / tmp_tag, rank))
        vocab = ckpt / TOKENIZER_DIR_NAME / "vocab.txt"
        if rank == 0 and vocab.is_file():  # the trained vocabulary, checksummed with the tag
            shutil.copyfile(vocab, ckpt / tmp_tag / TAG_VOCAB_NAME)
        return None, _sync_and_hash_own_files(ckpt / tmp_tag, rank)
    except (OSError, RuntimeError) as exc:
        return exc, {}


def _write_metadata(ckpt: Path, tmp_tag: str, tag: str, run_state: dict, digests: dict) -> Exception | None:
    """Rank 0, every rank's files on disk: ``run_state.json`` with every file's digest and its own (its presence
    makes the tag complete), fsynced with the directory, and the new ``latest`` pointer's bytes (they need space
    too)."""
    try:
        _write_synced(ckpt / tmp_tag / RUN_STATE_NAME, seal_run_state({**run_state, "files": digests}))
        _fsync(ckpt / tmp_tag)
        _write_synced(ckpt / ".latest.tmp", tag)
    except (OSError, RuntimeError) as exc:
        return exc
    return None


def _publish(ckpt: Path, tmp_tag: str, tag: str) -> None:
    """Rank 0, all files on disk: rename ``<tag>.tmp`` to ``tag`` (replacing an older one), then move ``latest``."""
    old = ckpt / f".{tag}.old"
    if (ckpt / tag).exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(ckpt / tag, old)
    os.replace(ckpt / tmp_tag, ckpt / tag)
    _fsync(ckpt)  # the tag's new name is durable before ``latest`` names it
    os.replace(ckpt / ".latest.tmp", ckpt / "latest")
    _fsync(ckpt)
    shutil.rmtree(old, ignore_errors=True)


def _record_save_time(ckpt: Path, tag: str, seconds: float, world_size: int, digests: dict) -> None:
    """Rank 0, the save complete: log its duration and write it to ``last_save.json`` (advisory: a failure to write it
    is a warning, never a failed save)."""
    record = {"tag": tag, "seconds": round(seconds, 3), "world_size": world_size,
              "bytes": sum(int(d["size"]) for d in digests.values()), "saved_at": time.time()}
    log.info(save_time_line(record))
    tmp = ckpt / f".{LAST_SAVE_NAME}.tmp"
    try:
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, ckpt / LAST_SAVE_NAME)
    except OSError as exc:
        log.warning("%s: cannot record the save time (%s)", ckpt / LAST_SAVE_NAME, exc)


def _save_failure(ckpt: Path, tag: str, error: Exception | None, num_parameters: int) -> CheckpointSaveError:
    needed, _ = bytes_needed(ckpt, num_parameters)
    free = shutil.disk_usage(ckpt).free
    cause = "the save failed on another rank"
    if error is not None:
        cause = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    kept = f"'latest' still names {read_latest(ckpt)}" if (ckpt / "latest").is_file() else "no earlier checkpoint"
    return CheckpointSaveError(f"cannot save checkpoint {tag} in {ckpt} ({cause}): {free / 2**20:,.1f} MiB free there, "
                               f"a checkpoint of this run needs about {needed / 2**20:,.1f} MiB; the partial "
                               f"{tag}.tmp was removed and {kept}. Free space, then resume with --resume auto")


def save_checkpoint(engine, run_dir: str | Path, tag: str, run_state: RunState, keep_last_k: int) -> Path:
    """Save on every rank; ``latest`` moves to ``tag`` only after all ranks finished writing.

    DeepSpeed writes its files into a fresh ``<tag>.tmp`` directory with ``save_latest=False`` (a tag directory left
    by an earlier, possibly larger, run would otherwise keep its extra ``zero_pp_rank_*`` files and break
    consolidation); each rank adds its RNG state, fsyncs and hashes its files; rank 0 gathers the digests and writes
    ``run_state.json`` holding them (:mod:`bert_ds.checkpoint.integrity`). All ranks agree whether every write
    succeeded: if not, the partial ``<tag>.tmp`` is removed and every rank raises
    :class:`CheckpointSaveError` (``latest`` and the older tags untouched). Otherwise rank 0 renames the directory to
    ``tag`` (replacing an older one) and then moves ``latest``, so a crash at any point leaves ``latest`` naming a
    complete checkpoint. Older tags beyond ``keep_last_k`` (phase ends excepted) are pruned afterwards.
    """
    import deepspeed.comm as dist

    started = time.monotonic()
    ckpt = checkpoint_dir(run_dir)
    rank = dist.get_rank()
    tmp_tag = f"{tag}.tmp"  # parse_tag ignores it, so a half-written one is never listed or resumed
    if rank == 0:
        remove_debris(ckpt)
    dist.barrier()
    state = run_state.to_dict()
    error, own = _write_tag(engine, ckpt, tmp_tag, state, rank)
    digests: dict[str, dict] = {}
    if not _any_rank(error is not None):
        digests = gather_digests(own)
        if rank == 0:
            error = _write_metadata(ckpt, tmp_tag, tag, state, digests)
    if _any_rank(error is not None):
        if rank == 0:
            shutil.rmtree(ckpt / tmp_tag, ignore_errors=True)
            (ckpt / ".latest.tmp").unlink(missing_ok=True)
        dist.barrier()
        raise _save_failure(ckpt, tag, error, sum(p.numel() for p in engine.module.parameters()))
    if rank == 0:
        _publish(ckpt, tmp_tag, tag)
        prune_checkpoints(ckpt, keep_last_k)
    dist.barrier()
    if rank == 0:
        _record_save_time(ckpt, tag, time.monotonic() - started, dist.get_world_size(), digests)
    return ckpt / tag


def _phase_done(ckpt_dir: Path, tag: str) -> bool:
    try:
        return read_run_state(ckpt_dir, tag).phase_done
    except (OSError, ValueError):
        return False


def prune_checkpoints(ckpt_dir: str | Path, keep_last_k: int) -> list[str]:
    """Delete all but the newest ``keep_last_k`` tags; never the one ``latest`` names (the newest tag whose save
    completed and was hashed: so never the last intact tag), never a phase's final checkpoint (``phase_done``: the
    hand-off point and the export a user wants from that phase), never a tag newer than ``latest`` (left by a run that
    resumed from an older tag because that one was damaged: it is replaced when training reaches it again, and does not
    count against ``keep_last_k``), and never a tag a reader holds (:func:`bert_ds.checkpoint.lock.reading_tag`: the
    converter or evaluation; it is pruned at a later save). A tag is renamed to ``.<tag>.deleting`` before it is
    deleted, so a kill mid-way leaves debris :func:`remove_debris` recognises, not a half-deleted tag. Returns the
    deleted tags."""
    ckpt_dir = Path(ckpt_dir)
    tags = list_tags(ckpt_dir)
    latest = read_latest(ckpt_dir)
    if latest in tags:
        tags = tags[:tags.index(latest) + 1]  # newer ones: see the docstring
    keep = set(tags[-max(keep_last_k, 1):]) | {latest} | {t for t in tags if _phase_done(ckpt_dir, t)}
    deleted = []
    for tag in (t for t in tags if t not in keep):
        with try_exclusive_tag(ckpt_dir, tag) as free:
            if not free:
                log.info("%s: not pruned now, a reader (converter/evaluation) holds it", ckpt_dir / tag)
                continue
            doomed = ckpt_dir / f".{tag}.deleting"
            os.replace(ckpt_dir / tag, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            deleted.append(tag)
    return deleted
