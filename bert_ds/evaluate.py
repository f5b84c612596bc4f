"""Held-out evaluation: masked-LM and next-sentence accuracy over a whole shard set.

``mlm_accuracy`` is MLPerf BERT's quality metric: correct masked predictions / all masked predictions of the eval set,
summed over batches and ranks (a mean of per-batch accuracies would weigh a batch with few masks like a full one).
Losses are weighted the same way: masked-LM loss by masked tokens, NSP loss by sequences.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from bert_ds.checkpoint import CheckpointError, CheckpointRef, consolidated_state_dict, open_checkpoint, reading_tag
from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, defaults_of, option
from bert_ds.config import BertConfig
from bert_ds.data.batch import MODEL_INPUTS
from bert_ds.errors import BadInput

__all__ = ["MODEL_INPUTS", "RECIPE_NAME", "evaluate", "evaluate_sources", "load_checkpoint_model", "recipe_kernels",
           "evaluate_checkpoint", "main"]

log = logging.getLogger(__name__)


RECIPE_NAME = "recipe.json"
"""The resolved recipe a run writes into its run directory, beside ``checkpoints/``
(:func:`bert_ds.checkpoint.write_run_metadata`)."""

# Slots of the running-sum vector (float64: exact for counts far beyond any eval set, and fine for NCCL and gloo).
_MLM_CORRECT, _MLM_TOTAL, _NSP_CORRECT, _NSP_TOTAL, _MLM_LOSS_SUM, _NSP_LOSS_SUM, _SAMPLES = range(7)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@torch.no_grad()
def evaluate(model: nn.Module, eval_loader: Iterable[dict], device: torch.device | str | None = None, *,
             max_batches: int | None = None) -> dict:
    """Run ``model`` over ``eval_loader`` and return the global metrics.

    Returns ``mlm_accuracy``, ``nsp_accuracy``, ``mlm_loss``, ``nsp_loss`` (the NSP entries are None when the
    batches carry no ``next_sentence_label``), ``samples`` and ``masked_tokens``. ``device`` defaults to the model's.
    The model runs in eval mode (no dropout) and gets its previous mode back. When ``torch.distributed`` is
    initialised every rank must call this (each on its own slice of the data); the sums are all-reduced, so every
    rank returns the same global numbers.
    """
    sums, has_nsp = _eval_sums(model, eval_loader, device, max_batches)
    return _metrics(sums, has_nsp)


def evaluate_sources(model: nn.Module, loaders: dict[str, Iterable[dict]], device: torch.device | str | None = None,
                     *, max_batches: int | None = None) -> dict:
    """:func:`evaluate` over several held-out sets: the metrics of all of them together (summed counts, not a mean
    of accuracies) plus ``sources``, name -> that set's own metrics. ``max_batches`` applies to each set."""
    per_source, total, any_nsp = {}, None, False
    for name, loader in loaders.items():
        sums, has_nsp = _eval_sums(model, loader, device, max_batches)
        per_source[name] = _metrics(sums, has_nsp)
        total = sums if total is None else total + sums
        any_nsp = any_nsp or has_nsp
    if total is None:
        raise BadInput("evaluate_sources: no eval sets given")
    return {**_metrics(total, any_nsp), "sources": per_source}


@torch.no_grad()
def _eval_sums(model: nn.Module, eval_loader: Iterable[dict], device: torch.device | str | None,
               max_batches: int | None) -> tuple[torch.Tensor, bool]:
    """The running-sum vector (slots ``_MLM_CORRECT``...) over ``eval_loader``, all-reduced over ranks, and whether
    the batches carried NSP labels."""
    if max_batches is not None and max_batches < 1:
        raise BadInput(f"max_batches must be >= 1 or None, got {max_batches!r}")
    device = torch.device(device) if device is not None else _model_device(model)
    sums = torch.zeros(7, dtype=torch.float64, device=device)
    has_nsp = False
    was_training = model.training
    model.eval()
    try:
        for i, batch in enumerate(eval_loader):
            if max_batches is not None and i >= max_batches:
                break
            # Every key but the NSP label is required (MLM-only shard sets have none).
            inputs = {k: batch[k].to(device, non_blocking=True) for k in MODEL_INPUTS
                      if k != "next_sentence_label" or batch.get(k) is not None}
            out = model(**inputs)
            # Counts stay on the device: one synchronisation at the end, not one per batch.
            sums[_MLM_CORRECT] += out.mlm_correct.double()
            sums[_MLM_TOTAL] += out.mlm_total.double()
            sums[_MLM_LOSS_SUM] += out.mlm_loss.double() * out.mlm_total.double()  # batch mean × its weight
            sums[_SAMPLES] += inputs["input_ids"].shape[0]
            if out.nsp_loss is not None:
                has_nsp = True
                sums[_NSP_CORRECT] += out.nsp_correct.double()
                sums[_NSP_TOTAL] += out.nsp_total.double()
                sums[_NSP_LOSS_SUM] += out.nsp_loss.double() * out.nsp_total.double()
    finally:
        model.train(was_training)

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
        flag = torch.tensor([float(has_nsp)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # a rank with no batches still agrees on the NSP entries
        has_nsp = bool(flag.item())
    return sums, has_nsp


def _metrics(sums: torch.Tensor, has_nsp: bool) -> dict:
    s = sums.tolist()
    if s[_SAMPLES] == 0:
        raise BadInput("evaluate: the eval loader yielded no batches")
    masked = s[_MLM_TOTAL]
    nsp_total = s[_NSP_TOTAL]
    return {
        "mlm_accuracy": s[_MLM_CORRECT] / masked if masked else 0.0,
        "nsp_accuracy": (s[_NSP_CORRECT] / nsp_total if nsp_total else 0.0) if has_nsp else None,
        "mlm_loss": s[_MLM_LOSS_SUM] / masked if masked else 0.0,
        "nsp_loss": (s[_NSP_LOSS_SUM] / nsp_total if nsp_total else 0.0) if has_nsp else None,
        "samples": int(s[_SAMPLES]),
        "masked_tokens": int(masked),
    }


def load_checkpoint_model(checkpoint_dir: str | Path, tag: str | None = None, *, kernels: str = "auto"):
    """A :class:`BertForPreTraining` with the consolidated fp32 weights of a bert_ds training checkpoint.

    Returns ``(model, ref)`` where ``ref`` (:class:`bert_ds.checkpoint.CheckpointRef`) names the resolved tag, the
    model config and the tokenizer directory. Raises :class:`bert_ds.checkpoint.CheckpointError` (a ValueError) for a
    missing directory, tag, ``model_config.json`` or tokenizer, and for weights that do not fit the config."""
    with reading_tag(checkpoint_dir, tag) as held:  # pruning by a live training run skips the tag meanwhile
        ref = open_checkpoint(checkpoint_dir, held)
        return _model_from_checkpoint(ref, kernels), ref


def _model_from_checkpoint(ref: CheckpointRef, kernels: str) -> nn.Module:
    from bert_ds.model import BertForPreTraining

    state = consolidated_state_dict(ref.checkpoint_dir, ref.tag)
    model = BertForPreTraining(ref.config, kernels=kernels)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{ref.checkpoint_dir / ref.tag}: weights do not match model_config.json: {exc}") \
            from exc
    return model


def recipe_kernels(checkpoint_dir: str | Path) -> tuple[str, str]:
    """``(kernels, source)``: the fused-op backend of the run's recipe (``RUN_DIR/recipe.json`` beside
    ``RUN_DIR/checkpoints``), or ``auto`` when the checkpoint directory was copied without its run directory."""
    from bert_ds.recipe import load_recipe

    path = Path(checkpoint_dir).resolve().parent / RECIPE_NAME
    if not path.is_file():
        return "auto", f"default, no {path}"
    return load_recipe(path).kernels, str(path)


def _choose_kernels(requested: str | None, checkpoint_dir: Path, device: torch.device) -> tuple[str, str, bool]:
    """``(backend, where it came from, fell back)``: ``requested`` (``--kernels``) or the recipe's, checked on
    ``device`` before a large checkpoint is consolidated; ``auto`` off CUDA becomes ``torch`` (fell back)."""
    from bert_ds.kernels.registry import OPS, resolve_backend

    kernels, source = (requested, "--kernels") if requested is not None else recipe_kernels(checkpoint_dir)
    if kernels == "auto" and device.type != "cuda":
        return "torch", source, True
    if kernels != "auto":
        for op in OPS:
            try:
                resolve_backend(op, kernels, device)
            except (RuntimeError, ValueError) as exc:
                raise BadInput(f"kernels={kernels!r} ({source}): {exc}; pass --kernels torch") from exc
    return kernels, source, False


def evaluate_checkpoint(checkpoint_dir: str | Path, data_dir: str | Path, *, tag: str | None = None,
                        batch_size: int = 32, max_batches: int | None = None, device: str | None = None,
                        num_workers: int = 0, kernels: str | None = None) -> dict:
    """Evaluate a training checkpoint on a shard set whose vocabulary must be the checkpoint's tokenizer's.

    ``data_dir`` may list several sets, ``DIR,DIR``: the metrics are then those of all sets together plus
    ``sources`` (directory name -> that set's metrics, :func:`evaluate_sources`). ``kernels`` None uses the run's
    recipe (:func:`recipe_kernels`); ``auto`` off CUDA runs the torch twins with one warning. Adds ``checkpoint`` and
    ``tag`` to :func:`evaluate`'s metrics. Raises FileNotFoundError / BadInput with the offending path for a
    missing or incompatible checkpoint or data directory."""
    from bert_ds.data.loader import build_eval_loader
    from bert_ds.data.mix import parse_sources
    from bert_ds.data.tokenizer import load_tokenizer

    sources = parse_sources(str(data_dir), "--data", weighted=False)
    indexes = [_load_eval_set(Path(s.path)) for s in sources]
    with reading_tag(checkpoint_dir, tag) as held:  # pruning by a live training run skips the tag meanwhile
        ref = open_checkpoint(checkpoint_dir, held)  # also verifies the tag's checksums
        config: BertConfig = ref.config
        vocab_hash = load_tokenizer(ref.tokenizer_dir).vocab_sha256  # the hash training checked its shards against
        for s, index in zip(sources, indexes, strict=True):
            _check_eval_set(Path(s.path), index, vocab_hash, config)

        # Compatibility first: consolidating a large ZeRO checkpoint takes a while and should not precede a refusal.
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        kernels, kernels_source, fell_back = _choose_kernels(kernels, ref.checkpoint_dir, device)
        model = _model_from_checkpoint(ref, kernels)
    if fell_back:
        # Said once here: the kernel registry would warn once per fused op (three lines) about the same fact.
        log.warning("kernels 'auto' (%s): no Triton kernels on %s, evaluating with the torch implementations",
                    kernels_source, device.type)
    model.to(device)
    loaders = {s.name: build_eval_loader(s.path, micro_batch_size=batch_size, num_workers=num_workers,
                                         expected_vocab_sha256=vocab_hash) for s in sources}
    for s, index in zip(sources, indexes, strict=True):
        log.info("evaluating %s (tag %s) on %s: %d samples, seq_len %d, device %s, kernels %s (%s)",
                 ref.checkpoint_dir, ref.tag, s.path, index.total_samples, index.seq_len, device, kernels,
                 kernels_source)
    if len(sources) == 1:
        metrics = evaluate(model, loaders[sources[0].name], device, max_batches=max_batches)
    else:
        metrics = evaluate_sources(model, loaders, device, max_batches=max_batches)
    return {**metrics, "checkpoint": str(ref.checkpoint_dir), "tag": ref.tag}


def _load_eval_set(data_dir: Path):
    from bert_ds.data.index import ShardIndex

    if not data_dir.is_dir():
        raise FileNotFoundError(f"{data_dir}: eval data directory does not exist")
    return ShardIndex.load(data_dir)


def _check_eval_set(data_dir: Path, index, vocab_hash: str, config: BertConfig) -> None:
    """Refuse (naming the directory) a set whose vocabulary or sequence length does not fit the checkpoint."""
    index.check_compatible(vocab_sha256=vocab_hash, vocab_size=config.vocab_size, where=str(data_dir))
    if index.seq_len > config.max_position_embeddings:
        raise BadInput(f"{data_dir}/index.json: seq_len={index.seq_len} exceeds the model's "
                       f"max_position_embeddings={config.max_position_embeddings}")


_EVALUATE_DEFAULTS = defaults_of(evaluate_checkpoint)


@dataclass(kw_only=True)
class EvaluateArgs:
    """``bert-ds-evaluate``'s options (:mod:`bert_ds.cli_args`); defaults are :func:`evaluate_checkpoint`'s."""

    checkpoint: str
    """DeepSpeed save dir, RUN_DIR/checkpoints ('latest', tag folders, model_config.json, tokenizer/)."""
    tag: str | None = _EVALUATE_DEFAULTS["tag"]
    """Checkpoint tag (default: the one named in 'latest')."""
    data: str = option(help="shard directory with index.json (e.g. made with bert-ds-create-shards from held-out "
                       "text); DIR,DIR evaluates each set on its own ('sources' in the JSON) and all together")
    batch_size: int = _EVALUATE_DEFAULTS["batch_size"]
    """Sequences per forward pass."""
    max_batches: int | None = _EVALUATE_DEFAULTS["max_batches"]
    """Stop after this many batches (default: all)."""
    device: str | None = _EVALUATE_DEFAULTS["device"]
    """Torch device (default: cuda if available, else cpu)."""
    num_workers: int = option(_EVALUATE_DEFAULTS["num_workers"], help="data-loader worker processes (default: "
                              "%(default)s)")
    kernels: str | None = option(_EVALUATE_DEFAULTS["kernels"], choices=("auto", "triton", "torch", "apex"),
                                 help="fused-op backend (default: the run's, from RUN_DIR/recipe.json; auto without "
                                 "one)")

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise BadInput(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_batches is not None and self.max_batches < 1:
            raise BadInput(f"--max-batches must be >= 1, got {self.max_batches}")


def cli_parser() -> argparse.ArgumentParser:
    return build_parser(EvaluateArgs, "bert-ds-evaluate", "Evaluate a bert_ds training checkpoint on a held-out "
                        "shard set; prints one JSON line on stdout, everything else on stderr.")


main = alias("evaluate")


def _run(args: EvaluateArgs) -> int:
    """``bert-ds-evaluate`` / ``tools/evaluate.py``: exit 0 with one JSON line (mlm_accuracy, nsp_accuracy, mlm_loss,
    nsp_loss, samples, masked_tokens, checkpoint, tag; with several ``--data`` sets also ``sources``, each set's own
    metrics) on stdout, 2 for a missing or incompatible input."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if not torch.cuda.is_available():
        # Consolidation imports DeepSpeed, which warns that it "was unable to detect" a GPU when it falls back to its
        # CPU accelerator by itself; naming the accelerator it would pick anyway keeps the output to one warning.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    stdout = sys.stdout
    # DeepSpeed and zero_to_fp32 print to stdout; keep stdout for the one JSON line.
    with contextlib.redirect_stdout(sys.stderr):
        metrics = evaluate_checkpoint(args.checkpoint, args.data, tag=args.tag, batch_size=args.batch_size,
                                      max_batches=args.max_batches, device=args.device, num_workers=args.num_workers,
                                      kernels=args.kernels)
    print(json.dumps(metrics), file=stdout, flush=True)
    return 0
