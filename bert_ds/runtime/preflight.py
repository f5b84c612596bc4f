"""Pre-flight: every check a run needs, done before any compute, producing the plan the phase loop follows.

``plan_run`` reads the recipe, the command line, the tokenizer, every shard set's ``index.json`` and the run
directory's newest checkpoint, and either raises one ``BadInput`` naming the culprit (exit 2, nothing computed or
written) or returns a :class:`RunPlan`: which phases to run, where their data is, the model config, and where to
start (fresh, mid-phase resume, or a phase hand-off). Nothing under ``--output`` is written here; the run takes its
lock and writes its metadata only after the plan exists, so a refused run leaves the run directory byte for byte as
it was. Resume checks: the recipe (``resume_blockers``), the vocabulary (sha256, size) and casing the tag was trained
with, the model config beside the tags, the loader's sample stream, and the tag's checksums
(:mod:`bert_ds.checkpoint.integrity`). A tag whose files fail their checksums is skipped with a loud warning naming the
damaged file, and the run resumes from the newest intact tag before it (the steps after it are trained again); with
no intact tag left the run is refused.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from bert_ds import checkpoint as ckpt
from bert_ds.cli_args import option
from bert_ds.config import BertConfig
from bert_ds.data.mix import MixChangedError, Source, parse_sources
from bert_ds.data.remote import is_url
from bert_ds.errors import BadInput
from bert_ds.exit_codes import ExitCode
from bert_ds.lifecycle.hang_watchdog import DEFAULT_FLOOR_S, SLOW_FLOOR_S, STEP_FACTOR
from bert_ds.recipe import Recipe, gradient_accumulation_steps, resume_blockers
from bert_ds.runtime.caches import NETWORK_FILESYSTEMS, cache_dir_warnings, filesystem_of

__all__ = ["RunArgs", "RunPlan", "StartPoint", "check_step_timeout", "default_shard_cache_dir", "fit_cache_dir",
           "loader_for_phase", "plan_run"]

log = logging.getLogger(__name__)

_STEP_TIMEOUT_HELP = (
    "progress watchdog: when a training step takes longer than SECONDS on any rank (a stuck collective, a dead mount, "
    "a lost GPU), every live rank prints one line naming the stalled ranks (host, local rank, pid) and what each last "
    f"did, and exits {int(ExitCode.STALLED)} (retryable with --resume auto). Default: max({DEFAULT_FLOOR_S:.0f}, "
    f"{STEP_FACTOR:g} x the slowest step so far). A phase's set-up and first step, an evaluation and a checkpoint save "
    f"may take at least {SLOW_FLOOR_S:.0f} s. 0 turns the watchdog off")


@dataclass(frozen=True)
class RunArgs:
    """The command line of a pre-training run, typed: ``bert_ds.runtime.pretrain.parse_args`` generates the parser
    from these fields (:mod:`bert_ds.cli_args`: each default written once, here) and pre-flight and the trainer read
    this, so neither sees argparse."""

    recipe: str
    """recipe JSON (ds_configs/*.json)"""
    output: str
    """run directory (checkpoints/, tensorboard/, recipe.json)"""
    tokenizer: str
    """tokenizer dir (vocab.txt) the shards were made with: checked against every shard set's index.json, gives dynamic
    masking its [MASK] id, and is copied beside the checkpoints for the exporter"""
    data: list[str] | None = None
    """shard directories, one argument per recipe phase in order (seq 128 then 512); one when --phase selects a single
    phase. An argument may be a weighted mix, DIR:WEIGHT,DIR:WEIGHT (e.g. wiki128/:3,books128/:1): each global batch
    draws its sources by the weights, a source that runs out starts its next epoch (docs/data.md). Replaces the
    recipe's phases[i].data (logged); without --data every selected phase reads its recipe data"""
    resume: Literal["auto", "none"] = "none"
    """auto: continue from the newest complete checkpoint in RUN_DIR/checkpoints, if any"""
    phase: Literal["1", "2", "all"] = "all"
    """which recipe phase(s) this invocation runs"""
    max_steps: int | None = None
    """stop (with a checkpoint) once the run has done N optimizer steps in total, counting every phase's steps from the
    start of the run"""
    eval_data: list[str] | None = None
    """eval shard dirs, one argument per phase (or one for all); DIR,DIR evaluates each set on its own
    (eval/<name>/... in TensorBoard) and all together"""
    init_from_hf: str | None = None
    """start the first selected phase from a Hugging Face BertForPreTraining dir"""
    num_workers: int = 1
    """data loader worker processes per rank"""
    verify_shards: Literal["none", "size", "headers", "sha256"] = "size"
    """pre-flight check of every shard set before compute (bert_ds.data.reader.verify_shard_set): size (a stat per
    shard), headers (+ tar headers, record length fields, per-shard counts), sha256 (+ content against index.json).
    Whatever is chosen, each loader worker also hashes a shard on first open unless sha256 already ran here"""
    continue_with_new_mix: bool = False
    """resume a checkpoint whose --data mix (sources, weights, their order) differs: the new mix starts at the saved
    step, each source kept goes on where it was (logged); without it such a resume is refused, naming what changed"""
    cache_dir: str | None = option(None, metavar="DIR", help="node-local cache of shard sets read from URLs "
                                   "(s3://, gs://, https://; docs/data.md). Default: ${TMPDIR:-/tmp}/bert_ds-"
                                   "$SLURM_JOB_ID/shards in a Slurm job, ${TMPDIR:-/tmp}/bert_ds-shards outside; "
                                   "refused on a network file system")
    cache_limit: str | None = option(None, metavar="SIZE", help="most bytes each URL's shard set may keep in "
                                     "--cache-dir (e.g. 200G): shards outside the loader's look-ahead window are "
                                     "evicted least recently used first; a limit below the window is refused. "
                                     "Default: unbounded")
    step_timeout: float | None = option(None, metavar="SECONDS", help=_STEP_TIMEOUT_HELP)
    """Seconds a training step may take before the progress watchdog ends the job (exit 124); None: derived from the
    measured step time (:func:`bert_ds.lifecycle.hang_watchdog.step_bound`); 0: no watchdog."""

    def __post_init__(self) -> None:
        t = self.step_timeout
        if t is not None and not (t == 0 or (math.isfinite(t) and t >= 1)):
            raise BadInput(f"--step-timeout {t:g}: give the seconds a training step may take (at least 1), or 0 to "
                           f"turn the progress watchdog off")
        if self.max_steps is not None and self.max_steps < 1:
            raise BadInput(f"--max-steps must be >= 1, got {self.max_steps}")


@dataclass(frozen=True)
class StartPoint:
    phase: int
    """Index of the phase the run starts in."""
    step: int
    """Optimizer steps already done in that phase."""
    tag: str | None
    """Checkpoint to load, or None for a fresh start."""
    handoff: bool
    """``tag`` is the finished previous phase: take its weights and moments, start the phase at step 0."""
    damaged: tuple[str, ...] = ()
    """Newer tags that failed their checks and were skipped: set aside once the run holds its lock
    (:func:`bert_ds.checkpoint.set_aside_damaged`)."""


@dataclass
class RunPlan:
    args: RunArgs
    recipe: Recipe
    rank: int
    world_size: int
    run_dir: Path
    phases: list[int]
    """Phase indices this invocation may run, in order."""
    data: dict[int, str]
    """Each phase's training data as a ``--data`` argument: the command line's, or written from the recipe's
    ``phases[i].data`` (``DIR:WEIGHT,...``)."""
    eval_data: dict[int, str]
    vocab_sha256: str
    model_config: BertConfig
    precision: str
    """Resolved precision: fp32 / bf16 / fp16."""
    start: StartPoint
    nothing_to_do: str | None
    """Why the run has nothing left to do (then ``start`` is not run), or None."""
    lowercase: bool = True
    """The tokenizer's casing (:func:`bert_ds.data.tokenizer.read_lowercase`); every shard set and tag must agree."""
    data_sources: dict[int, list[Source]] = field(default_factory=dict)
    """``data`` parsed: each phase's shard sets and weights (one unweighted set: the single-set loader)."""
    eval_sources: dict[int, list[Source]] = field(default_factory=dict)
    """``eval_data`` parsed: each phase's held-out sets, evaluated and reported one by one."""

    @property
    def loader_verify(self) -> str:
        """What each loader worker checks on a shard's first open: its hash, unless pre-flight just hashed it."""
        return "headers" if self.args.verify_shards == "sha256" else "sha256"

    @property
    def ckpt_dir(self) -> Path:
        return ckpt.checkpoint_dir(self.run_dir)

    def first_step_of(self, phase: int) -> int:
        """Run-global step number of ``phase``'s step 0 (the step axis of the logs and of ``--max-steps``)."""
        return sum(ph.steps for ph in self.recipe.phases[:phase])


def _phase_dirs(dirs: list[str] | None, phases: list[int], n_phases: int, flag: str) -> dict[int, str]:
    if not dirs:
        return {}
    if len(dirs) == n_phases:
        return {p: dirs[p] for p in phases}
    if len(dirs) == 1 and (len(phases) == 1 or flag == "--eval-data"):
        return {p: dirs[0] for p in phases}
    raise BadInput(f"{flag}: got {len(dirs)} directories for a recipe with {n_phases} phase(s); give one per phase")


def _training_data(args: RunArgs, recipe: Recipe, phases: list[int], rank: int
                   ) -> tuple[dict[int, str], dict[int, list[Source]], dict[str, dict[int, list[Source]]]]:
    """Each selected phase's training data: ``--data`` where given (it replaces the recipe's ``phases[i].data``, said
    on rank 0), else the recipe's. Returns (the data as ``--data`` arguments, the sources, the sources keyed by the
    label a pre-flight error names: ``--data`` or the recipe file and field)."""
    if args.data:
        data = _phase_dirs(args.data, phases, len(recipe.phases), "--data")
        sources = {p: parse_sources(spec, "--data") for p, spec in data.items()}
        replaced = [f"phases[{p}].data" for p in phases if recipe.phases[p].data is not None]
        if replaced and rank == 0:
            log.warning("--data replaces recipe %s's %s: the command line wins over the recipe", args.recipe,
                        " and ".join(replaced))
        return data, sources, {"--data": sources}
    data, sources, labels = {}, {}, {}
    for p in phases:
        entries = recipe.phases[p].data
        if entries is None:
            raise BadInput(f"--data is not given and recipe {args.recipe} has no phases[{p}].data: name phase "
                           f"{p + 1}'s shard directories on the command line or in the recipe")
        for i, entry in enumerate(entries):
            if not is_url(entry.path) and not Path(entry.path).is_dir():
                raise BadInput(f"recipe {args.recipe}: phases[{p}].data[{i}].path {entry.path!r} is not a "
                               f"directory (a relative path is read from the recipe file's directory)")
        sources[p] = [Source(e.path, e.weight) for e in entries]
        data[p] = ",".join(e.path if e.weight is None else f"{e.path}:{e.weight!r}" for e in entries)
        labels[f"recipe {args.recipe} phases[{p}].data"] = {p: sources[p]}
        if rank == 0:
            log.info("phase %d trains on recipe %s's phases[%d].data: %s", p + 1, args.recipe, p, data[p])
    return data, sources, labels


def default_shard_cache_dir(env: dict | None = None) -> str:
    """``--cache-dir``'s default: in a Slurm job the job's node-local root that ``slurm/pretrain_common.sh`` and
    :func:`bert_ds.runtime.caches.node_local_caches` use, ``${TMPDIR:-/tmp}/bert_ds-$SLURM_JOB_ID``, plus ``shards``;
    outside Slurm ``${TMPDIR:-/tmp}/bert_ds-shards``."""
    import os

    from bert_ds.runtime.caches import node_local_root

    env = os.environ if env is None else env
    root = node_local_root(env)
    return f"{root}/shards" if root else f"{env.get('TMPDIR') or '/tmp'}/bert_ds-shards"


def _cache_options(args: RunArgs, uses_urls: bool, mounts_text: str | None = None) -> None:
    """Where shard sets read from URLs are cached on this node (:mod:`bert_ds.data.shard_cache`): refused on a
    network file system, whose ranks on several nodes would share (and evict) one cache and whose locks need not
    hold between nodes."""
    from bert_ds.data.shard_cache import CacheOptions, parse_size, set_default_options

    root = args.cache_dir or default_shard_cache_dir()
    limit = parse_size(args.cache_limit) if args.cache_limit is not None else None
    if uses_urls and mounts_text is None:
        try:
            mounts_text = Path("/proc/mounts").read_text()
        except OSError:  # not Linux: nothing to check against
            mounts_text = ""
    point, fstype = filesystem_of(root, mounts_text or "")
    if uses_urls and fstype in NETWORK_FILESYSTEMS:
        log.warning("--cache-dir %s is on a network file system (%s mounted at %s)", root, fstype, point)
        raise BadInput(f"--cache-dir {root} is on a network file system ({fstype} mounted at {point}): the shard "
                       f"cache is per node (downloads once per node under a local lock, evicts by the node's "
                       f"look-ahead); give a node-local directory, e.g. ${{TMPDIR:-/tmp}}/bert_ds-shards")
    set_default_options(CacheOptions(root=root, limit_bytes=limit))


def check_step_timeout(args: RunArgs, recipe: Recipe) -> None:
    """The progress watchdog must name a stalled rank before the process group's own timeout ends the waiting
    collective with an error that names none: ``--step-timeout``, or without it the watchdog's floor
    (``DEFAULT_FLOOR_S``, half DeepSpeed's default timeout), must be below the recipe's
    ``deepspeed.process_group_timeout_s`` (DeepSpeed's default when null). ``--step-timeout 0`` (no watchdog)
    is the user's choice and passes."""
    from deepspeed.constants import default_pg_timeout

    timeout = recipe.deepspeed.process_group_timeout_s
    field = f"recipe {args.recipe}'s deepspeed.process_group_timeout_s"
    if timeout is None:
        timeout = default_pg_timeout.total_seconds()
        field = f"{field} (null: DeepSpeed's default)"
    if args.step_timeout == 0:
        return
    if args.step_timeout is not None and args.step_timeout >= timeout:
        raise BadInput(f"--step-timeout {args.step_timeout:g} is not below {field} {timeout:g}: the process group "
                       f"would end a stalled collective first, with an error naming no rank; give --step-timeout "
                       f"below {timeout:g} or raise the recipe's timeout")
    if args.step_timeout is None and DEFAULT_FLOOR_S >= timeout:
        raise BadInput(f"the progress watchdog's floor {DEFAULT_FLOOR_S:g} s (--step-timeout not given; half "
                       f"DeepSpeed's default process-group timeout) is not below {field} {timeout:g}: the process "
                       f"group would end a stalled collective first, with an error naming no rank; give --step-timeout "
                       f"below {timeout:g} (e.g. {timeout / 2:g}, half of it) or raise the recipe's timeout")


def _selected_phases(args: RunArgs, recipe: Recipe) -> list[int]:
    n = len(recipe.phases)
    if args.phase == "2" and n < 2:
        raise BadInput(f"--phase 2: recipe {args.recipe} has only {n} phase")
    return list(range(n)) if args.phase == "all" else [int(args.phase) - 1]


def _model_config(args: RunArgs, recipe: Recipe, tokenizer) -> BertConfig:
    config = recipe.model_config(tokenizer.vocab_size)
    if not args.init_from_hf:
        return config
    from bert_ds.export.hf import bert_config_from_hf

    # The HF model's shape replaces the recipe's preset; dropout stays the recipe's.
    hf_config = bert_config_from_hf(args.init_from_hf, config.pad_vocab_to_multiple_of,
                                    hidden_dropout_prob=config.hidden_dropout_prob,
                                    attention_probs_dropout_prob=config.attention_probs_dropout_prob)
    if hf_config.vocab_size != tokenizer.vocab_size:
        raise BadInput(f"--init-from-hf {args.init_from_hf}: field 'vocab_size' is {hf_config.vocab_size} but the "
                       f"tokenizer/shards have {tokenizer.vocab_size}")
    _check_init_vocabulary(args, tokenizer)
    return hf_config


def fit_cache_dir(env: Mapping[str, str]) -> Path:
    """Where pre-flight keeps activation fits (:func:`bert_ds.runtime.memory.fits_kept_in`): the user's cache,
    ``$XDG_CACHE_HOME/bert_ds/memory_fits`` (``~/.cache`` by default, as pip and torch hub do)."""
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bert_ds" / "memory_fits"


def _state_memory(recipe: Recipe, phases: list[int], model_config: BertConfig, precision: str, world_size: int,
                  rank: int, device_type: str) -> None:
    """Log each phase's expected peak memory per GPU (rank 0); on CUDA, refuse (exit 2) a phase whose micro batch
    the device cannot hold (:mod:`bert_ds.runtime.memory`). Every rank checks the GPU it trains on (``LOCAL_RANK``).
    Elsewhere there is no device to check and only rank 0 logs, so the other ranks skip the estimate (18 meta-device
    forwards for a two-phase recipe)."""
    import os

    import torch

    from bert_ds.runtime.memory import check_recipe_memory, fits_kept_in

    if device_type != "cuda" and rank != 0:
        return
    device_bytes = None
    if device_type == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        device_bytes = torch.cuda.get_device_properties(index).total_memory
    with fits_kept_in(fit_cache_dir(os.environ)):
        lines = check_recipe_memory(recipe, phases, model_config, world_size, precision, device_bytes)
    for line in lines:
        if rank == 0:
            log.info("expected memory: %s", line)


def _check_init_vocabulary(args: RunArgs, tokenizer) -> None:
    """The checkpoint's embedding row ``i`` is the token its own vocabulary puts at id ``i``: it must be the token
    ``--tokenizer`` (and so the shards) put there, or training starts from rows that mean other words. The same size
    is not enough: a tokenizer trained on one's own corpus at BERT's 30,522 has other ids than the hub's."""
    from bert_ds.data.tokenizer import directory_vocabulary, vocabulary_difference

    where = f"--init-from-hf {args.init_from_hf}"
    own = directory_vocabulary(args.init_from_hf)
    if own is None:
        raise BadInput(f"{where}: no vocab.txt or tokenizer.json, so nothing shows that its token ids mean what "
                       f"--tokenizer {args.tokenizer}'s do; put the vocabulary it was trained with beside its "
                       f"config.json")
    tokens, source = own
    difference = vocabulary_difference(tokens, tokenizer.vocab, str(source), str(tokenizer.vocab_file))
    if difference:
        raise BadInput(f"{where}: its vocabulary is not --tokenizer {args.tokenizer}'s ({difference}): its "
                       f"embeddings would be read as other words. Pre-train with the checkpoint's own tokenizer "
                       f"(make the shards with it) or start from scratch")


def _check_shards(recipe: Recipe, phases: list[int], sources_by_flag: dict[str, dict[int, list[Source]]],
                  world_size: int, vocab_sha256: str, vocab_size: int, verify_level: str, lowercase: bool,
                  tokenizer_dir: str) -> None:
    """Batch sizes divide for this rank count; every shard set (each source of a mix) matches its phase and the
    tokenizer, and passes the ``--verify-shards`` level. An error names the flag, the directory and, in a mix, the
    source."""
    for p in phases:
        gradient_accumulation_steps(recipe.phases[p], world_size, f"phases[{p}]")
        for flag, by_phase in sources_by_flag.items():
            sources = by_phase.get(p, [])
            mixed = len(sources) > 1 or any(s.weight is not None for s in sources)
            for source in sources:
                context = f"phases[{p}], source {source.name!r}" if mixed else ""
                _check_shard_set(recipe, p, f"{flag} {source.path}", source.path, context, vocab_sha256,
                                 vocab_size, verify_level, lowercase, tokenizer_dir)


def _check_shard_set(recipe: Recipe, p: int, label: str, directory: str, context: str, vocab_sha256: str,
                     vocab_size: int, verify_level: str, lowercase: bool, tokenizer_dir: str) -> None:
    """One shard set against phase ``p`` and the tokenizer; ``context`` (a mix's source) is named in each error."""
    from bert_ds.data.format import ShardError
    from bert_ds.data.reader import verify_shard_set
    from bert_ds.data.shard_cache import load_index

    phase = recipe.phases[p]
    suffix = f" ({context})" if context else ""
    try:
        index = load_index(directory)  # a URL's: read from the store (credentials refused: exit 2 here, no compute)
    except (ValueError, FileNotFoundError) as exc:
        raise type(exc)(f"{label}{suffix}: {exc}" if context else str(exc)) from None
    index.check_compatible(seq_len=phase.seq_len, vocab_sha256=vocab_sha256, vocab_size=vocab_size,
                           where=f"{label} ({context or f'phases[{p}]'})")
    if index.lowercase != lowercase:  # same vocab.txt, other casing: capitalised words would become [UNK]
        raise BadInput(f"{label}/index.json{suffix}: field 'lowercase' is {index.lowercase} "
                       f"({_casing(index.lowercase)}) but --tokenizer {tokenizer_dir} is "
                       f"{_casing(lowercase)} (lowercase={lowercase}); use the tokenizer the shards were "
                       f"made with")
    shard_preds = index.masking.get("max_predictions")
    if not phase.dynamic_masking and shard_preds is not None and shard_preds > phase.max_predictions:
        raise BadInput(f"{label}/index.json{suffix}: field 'masking.max_predictions' is {shard_preds} "
                       f"but phases[{p}].max_predictions is {phase.max_predictions}")
    if verify_level != "none":
        try:
            verify_shard_set(directory, verify_level).raise_for_errors()
        except ShardError as exc:
            if not context:
                raise
            raise ShardError(f"{label}{suffix}: {exc}") from None


def _casing(lowercase: bool) -> str:
    return "uncased" if lowercase else "cased"


def _fresh_start(args: RunArgs, phases: list[int], ckpt_dir: Path) -> StartPoint:
    if phases[0] > 0 and not args.init_from_hf:
        if args.resume == "none":
            raise BadInput("--phase 2 starts from phase 1's final checkpoint in --output (use --resume auto) "
                           "or from --init-from-hf")
        raise BadInput(f"--phase 2: {ckpt_dir} holds no phase-1 checkpoint to start from; "
                       "run phase 1 first or pass --init-from-hf")
    return StartPoint(phase=phases[0], step=0, tag=None, handoff=False)


def _start_point(args: RunArgs, recipe: Recipe, phases: list[int], ckpt_dir: Path,
                 tokenizer, model_config: BertConfig, rank: int, world_size: int) -> StartPoint:
    """Where the run starts: fresh, inside the newest intact checkpoint's phase, or at the next phase after it."""
    tag = ckpt.read_latest(ckpt_dir) if ckpt_dir.is_dir() else None
    if args.resume == "none" and tag is not None:
        raise BadInput(f"{ckpt_dir} already holds checkpoint {tag!r}: pass --resume auto to continue it, or choose "
                       f"a new --output")
    if tag is None:
        return _fresh_start(args, phases, ckpt_dir)
    # verified first: everything below reads the tag's run_state.json, which its checks cover
    tag, damaged = _newest_intact(ckpt_dir, tag, rank, world_size)
    state = ckpt.read_run_state(ckpt_dir, tag)
    blockers = resume_blockers(state.recipe, recipe, state.precision)
    if blockers:
        raise BadInput(f"--resume auto: checkpoint {tag!r} was made with a different recipe; field(s) "
                       f"{blockers} differ from {args.recipe}. Use a new --output or the original recipe.")
    _check_run_matches(ckpt_dir, tag, args, tokenizer, model_config)
    if state.zero_stage == 0 and state.world_size != world_size:
        raise BadInput(f"--resume auto: checkpoint {tag!r} was written by {state.world_size} ranks without ZeRO "
                       f"partitions of its own; resume it on {state.world_size} ranks or use ZeRO stage 1/2")
    if state.phase_done:
        return StartPoint(phase=state.phase + 1, step=0, tag=tag, handoff=True, damaged=damaged)
    return StartPoint(phase=state.phase, step=state.step, tag=tag, handoff=False, damaged=damaged)


def _check_run_matches(ckpt_dir: Path, tag: str, args: RunArgs, tokenizer, model_config: BertConfig) -> None:
    """The tokenizer (vocabulary sha256, size, casing) and model config of this run are those ``tag`` was trained
    with: what the tag recorded (bert_ds >= issue 16), else the tokenizer copy and ``model_config.json`` beside it."""
    where = f"--resume auto: checkpoint {ckpt_dir / tag}"
    mismatch = ckpt.trained_tokenizer_mismatch(ckpt_dir, tag, tokenizer)
    if mismatch is not None and mismatch.field == "vocab_sha256":
        raise BadInput(f"{where} was trained with vocabulary sha256 {mismatch.trained[:16]}... but --tokenizer "
                       f"{args.tokenizer} has {mismatch.given[:16]}...{mismatch.first_difference}: "
                       f"resuming would train the old weights on other token ids. Use the original tokenizer or a "
                       f"new --output")
    if mismatch is not None:
        raise BadInput(f"{where} was trained {_casing(mismatch.trained)} (lowercase={mismatch.trained}) but "
                       f"--tokenizer {args.tokenizer} is {_casing(mismatch.given)}. Use the original tokenizer or a "
                       f"new --output")
    if (ckpt_dir / ckpt.MODEL_CONFIG_NAME).is_file():
        saved_cfg = ckpt.read_model_config(ckpt_dir).to_dict()
        differ = sorted(k for k in set(saved_cfg) | set(model_config.to_dict())
                        if saved_cfg.get(k) != model_config.to_dict().get(k))
        if differ:
            field = differ[0]
            raise BadInput(f"{where}: {ckpt_dir / ckpt.MODEL_CONFIG_NAME} field {field!r} is "
                           f"{saved_cfg.get(field)!r} but this run's model has {model_config.to_dict().get(field)!r}"
                           f" (fields differing: {differ}). Use the original recipe/tokenizer or a new --output")


def _newest_intact(ckpt_dir: Path, latest: str, rank: int, world_size: int) -> tuple[str, tuple[str, ...]]:
    """(``latest`` if its files and run state pass their checks, else the newest older tag that does (logged loudly,
    on rank 0), the damaged tags skipped on the way); the ranks share the hashing and agree. ValueError naming the
    damage when no tag is intact."""
    from bert_ds.checkpoint.integrity import verify_tag

    tags = ckpt.list_tags(ckpt_dir)
    candidates = [latest] + [t for t in reversed(tags) if ckpt.parse_tag(t) < ckpt.parse_tag(latest)]
    skipped = []
    for tag in candidates:
        damage = _gather_lines(verify_tag(ckpt_dir / tag, rank, world_size))
        if not damage:
            if skipped and rank == 0:
                log.warning("=" * 100)
                log.warning("RESUMING FROM AN OLDER CHECKPOINT: %s is damaged (%s); resuming from %s, the newest "
                            "intact tag: the steps after it are trained again", skipped[0][0], skipped[0][1], tag)
                for name, line in skipped[1:]:
                    log.warning("also damaged, skipped: %s (%s)", name, line)
                log.warning("=" * 100)
            return tag, tuple(name for name, _ in skipped)
        skipped.append((tag, damage[0] + (f" and {len(damage) - 1} more file(s)" if len(damage) > 1 else "")))
    raise BadInput(f"--resume auto: checkpoint {skipped[0][0]} is damaged: {skipped[0][1]}; no older intact tag in "
                   f"{ckpt_dir} to fall back to")


def _gather_lines(lines: list[str]) -> list[str]:
    """Every rank's damage lines, on every rank (each rank verified its share of the files)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return lines
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, lines)
    return [line for part in parts for line in part]


def loader_for_phase(plan: RunPlan, p: int, *, num_workers: int | None = None, verify: str | None = None):
    """Phase ``p``'s training loader on this rank: the loader the trainer iterates and the one pre-flight checks a
    resume against are both built here, from the recipe's phase and the plan (data, seed, rank count, vocabulary,
    dynamic masking with the tokenizer's [MASK] id). ``num_workers`` and ``verify`` default to the run's
    (``--num-workers``, :attr:`RunPlan.loader_verify`); they change how batches are made, never which. Data order
    depends on the recipe seed and the phase only: the same for any number of ranks."""
    from bert_ds.data.loader import DynamicMasking, build_loader

    phase = plan.recipe.phases[p]
    masking = None
    if phase.dynamic_masking:
        masking = DynamicMasking.from_tokenizer(plan.args.tokenizer, masked_lm_prob=phase.masked_lm_prob,
                                                max_predictions=phase.max_predictions)
    return build_loader(plan.data_sources[p], global_batch_size=phase.global_batch_size,
                        micro_batch_size=phase.micro_batch_size, rank=plan.rank, world_size=plan.world_size,
                        seed=plan.recipe.seed + p,
                        num_workers=plan.args.num_workers if num_workers is None else num_workers,
                        expected_seq_len=phase.seq_len, expected_vocab_sha256=plan.vocab_sha256,
                        max_predictions=phase.max_predictions, dynamic_masking=masking,
                        shuffle_window_shards=phase.shuffle_window_shards,
                        verify=plan.loader_verify if verify is None else verify)


def _check_loader_state(plan: RunPlan) -> None:
    """A mid-phase resume continues the saved sample stream: the loader refuses another shard set, mix, seed or batch
    layout; asked here, before the run writes anything (a loader without worker processes reads only index.json)."""
    start = plan.start
    if start.tag is None or start.handoff or start.phase not in plan.data:
        return
    loader = loader_for_phase(plan, start.phase, num_workers=0, verify="size")
    state = ckpt.read_run_state(plan.ckpt_dir, start.tag).loader
    try:
        loader.load_state_dict(state, continue_with_new_mix=plan.args.continue_with_new_mix)
    except MixChangedError as exc:
        raise BadInput(f"--resume auto: checkpoint {plan.ckpt_dir / start.tag}: {exc}; pass "
                       "--continue-with-new-mix to continue with the new mix (each source kept goes on where it "
                       "was, a new one from its start)") from exc
    except ValueError as exc:
        raise BadInput(f"--resume auto: checkpoint {plan.ckpt_dir / start.tag}: {exc}") from exc


def _check_remote_windows(plan: RunPlan) -> None:
    """A phase reading a URL: its loader built once here (index.json only, no worker, nothing downloaded), so a
    ``--cache-limit`` below the look-ahead window is refused before the run writes anything."""
    for p in plan.phases:
        if p >= plan.start.phase and any(is_url(s.path) for s in plan.data_sources.get(p, [])):
            loader_for_phase(plan, p, num_workers=0, verify="size")


def _nothing_to_do(plan: RunPlan) -> str | None:
    """A message when the selected phases are already done, or ``--max-steps`` is already reached."""
    start, phases = plan.start, plan.phases
    if start.phase >= len(plan.recipe.phases) or start.phase not in phases and start.phase > max(phases):
        return f"nothing to do: {start.tag} already finished the selected phase(s)"
    if start.phase not in phases:
        raise BadInput(f"--phase {plan.args.phase}: the newest checkpoint {start.tag!r} is in phase "
                       f"{start.phase + 1}")
    max_steps = plan.args.max_steps
    if max_steps is not None and plan.first_step_of(start.phase) + start.step >= max_steps:
        # re-running a finished --max-steps command trains nothing and saves nothing
        return f"nothing to do: --max-steps {max_steps} already reached at {start.tag}"
    return None


def plan_run(args: RunArgs, recipe: Recipe, rank: int, world_size: int) -> RunPlan:
    """Check everything before compute and return the plan; raises BadInput/FileNotFoundError naming the culprit."""
    from deepspeed.accelerator import get_accelerator

    from bert_ds.data.tokenizer import load_tokenizer
    from bert_ds.deepspeed_internals import check_deepspeed_version
    from bert_ds.runtime.engine import check_kernel_support, check_optimizer_support, resolve_precision

    check_deepspeed_version()  # bert_ds relies on DeepSpeed-version-specific internals
    check_step_timeout(args, recipe)
    phases = _selected_phases(args, recipe)
    n = len(recipe.phases)
    data, data_sources, data_labels = _training_data(args, recipe, phases, rank)
    eval_data = _phase_dirs(args.eval_data, phases, n, "--eval-data")
    eval_sources = {p: parse_sources(spec, "--eval-data", weighted=False) for p, spec in eval_data.items()}
    _cache_options(args, any(is_url(s.path) for by in (data_sources, eval_sources) for v in by.values() for s in v))
    # The vocabulary is the tokenizer's; every shard set (training and eval, every phase) must agree.
    tokenizer = load_tokenizer(args.tokenizer)
    precision = resolve_precision(recipe.deepspeed.precision, get_accelerator().device_name())
    check_optimizer_support(recipe, precision)  # refusals name the recipe fields
    check_kernel_support(recipe, precision, get_accelerator().device_name(), args.recipe)
    model_config = _model_config(args, recipe, tokenizer)
    _state_memory(recipe, phases, model_config, precision, world_size, rank, get_accelerator().device_name())
    _check_shards(recipe, phases, {**data_labels, "--eval-data": eval_sources}, world_size,
                  tokenizer.vocab_sha256, tokenizer.vocab_size, args.verify_shards, tokenizer.lowercase, args.tokenizer)
    run_dir = Path(args.output)
    start = _start_point(args, recipe, phases, ckpt.checkpoint_dir(run_dir), tokenizer, model_config, rank,
                         world_size)
    plan = RunPlan(args=args, recipe=recipe, rank=rank, world_size=world_size, run_dir=run_dir, phases=phases,
                   data=data, eval_data=eval_data, vocab_sha256=tokenizer.vocab_sha256, model_config=model_config,
                   precision=precision, start=start, nothing_to_do=None, lowercase=tokenizer.lowercase,
                   data_sources=data_sources, eval_sources=eval_sources)
    plan.nothing_to_do = _nothing_to_do(plan)
    if plan.nothing_to_do is None:
        _check_loader_state(plan)
        _check_remote_windows(plan)
    if rank == 0:
        for warning in cache_dir_warnings():
            log.warning(warning)
    if plan.nothing_to_do is None:
        ckpt.check_free_space(run_dir, model_config)  # room for one more checkpoint, or refuse before compute
    return plan
