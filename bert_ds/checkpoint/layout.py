"""The run directory's layout: names, tags, ``latest``, run state, model config, tokenizer, debris of killed saves.

Layout::

    RUN_DIR/.lock                        flock of the live run: host, pid, start time (one run per directory)
    RUN_DIR/recipe.json                  the resolved recipe of the run
    RUN_DIR/tensorboard/                 metrics
    RUN_DIR/heartbeat/rank00000.json ... each rank's last activity, rewritten every few seconds while it trains
                                         (written and read by the hang watchdog, :mod:`bert_ds.lifecycle.hang_watchdog`)
    RUN_DIR/checkpoints/                 DeepSpeed's save dir
        latest                           tag of the newest *complete* checkpoint (written last, atomically)
        last_save.json                   how long the newest save took (tag, seconds, ranks, bytes): advisory, read
                                         back at a resume's start-up; not part of any tag, never checksummed
        model_config.json                BertConfig.save
        tokenizer/                       vocab.txt, tokenizer_meta.json (the casing training used, always written)
                                         (+ tokenizer.json, tokenizer_config.json when present)
        phase1-step000040/               one DeepSpeed tag: mp_rank_00_model_states.pt, zero_pp_rank_*_optim_states.pt
            run_state.json               recipe, phase, step, consumed samples, loader state, world size (readable
                                         without torch; the same dict is DeepSpeed's client state)
            rng_rank00000.pt ...         python / numpy / torch CPU (+ CUDA) RNG states of each rank
            vocab.txt                    the vocabulary the tag was trained with (checksummed with the tag: a
                                         rewritten tokenizer/ is then named by its first differing id)

Tags are ``phaseN-stepNNNNNN``; a tag is complete once its ``run_state.json`` exists (written last); ``<tag>.tmp`` (a
save in progress), ``.<tag>.old`` (the tag being replaced) and ``.<tag>.deleting`` (a prune in progress) never parse
as tags, so they are never listed, resumed or exported; :func:`remove_debris` deletes them. A tag a resume found
damaged is renamed ``<tag>.damaged[-N]`` (:func:`set_aside_damaged`): kept for diagnosis, never listed, resumed,
exported, pruned or counted by ``keep_last_k``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from bert_ds.config import BertConfig
from bert_ds.data.tokenizer import META_NAME, load_tokenizer, read_lowercase
from bert_ds.errors import StorageError
from bert_ds.safe_load import CheckpointError

__all__ = ["CHECKPOINT_DIR", "HEARTBEAT_DIR", "LAST_SAVE_NAME", "MODEL_CONFIG_NAME", "RUN_STATE_NAME",
           "RUN_STATE_SCHEMA", "TAG_VOCAB_NAME", "TOKENIZER_DIR_NAME", "CheckpointRef", "CheckpointSaveError",
           "RunLockedError", "RunState", "TokenizerMismatch", "checkpoint_dir", "first_id_differing", "heartbeat_file",
           "list_tags", "open_checkpoint", "parse_tag", "read_last_save", "read_latest", "read_model_config",
           "read_run_state", "remove_debris", "resolve_tag", "rng_file", "save_time_line", "set_aside_damaged",
           "tag_for", "tokenizer_dir", "trained_tokenizer_mismatch", "write_run_metadata"]

CHECKPOINT_DIR = "checkpoints"
HEARTBEAT_DIR = "heartbeat"
RUN_STATE_NAME = "run_state.json"
MODEL_CONFIG_NAME = "model_config.json"
TOKENIZER_DIR_NAME = "tokenizer"
TAG_VOCAB_NAME = "vocab.txt"
"""A copy of the trained vocabulary inside each tag, written by rank 0 at save."""
LAST_SAVE_NAME = "last_save.json"
"""Beside the tags: the duration of the newest save (:func:`bert_ds.checkpoint.save.save_checkpoint`, rank 0), so a
resumed run can say at start-up how much pre-emption grace a save needs (:func:`read_last_save`)."""
_TAG = re.compile(r"^phase(\d+)-step(\d+)$")
_TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json")


class CheckpointSaveError(CheckpointError, StorageError):
    """A save failed on some rank (disk full, quota, I/O error); the partial tag is gone, ``latest`` is intact. Exit
    74, not bad input; still a CheckpointError (and so a ValueError) for callers that catch those."""

    exit_code = StorageError.exit_code


class RunLockedError(CheckpointError):
    """Another live process holds the run directory's lock."""


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointRef:
    """A resolved, complete checkpoint: everything needed to rebuild the model and its tokenizer."""

    checkpoint_dir: Path
    tag: str
    config: BertConfig
    tokenizer_dir: Path


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def heartbeat_file(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of a run in ``run_dir`` writes its heartbeat (the format is
    :mod:`bert_ds.lifecycle.hang_watchdog`'s): on the run directory, so every node of the job sees every rank's file."""
    return Path(run_dir) / HEARTBEAT_DIR / f"rank{rank:05d}.json"


def tag_for(phase_index: int, step: int) -> str:
    """``phase1-step000040``: 1-based phase, step within the phase (optimizer steps done)."""
    return f"phase{phase_index + 1}-step{step:06d}"


def parse_tag(tag: str) -> tuple[int, int] | None:
    """(phase_index, step) of a bert_ds tag, or None for anything else."""
    m = _TAG.match(tag)
    return (int(m.group(1)) - 1, int(m.group(2))) if m else None


def list_tags(ckpt_dir: str | Path) -> list[str]:
    """bert_ds tags under ``ckpt_dir`` that hold a run state, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and parse_tag(p.name) and (p / RUN_STATE_NAME).is_file()]
    return sorted(tags, key=parse_tag)


def read_latest(ckpt_dir: str | Path) -> str | None:
    """The tag ``latest`` names, None without a ``latest`` file; a CheckpointError if that tag is incomplete."""
    path = Path(ckpt_dir) / "latest"
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if not (Path(ckpt_dir) / tag / RUN_STATE_NAME).is_file():
        raise CheckpointError(f"{path} names tag {tag!r} but {Path(ckpt_dir) / tag / RUN_STATE_NAME} is missing")
    return tag


RUN_STATE_SCHEMA = 2
"""The ``schema_version`` :meth:`RunState.to_dict` writes. Version 1 is the layout before the field existed (no
``schema_version`` key): the same fields, ``time_budget`` only in ``time_linear`` phases."""
_SEAL_KEYS = ("files", "run_state_sha256")
"""Keys of ``run_state.json`` that seal the file rather than describe the run (:mod:`bert_ds.checkpoint.integrity`:
every file's digest, the file's own digest); :func:`read_run_state` leaves them out of the :class:`RunState`."""


@dataclass(frozen=True)
class RunState:
    """What a tag records about the run at its step (``run_state.json``, also DeepSpeed's client state): rank 0
    writes :meth:`to_dict`, every reader takes these fields from :func:`read_run_state`."""

    recipe: dict
    """The resolved recipe (``Recipe.to_dict``): a resume is refused when a field that shapes the run differs."""
    phase: int
    """0-based phase index."""
    step: int
    """Optimizer steps done within the phase."""
    phase_done: bool
    """The phase ended at this tag: the next phase starts from it (the hand-off)."""
    global_step: int
    """Steps done counting every phase from the start of the run (the log's step axis)."""
    consumed_samples: int
    """Samples the phase consumed up to this step."""
    loader: dict
    """The training loader's position (:meth:`bert_ds.data.loader.ShardLoader.state_dict`)."""
    world_size: int
    zero_stage: int
    precision: str
    """Resolved precision the tag was trained in: fp32 / bf16 / fp16."""
    vocab_sha256: str
    """sha256 of the vocabulary the tag was trained with (checked against the tokenizer of a resume or export)."""
    lowercase: bool
    """The tokenizer's casing the tag was trained with."""
    time_budget: dict | None = None
    """``time_linear`` phases: the training-time budget's state (:class:`bert_ds.optim.schedule.TimeBudget`)."""
    schema_version: int = RUN_STATE_SCHEMA

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "run state") -> RunState:
        """The run state ``data`` holds (``where``, a file, is named in each refusal): every field of
        ``schema_version`` 2, or of version 1 (no ``schema_version``: ``time_budget`` only when a phase had one).
        A field missing, unknown or of the wrong type is refused by name (:class:`CheckpointError`)."""
        if not isinstance(data, dict):
            raise CheckpointError(f"{where}: not a JSON object")
        version = data.get("schema_version", 1)
        if version not in (1, RUN_STATE_SCHEMA) or isinstance(version, bool):
            raise CheckpointError(f"{where}: field 'schema_version' is {version!r}; this bert_ds reads versions 1 "
                                  f"and {RUN_STATE_SCHEMA}")
        names = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise CheckpointError(f"{where}: unknown field {unknown[0]!r} (run state schema_version {version} has "
                                  f"{sorted(names)})")
        optional = {"schema_version", "time_budget"} if version == 1 else set()
        missing = [name for name in names if name not in data and name not in optional]
        if missing:
            raise CheckpointError(f"{where}: field {missing[0]!r} is missing (run state schema_version {version})")
        for name, value in data.items():
            if not _has_type(value, _RUN_STATE_TYPES[name]):
                raise CheckpointError(f"{where}: field {name!r} is {value!r:.80}, not {_RUN_STATE_TYPES[name][0]}")
        return cls(**{**data, "schema_version": RUN_STATE_SCHEMA})


_RUN_STATE_TYPES = {"recipe": ("an object", dict), "phase": ("an integer", int), "step": ("an integer", int),
                    "phase_done": ("true or false", bool), "global_step": ("an integer", int),
                    "consumed_samples": ("an integer", int), "loader": ("an object", dict),
                    "world_size": ("an integer", int), "zero_stage": ("an integer", int),
                    "precision": ("a string", str), "vocab_sha256": ("a string", str),
                    "lowercase": ("true or false", bool), "time_budget": ("an object or null", dict, type(None)),
                    "schema_version": ("an integer", int)}
"""Each :class:`RunState` field's JSON type: (what a refusal says, the Python types it may have)."""


def _has_type(value, spec: tuple) -> bool:
    if isinstance(value, bool) and bool not in spec[1:]:
        return False  # JSON true is not a step count
    return isinstance(value, spec[1:])


def read_run_state(ckpt_dir: str | Path, tag: str) -> RunState:
    """The :class:`RunState` of ``tag``; a CheckpointError naming the file and the field it cannot use."""
    path = Path(ckpt_dir) / tag / RUN_STATE_NAME
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from exc
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in _SEAL_KEYS}
    return RunState.from_dict(data, str(path))


def resolve_tag(ckpt_dir: str | Path, tag: str | None = None) -> str:
    """``tag`` (or the one ``latest`` names) after checking it is a complete checkpoint of ``ckpt_dir``."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir}: not a directory")
    tags = list_tags(ckpt_dir)
    if tag is None:
        tag = read_latest(ckpt_dir)
        if tag is None:
            if tags:
                raise CheckpointError(f"{ckpt_dir}: no 'latest' file (the newest save may not have finished); pass a "
                                      f"tag, complete ones: {tags}")
            raise CheckpointError(f"{ckpt_dir}: no bert_ds checkpoint here (no 'latest' file, no complete tag)")
        return tag
    if tag in tags:
        return tag
    if parse_tag(tag) is not None and (ckpt_dir / tag).is_dir():
        raise CheckpointError(f"{ckpt_dir / tag}: no {RUN_STATE_NAME}, so this checkpoint is incomplete (a save that "
                              f"did not finish); pick a complete tag: {tags}")
    raise CheckpointError(f"{ckpt_dir}: checkpoint tag {tag!r} not found; available: {tags or 'none'}")


def save_time_line(record: dict) -> str:
    """The one sentence stating a save's duration (``record`` as :data:`LAST_SAVE_NAME` holds it) and what it means
    for pre-emption: a rank checkpoints at the next step boundary after USR1/TERM, and the save must end before Slurm's
    SIGKILL."""
    return (f"checkpoint save took {record['seconds']:.2f} s ({record['tag']}, {record['world_size']} rank(s), "
            f"{record['bytes'] / 2**20:,.1f} MiB); pre-emption grace (Slurm KillWait / --signal lead time) must "
            f"exceed it")


def read_last_save(ckpt_dir: str | Path) -> dict | None:
    """What the newest save of this run directory recorded in :data:`LAST_SAVE_NAME` (tag, seconds, world_size,
    bytes), None when there is none or it is unreadable (it is advisory: nothing depends on it)."""
    try:
        record = json.loads((Path(ckpt_dir) / LAST_SAVE_NAME).read_text())
    except (OSError, ValueError):
        return None
    keys = {"tag": str, "seconds": (int, float), "world_size": int, "bytes": int}
    if not isinstance(record, dict) or not all(isinstance(record.get(k), t) for k, t in keys.items()):
        return None
    return record


def read_model_config(ckpt_dir: str | Path) -> BertConfig:
    path = Path(ckpt_dir) / MODEL_CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (training saves the model config beside the checkpoint tags)")
    try:
        return BertConfig.load(path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc


def tokenizer_dir(ckpt_dir: str | Path) -> Path:
    """The tokenizer copied beside the tags: a directory :func:`bert_ds.data.tokenizer.load_tokenizer` reads."""
    path = Path(ckpt_dir) / TOKENIZER_DIR_NAME
    if not (path / "vocab.txt").is_file():
        raise CheckpointError(f"{path / 'vocab.txt'}: missing (training copies the tokenizer beside the checkpoint "
                              f"tags)")
    return path


def open_checkpoint(ckpt_dir: str | Path, tag: str | None = None, verify: bool = True) -> CheckpointRef:
    """Resolve ``tag`` (``latest`` unless given) and check, before anything reads tensors: the model config and the
    tokenizer beside the tags agree on the vocabulary size; the tokenizer is the one the tag was trained with
    (vocabulary sha256 and casing, recorded in its ``run_state.json``); and with ``verify`` every file of the tag
    matches the checksum recorded at save (:mod:`bert_ds.checkpoint.integrity`). Each refusal is one
    CheckpointError naming both sides or the damaged file."""
    from bert_ds.checkpoint.integrity import check_tag

    ckpt_dir = Path(ckpt_dir)
    tag = resolve_tag(ckpt_dir, tag)
    config = read_model_config(ckpt_dir)
    tok_dir = tokenizer_dir(ckpt_dir)
    try:
        tokenizer = load_tokenizer(tok_dir)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{tok_dir}: cannot load the tokenizer: {exc}") from exc
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(f"{ckpt_dir / MODEL_CONFIG_NAME}: vocab_size={config.vocab_size} but "
                              f"{tok_dir / 'vocab.txt'} has {tokenizer.vocab_size} tokens")
    _check_trained_tokenizer(ckpt_dir, tag, tokenizer)
    if verify:
        check_tag(ckpt_dir / tag)
    return CheckpointRef(ckpt_dir, tag, config, tok_dir)


@dataclass(frozen=True)
class TokenizerMismatch:
    """How a tokenizer differs from the one a tag was trained with (:func:`trained_tokenizer_mismatch`)."""

    field: str
    """``vocab_sha256`` or ``lowercase``: the run state field that differs."""
    trained: str | bool
    """The tag's value."""
    given: str | bool
    """The tokenizer's value."""
    first_difference: str = ""
    """`` (id N: 'a' in X but 'b' in Y)`` when the vocabularies differ and the trained one is on disk, else empty."""


def trained_tokenizer_mismatch(ckpt_dir: str | Path, tag: str, tokenizer) -> TokenizerMismatch | None:
    """The one "was ``tag`` trained with this tokenizer" check (a resume's pre-flight and :func:`open_checkpoint`
    both ask it): the vocabulary sha256, then the casing, against what the tag's run state recorded; None when both
    agree. Each caller words the refusal for its own flag or file."""
    state = read_run_state(ckpt_dir, tag)
    if state.vocab_sha256 != tokenizer.vocab_sha256:
        return TokenizerMismatch("vocab_sha256", state.vocab_sha256, tokenizer.vocab_sha256,
                                 first_id_differing(ckpt_dir, tag, state.vocab_sha256, tokenizer))
    if state.lowercase != tokenizer.lowercase:
        return TokenizerMismatch("lowercase", state.lowercase, tokenizer.lowercase)
    return None


def first_id_differing(ckpt_dir: str | Path, tag: str, trained_sha: str, tokenizer) -> str:
    """`` (id N: 'a' in X but 'b' in Y)`` naming the first id where ``tokenizer`` differs from the vocabulary ``tag``
    was trained with, read from the tag's own copy (or, for a tag saved without one, the copy beside the tags) when
    that copy is the trained one (its sha256 matches); else empty."""
    from bert_ds.data.tokenizer import read_vocab, tokens_sha256, vocabulary_difference

    for copy in (Path(ckpt_dir) / tag / TAG_VOCAB_NAME, Path(ckpt_dir) / TOKENIZER_DIR_NAME / "vocab.txt"):
        try:
            trained = read_vocab(copy)
        except (OSError, ValueError):
            continue
        if tokens_sha256(trained) == trained_sha:
            return f" ({vocabulary_difference(trained, tokenizer.vocab, str(copy), str(tokenizer.vocab_file))})"
    return ""


def _check_trained_tokenizer(ckpt_dir: Path, tag: str, tokenizer) -> None:
    """The tokenizer copy beside the tags must be what ``tag`` was trained with: a run directory whose ``tokenizer/``
    was rewritten would otherwise export the old weights with another vocabulary or casing."""
    mismatch = trained_tokenizer_mismatch(ckpt_dir, tag, tokenizer)
    if mismatch is None:
        return
    tok_dir = ckpt_dir / TOKENIZER_DIR_NAME
    if mismatch.field == "vocab_sha256":
        raise CheckpointError(f"{ckpt_dir / tag} was trained with vocabulary sha256 {mismatch.trained[:16]}... but "
                              f"{tok_dir / 'vocab.txt'} has {mismatch.given[:16]}...{mismatch.first_difference}: the "
                              f"tokenizer beside the tags is not the one this checkpoint learned")
    raise CheckpointError(f"{ckpt_dir / tag} was trained with lowercase={mismatch.trained} but {tok_dir} says "
                          f"lowercase={mismatch.given}: the tokenizer beside the tags is not the one this checkpoint "
                          f"learned")


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _atomic_write(path: Path, text: str) -> None:
    """Temp file, fsync, rename, fsync of the directory: after a crash ``path`` holds the old or the new text."""
    tmp = path.with_name(f".{path.name}.tmp")
    _write_synced(tmp, text)
    os.replace(tmp, path)
    _fsync(path.parent)


def write_run_metadata(run_dir: str | Path, recipe, model_config, tokenizer_dir: str | Path | None) -> None:
    """Rank 0: recipe.json in the run dir; model_config.json and the tokenizer beside the checkpoint tags.

    The copied tokenizer always gets a ``tokenizer_meta.json`` holding the casing training resolved
    (:func:`bert_ds.data.tokenizer.load_tokenizer`: the meta file, else a Hugging Face ``tokenizer_config.json``'s
    ``do_lower_case``, else uncased), so the export carries that casing whatever the source directory held."""
    run_dir = Path(run_dir)
    ckpt = checkpoint_dir(run_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    _atomic_write(run_dir / "recipe.json", json.dumps(recipe.to_dict(), indent=2) + "\n")
    model_config.save(ckpt / MODEL_CONFIG_NAME)
    if tokenizer_dir is not None:
        lowercase = read_lowercase(tokenizer_dir)
        out = ckpt / TOKENIZER_DIR_NAME
        out.mkdir(exist_ok=True)
        for name in _TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.is_file():
                shutil.copyfile(src, out / name)
        _atomic_write(out / META_NAME, json.dumps({"lowercase": lowercase}) + "\n")


def set_aside_damaged(ckpt_dir: str | Path, damaged: list[str] | tuple[str, ...], resumed: str) -> list[str]:
    """Rank 0 of a run holding the lock, resuming from ``resumed`` after finding ``damaged`` tags: ``latest`` names
    ``resumed`` (atomically, first), then each damaged tag is renamed ``<tag>.damaged`` (``-2``, ``-3``... when that
    name is taken), so retention never keeps it in place of an intact tag and ``latest`` never names it. Returns the
    new names, each also logged."""
    ckpt_dir = Path(ckpt_dir)
    if not damaged:
        return []
    _atomic_write(ckpt_dir / "latest", resumed)
    moved = []
    for tag in damaged:
        if not (ckpt_dir / tag).is_dir():
            continue
        target, n = ckpt_dir / f"{tag}.damaged", 1
        while target.exists():
            n += 1
            target = ckpt_dir / f"{tag}.damaged-{n}"
        os.replace(ckpt_dir / tag, target)
        moved.append(target.name)
        log.warning("damaged checkpoint %s set aside as %s (kept for diagnosis, never resumed or pruned: delete it "
                    "when done)", tag, target)
    _fsync(ckpt_dir)
    return moved


def rng_file(tag_dir: str | Path, rank: int) -> Path:
    """Where ``rank`` keeps its random generators' state in a tag directory."""
    return Path(tag_dir) / f"rng_rank{rank:05d}.pt"


def _any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (an all-reduce, so also a barrier)."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([float(flag)], device=get_accelerator().current_device_name())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


_DEBRIS = re.compile(r"^(?:phase\d+-step\d+\.tmp|\.phase\d+-step\d+\.deleting|\.latest\.tmp|"
                     r"\.last_save\.json\.tmp)$")
_REPLACED = re.compile(r"^\.(phase\d+-step\d+)\.old$")


def remove_debris(ckpt_dir: str | Path) -> list[str]:
    """Delete what killed saves and prunes left in ``ckpt_dir``: ``<tag>.tmp`` (unfinished save), ``.<tag>.deleting``
    (unfinished prune), ``.latest.tmp``, ``.last_save.json.tmp``, ``.<tag>.old`` (a replaced tag). An ``.<tag>.old``
    whose ``<tag>`` is missing (killed between the two renames of a re-save) is renamed back instead: it is the only
    copy. Only the process holding the run's lock may call this. Returns the names removed or restored."""
    ckpt_dir = Path(ckpt_dir)
    done = []
    for path in sorted(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []:
        replaced = _REPLACED.match(path.name)
        if replaced and not (ckpt_dir / replaced.group(1)).exists():
            os.replace(path, ckpt_dir / replaced.group(1))
        elif replaced or _DEBRIS.match(path.name):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        else:
            continue
        done.append(path.name)
    if done:
        _fsync(ckpt_dir)
        log.info("%s: removed the debris of interrupted saves/prunes: %s", ckpt_dir, done)
    return done
