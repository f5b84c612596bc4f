"""DeepSpeed checkpoint -> verified Hugging Face directory.

Layout read (written by the training engine): ``CHECKPOINT_DIR/latest`` (newest complete tag), ``CHECKPOINT_DIR/<tag>/``
(DeepSpeed files, any ZeRO stage), ``CHECKPOINT_DIR/model_config.json`` and ``CHECKPOINT_DIR/tokenizer/``.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from bert_ds.checkpoint import RUN_STATE_NAME, parse_tag
from bert_ds.config import BertConfig
from bert_ds.export.hf import HF_ARCHITECTURE, export_model, tokenizer_vocab_size
from bert_ds.export.keymap import ExportError

__all__ = ["VerificationError", "CheckpointRef", "find_checkpoint", "consolidate_checkpoint", "verify_export",
           "convert_checkpoint"]

VERIFY_ATOL = 1e-4
"""Max abs logit difference allowed between bert_ds and the reloaded HF model (fp32, CPU)."""


class VerificationError(RuntimeError):
    """The exported model does not reproduce bert_ds's logits."""


@dataclass(frozen=True)
class CheckpointRef:
    checkpoint_dir: Path
    tag: str
    config: BertConfig
    tokenizer_dir: Path


def _available_tags(checkpoint_dir: Path) -> list[str]:
    # Leaves out bert_ds's in-progress save directories (``<tag>.tmp``, ``.<tag>.old``).
    return sorted(p.name for p in checkpoint_dir.iterdir()
                  if p.is_dir() and not p.name.endswith(".tmp") and not p.name.startswith(".")
                  and any(p.glob("*model_states.pt")))


def _complete_tags(checkpoint_dir: Path) -> list[str]:
    return [t for t in _available_tags(checkpoint_dir)
            if parse_tag(t) is None or (checkpoint_dir / t / RUN_STATE_NAME).is_file()]


def find_checkpoint(checkpoint_dir: str | Path, tag: str | None = None) -> CheckpointRef:
    """Resolve the tag (``latest`` unless given) and check everything the export needs is there."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise ExportError(f"{checkpoint_dir}: not a directory")
    tags = _available_tags(checkpoint_dir)
    if tag is None:
        latest = checkpoint_dir / "latest"
        if not latest.is_file():
            if tags:
                raise ExportError(f"{checkpoint_dir}: no 'latest' file (the newest checkpoint may be incomplete); "
                                  f"pass --tag, available: {tags}")
            raise ExportError(f"{checkpoint_dir}: no DeepSpeed checkpoint here (no 'latest' file, no tag directories)")
        tag = latest.read_text().strip()
    elif tag in tags and parse_tag(tag) is not None and not (checkpoint_dir / tag / RUN_STATE_NAME).is_file():
        # The training engine writes run_state.json last, after every rank finished (bert_ds.checkpoint); tags of
        # other DeepSpeed programs carry no such marker and are taken as they are.
        raise ExportError(f"{checkpoint_dir / tag}: no run_state.json, so this checkpoint is incomplete (a save "
                          f"that did not finish); pick a complete tag, available: {_complete_tags(checkpoint_dir)}")
    if tag not in tags:
        raise ExportError(f"{checkpoint_dir}: checkpoint tag {tag!r} not found; available: {tags or 'none'}")
    config_path = checkpoint_dir / "model_config.json"
    if not config_path.is_file():
        raise ExportError(f"{config_path}: missing (the training engine saves the model config beside the tags)")
    config = BertConfig.load(config_path)
    tokenizer_dir = checkpoint_dir / "tokenizer"
    size = tokenizer_vocab_size(tokenizer_dir)
    if size != config.vocab_size:
        raise ExportError(f"{config_path}: vocab_size={config.vocab_size} but {tokenizer_dir / 'vocab.txt'} has "
                          f"{size} tokens")
    return CheckpointRef(checkpoint_dir, tag, config, tokenizer_dir)


def consolidate_checkpoint(ref: CheckpointRef) -> dict[str, torch.Tensor]:
    """One fp32 state dict from the (possibly partitioned) checkpoint, via DeepSpeed's own zero_to_fp32.

    ZeRO stages 1-3 keep the fp32 master weights in ``*_optim_states.pt`` partitions, which zero_to_fp32 merges.
    Stage 0 writes no partitions: the module weights in ``mp_rank_00_model_states.pt`` are then the full model
    (they are the fp32 weights when training in fp32; with fp16/bf16 they are the half-precision copies)."""
    tag_dir = ref.checkpoint_dir / ref.tag
    if any(tag_dir.glob("*_optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(ref.checkpoint_dir), tag=ref.tag)
    else:
        model_states = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
        if len(model_states) != 1:
            raise ExportError(f"{tag_dir}: expected one mp_rank_*_model_states.pt without ZeRO partitions, found "
                              f"{[p.name for p in model_states]} (tensor/pipeline-parallel checkpoints unsupported)")
        state = torch.load(model_states[0], map_location="cpu", weights_only=False)["module"]
    return {name: tensor.float() for name, tensor in state.items()}


def _verification_batch(config: BertConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, seq = 2, min(32, config.max_position_embeddings)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    token_type_ids = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).clone() % config.type_vocab_size
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[1, seq * 3 // 4:] = 0  # one padded row: checks the padding mask maps too
    input_ids[1, seq * 3 // 4:] = config.pad_token_id
    return input_ids, token_type_ids, attention_mask


def verify_export(hf_dir: str | Path, state_dict: dict[str, torch.Tensor], config: BertConfig,
                  atol: float = VERIFY_ATOL) -> tuple[float, float]:
    """Reload ``hf_dir`` with transformers and compare MLM and NSP logits with bert_ds (fp32, dropout off).
    Returns the max abs differences; raises :class:`VerificationError` above ``atol``."""
    import transformers

    from bert_ds.model import BertForPreTraining

    ours = BertForPreTraining(config, kernels="torch")
    ours.load_state_dict({k.removeprefix("module."): v for k, v in state_dict.items()}, strict=True)
    ours.eval()
    theirs = transformers.BertForPreTraining.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if theirs.config.architectures != [HF_ARCHITECTURE]:
        raise VerificationError(f"{hf_dir}: config.json architectures={theirs.config.architectures}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    if len(tokenizer) != config.vocab_size:
        raise VerificationError(f"{hf_dir}: tokenizer has {len(tokenizer)} tokens, model vocab_size="
                                f"{config.vocab_size}")
    input_ids, token_type_ids, attention_mask = _verification_batch(config)
    with torch.no_grad():
        mlm, nsp = ours.logits(input_ids, token_type_ids, attention_mask)
        out = theirs(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
    real = attention_mask.bool()  # HF and bert_ds may legitimately differ at padding positions' outputs
    mlm_diff = (mlm[real] - out.prediction_logits[real]).abs().max().item()
    nsp_diff = (nsp - out.seq_relationship_logits).abs().max().item()
    if not (mlm_diff <= atol and nsp_diff <= atol):
        raise VerificationError(f"{hf_dir}: reloaded HF model disagrees with bert_ds: max |MLM logit diff| "
                                f"{mlm_diff:.3g}, max |NSP logit diff| {nsp_diff:.3g} (allowed {atol:g})")
    return mlm_diff, nsp_diff


def convert_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, tag: str | None = None,
                       verify: bool = True) -> tuple[float, float] | None:
    """Export ``checkpoint_dir`` (tag ``latest`` unless given) to ``out_dir`` as an HF ``BertForPreTraining``.

    Everything is written into a temporary directory beside ``out_dir`` and renamed at the end, so a failure leaves
    nothing half-written. Returns the verification's max abs (MLM, NSP) logit differences, or None if skipped."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir}: already exists and is not an empty directory; choose another --out")
    ref = find_checkpoint(checkpoint_dir, tag)
    state = consolidate_checkpoint(ref)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        export_model(state, ref.config, tmp, ref.tokenizer_dir, source=f"{ref.checkpoint_dir / ref.tag}")
        diffs = verify_export(tmp, state, ref.config) if verify else None
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename cannot replace a directory
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return diffs
