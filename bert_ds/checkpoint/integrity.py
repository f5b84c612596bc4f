"""Checksums of a tag's files: recorded at save, verified before anything reads the tag (resume, export, evaluation).

Each rank hashes the files it wrote (its ZeRO partition and RNG file; rank 0 also the module weights) after fsyncing
them, rank 0 gathers the digests and writes them into the tag's ``run_state.json`` under ``"files"`` (name -> size and
sha256) before the tag is published and ``latest`` moves, so a complete tag always carries the digests of every other
file in it. sha256, not blake2b: measured on this project's machine (``hashlib``, 256 MiB, one core) sha256 ran at
663 MiB/s (the CPU has SHA extensions) and blake2b at 315 MiB/s; BERT-large's ~5-6 GB checkpoint is then ~1 s per rank
at save on 8 ranks and ~9 s for a reader that verifies all of it in one process.

``run_state.json`` itself decides where a resume continues (step, loader position) and holds the other digests, so it
is covered twice: its ``"run_state_sha256"`` is the sha256 of the rest of the file in canonical JSON
(:func:`state_digest`), and everything but ``"files"`` must equal the client state DeepSpeed saved inside
``mp_rank_00_model_states.pt`` (whose own digest is in ``"files"``). An edited byte fails the first check; a forged
digest fails the second unless the model-states file is rewritten too.

A tag saved before bert_ds recorded digests (no ``"files"``, no ``"run_state_sha256"``) is accepted with a warning
naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from bert_ds.deepspeed_internals import MODEL_STATES_NAME
from bert_ds.safe_load import CheckpointError

__all__ = ["CLIENT_STATE_KEY", "DIGEST", "MODEL_STATES_NAME", "STATE_DIGEST_KEY", "DamagedCheckpointError",
           "check_tag", "file_digest", "files_of_rank", "gather_digests", "recorded_digests", "run_state_damage",
           "seal_run_state", "state_digest", "verify_tag"]

DIGEST = "sha256"
STATE_DIGEST_KEY = "run_state_sha256"
"""The key of ``run_state.json`` holding the sha256 of the rest of that file (:func:`state_digest`)."""
CLIENT_STATE_KEY = "bert_ds"
"""The key under which the run state travels in DeepSpeed's client state (``engine.save_checkpoint(client_state=)``
merges it into the top level of the model-states file)."""

_CHUNK = 8 * 2**20
log = logging.getLogger(__name__)


class DamagedCheckpointError(CheckpointError):
    """A tag whose files do not match the sizes and digests recorded when it was saved."""


def file_digest(path: Path) -> dict:
    """``{"size": bytes, "sha256": hex}`` of one file, read in 8 MiB chunks."""
    h = hashlib.new(DIGEST)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, DIGEST: h.hexdigest()}


def files_of_rank(tag_dir: Path, rank: int, owner_of) -> list[Path]:
    """The files of ``tag_dir`` that ``owner_of(name)`` attributes to ``rank`` (``run_state.json`` excluded: it holds
    the digests)."""
    return sorted(f for f in Path(tag_dir).iterdir()
                  if f.is_file() and f.name != "run_state.json" and owner_of(f.name) == rank)


def gather_digests(own: dict[str, dict]) -> dict[str, dict]:
    """Every rank's ``{name: digest}`` merged (an all-gather; just ``own`` on one rank or without a process group)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(own)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, own)
    merged: dict[str, dict] = {}
    for part in parts:
        merged.update(part)
    return merged


def recorded_digests(tag_dir: Path) -> dict[str, dict] | None:
    """The ``"files"`` entry of the tag's ``run_state.json``, or None for a tag saved without digests."""
    path = Path(tag_dir) / "run_state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DamagedCheckpointError(f"{path}: unreadable ({exc}); the tag is damaged") from exc
    files = state.get("files") if isinstance(state, dict) else {}
    if files is not None and not (isinstance(files, dict) and all(isinstance(v, dict) for v in files.values())):
        raise DamagedCheckpointError(f"{path}: field 'files' is not a map of file name -> size and digest")
    return files


def state_digest(state: dict) -> str:
    """sha256 of ``state`` (without its own ``run_state_sha256``) as canonical JSON: sorted keys, no whitespace. JSON
    floats round-trip exactly, so the digest of a file's parsed content equals the one computed before writing it."""
    body = {k: v for k, v in state.items() if k != STATE_DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.new(DIGEST, text.encode("utf-8")).hexdigest()


def seal_run_state(state: dict) -> str:
    """The text of ``run_state.json`` for ``state``: the state with its own digest added (computed on the state as
    JSON will read it back: tuples as lists)."""
    state = json.loads(json.dumps(state, allow_nan=True))
    return json.dumps({**state, STATE_DIGEST_KEY: state_digest(state)}, indent=1) + "\n"


def _first_difference(saved, recorded, where: str = "") -> tuple[str, object, object] | None:
    """(dotted field, value in ``saved``, value in ``recorded``) of the first difference, or None."""
    if isinstance(saved, dict) and isinstance(recorded, dict):
        for key in sorted(set(saved) | set(recorded), key=str):
            found = _first_difference(saved.get(key), recorded.get(key), f"{where}.{key}" if where else str(key))
            if found:
                return found
        return None
    if isinstance(saved, list) and isinstance(recorded, list) and len(saved) == len(recorded):
        for i, (a, b) in enumerate(zip(saved, recorded, strict=True)):
            found = _first_difference(a, b, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if saved == recorded else (where or "(top level)", saved, recorded)


def _client_state(tag_dir: Path) -> dict | None:
    """The run state DeepSpeed saved inside the tag's model-states file (tensors mapped, not read), None when that
    file is missing or unreadable (the file checks report it)."""
    from bert_ds.safe_load import load_tensor_file

    path = tag_dir / MODEL_STATES_NAME
    if not path.is_file():
        return None
    try:
        client = load_tensor_file(path, mmap=True).get(CLIENT_STATE_KEY)
    except CheckpointError:
        return None
    # as JSON reads it back: tuples become lists, and so on
    return json.loads(json.dumps(client, allow_nan=True)) if isinstance(client, dict) else None


def run_state_damage(tag_dir: str | Path) -> list[str]:
    """The checks of ``run_state.json`` itself: its recorded digest (when it has one), then agreement with the client
    state inside the model-states file (whenever that file holds one, so deleting the digest does not skip it). One
    line per finding; empty: intact."""
    path = Path(tag_dir) / "run_state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return [f"{path}: unreadable ({exc})"]
    if not isinstance(state, dict):
        return [f"{path}: not a JSON object"]
    recorded = state.get(STATE_DIGEST_KEY)
    if recorded is not None and (got := state_digest(state)) != recorded:
        return [f"{path}: {DIGEST} {got[:16]}... of its content differs from the {STATE_DIGEST_KEY} "
                f"{str(recorded)[:16]}... it records (the file was edited after the save)"]
    client = _client_state(Path(tag_dir))
    if client is None:
        return []
    found = _first_difference(client, {k: v for k, v in state.items() if k not in ("files", STATE_DIGEST_KEY)})
    if found:
        field, saved, written = found
        return [f"{path}: field {field!r} is {written!r} but the run state saved inside {MODEL_STATES_NAME} holds "
                f"{saved!r} (the file was rewritten after the save)"]
    return []


def verify_tag(tag_dir: str | Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """Check the recorded files of ``tag_dir`` this rank is asked to (file ``i`` of the sorted list goes to rank
    ``i % world_size``, so ranks share the reading): each must exist with the recorded size and digest, and no file
    DeepSpeed wrote may be missing from the record; rank 0 also checks ``run_state.json`` itself
    (:func:`run_state_damage`). Returns one line per damaged file (empty: intact)."""
    tag_dir = Path(tag_dir)
    damage = run_state_damage(tag_dir) if rank == 0 else []
    try:
        recorded = recorded_digests(tag_dir)
    except DamagedCheckpointError as exc:
        return (damage or [str(exc)]) if rank == 0 else []
    if recorded is None:
        if rank == 0 and not damage:
            log.warning("%s: saved without checksums (an older bert_ds): its files cannot be verified", tag_dir)
        return damage
    if rank == 0:
        unrecorded = sorted(f.name for f in tag_dir.iterdir() if f.is_file() and f.name != "run_state.json"
                            and f.name not in recorded)
        damage += [f"{tag_dir / name}: not in the checksums recorded at save" for name in unrecorded]
    for i, name in enumerate(sorted(recorded)):
        if i % world_size != rank:
            continue
        path, want = tag_dir / name, recorded[name]
        if not path.is_file():
            damage.append(f"{path}: missing (recorded at save: {want['size']} bytes)")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            damage.append(f"{path}: {size} bytes, {want['size']} recorded at save (truncated or overwritten)")
            continue
        got = file_digest(path)[DIGEST]
        if got != want[DIGEST]:
            damage.append(f"{path}: {DIGEST} {got[:16]}... differs from {want[DIGEST][:16]}... recorded at save "
                          f"(the file changed on disk)")
    return damage


def check_tag(tag_dir: str | Path) -> None:
    """One process verifies every file of ``tag_dir``; DamagedCheckpointError naming the first damaged file."""
    damage = verify_tag(tag_dir)
    if damage:
        more = f" (and {len(damage) - 1} more)" if len(damage) > 1 else ""
        raise DamagedCheckpointError(f"checkpoint {Path(tag_dir).name} is damaged: {damage[0]}{more}; pick an intact "
                                     f"tag with --tag")
