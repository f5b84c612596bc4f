"""bert_ds checkpoint -> verified Hugging Face directory.

The run directory is read through :mod:`bert_ds.checkpoint`, its one owner (tag and ``latest`` resolution, model
config, the tokenizer copied beside the tags, consolidation of any ZeRO stage); this module converts and verifies.
Verification reloads the output with transformers and checks both halves of what a user gets: the logits of the model
and the token ids of the tokenizer, against bert_ds's own model and tokenizer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from bert_ds.checkpoint import CheckpointError, CheckpointRef, consolidated_state_dict, open_checkpoint, reading_tag
from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, defaults_of, option
from bert_ds.config import BertConfig
from bert_ds.data.tokenizer import WordPieceTokenizer
from bert_ds.errors import StepFailed
from bert_ds.export.hf import HF_ARCHITECTURE, export_model, load_training_tokenizer
from bert_ds.export.keymap import ExportError

__all__ = ["VERIFY_ATOL", "VERIFY_TEXT", "VerificationError", "CheckpointRef", "find_checkpoint",
           "consolidate_checkpoint", "verify_tokenizer", "verify_export", "apply_umask", "convert_checkpoint",
           "main"]

VERIFY_ATOL = 1e-4
"""Max abs logit difference allowed between bert_ds and the reloaded HF model (fp32, CPU)."""

VERIFY_TEXT = ("Hello, WORLD! The Café's naïve résumé: Señor O'Brien paid $42.50 (déjà vu?) — "
               "ÜBER-cool façades; 東京 & Zürich... it's DONE.")
"""Sample the exported tokenizer must split exactly as bert_ds does: mixed case and accents (lowercasing and accent
stripping differ between cased and uncased), punctuation, a dash, CJK characters (split one per token)."""

_VOCAB_SAMPLE_WORDS = 256


class VerificationError(StepFailed):
    """The exported model or tokenizer does not reproduce bert_ds's logits or token ids (exit 1)."""

    def __init__(self, message: str):
        super().__init__(f"verification failed: {message}")


def find_checkpoint(checkpoint_dir: str | Path, tag: str | None = None) -> CheckpointRef:
    """Resolve the tag (``latest`` unless given) and check everything the export needs is there: the tokenizer beside
    the tags is the one the tag was trained with (vocabulary sha256 and casing) and every file of the tag matches the
    checksum recorded at save (:func:`bert_ds.checkpoint.open_checkpoint`)."""
    try:
        return open_checkpoint(checkpoint_dir, tag)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc


def consolidate_checkpoint(ref: CheckpointRef) -> dict[str, torch.Tensor]:
    """One fp32 state dict from the checkpoint, any ZeRO stage (:func:`bert_ds.checkpoint.consolidated_state_dict`)."""
    try:
        return consolidated_state_dict(ref.checkpoint_dir, ref.tag)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc


def _verification_batch(config: BertConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, seq = 2, min(32, config.max_position_embeddings)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    token_type_ids = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).clone() % config.type_vocab_size
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[1, seq * 3 // 4:] = 0  # one padded row: checks the padding mask maps too
    input_ids[1, seq * 3 // 4:] = config.pad_token_id
    return input_ids, token_type_ids, attention_mask


def _verification_texts(tokenizer: WordPieceTokenizer) -> list[str]:
    """The fixed sample, plus whole words of the vocabulary itself as written and upper-cased: a small or
    domain-specific vocabulary may turn all of the fixed sample into [UNK] under either casing, but its own words
    tokenize differently when the exported casing is not training's."""
    words = [t for t in tokenizer.vocab if t and not t.startswith("##") and not (t.startswith("[") and t.endswith("]"))]
    sample = " ".join(words[::max(1, len(words) // _VOCAB_SAMPLE_WORDS)])
    return [VERIFY_TEXT, sample, sample.upper()] if sample else [VERIFY_TEXT]


def verify_tokenizer(hf_dir: str | Path, tokenizer_dir: str | Path) -> int:
    """Reload ``hf_dir``'s tokenizer with ``transformers.AutoTokenizer`` and compare its ids with bert_ds's tokenizer
    from ``tokenizer_dir`` on :data:`VERIFY_TEXT` and a sample of the vocabulary's words, [CLS]/[SEP] included.
    Returns the number of ids compared; raises :class:`VerificationError` at the first difference."""
    import transformers

    ours = load_training_tokenizer(tokenizer_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    if len(theirs) != ours.vocab_size:
        raise VerificationError(f"{hf_dir}: tokenizer has {len(theirs)} tokens, bert_ds's {ours.vocab_file} has "
                                f"{ours.vocab_size}")
    compared = 0
    for text in _verification_texts(ours):
        want = [ours.cls_id, *ours.encode(text), ours.sep_id]
        got = theirs(text)["input_ids"]
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            raise VerificationError(
                f"{hf_dir}: the exported tokenizer splits {text[:60]!r}... unlike bert_ds ({ours.directory}, "
                f"lowercase={ours.lowercase}): from token {at}, HF ids {got[at:at + 6]} vs bert_ds {want[at:at + 6]} "
                f"({len(got)} vs {len(want)} ids)")
        compared += len(want)
    return compared


def _verify_logits(hf_dir: str | Path, state_dict: dict[str, torch.Tensor], config: BertConfig,
                   atol: float) -> tuple[float, float]:
    import transformers

    from bert_ds.model import BertForPreTraining

    ours = BertForPreTraining(config, kernels="torch")
    ours.load_state_dict({k.removeprefix("module."): v for k, v in state_dict.items()}, strict=True)
    ours.eval()
    theirs = transformers.BertForPreTraining.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if theirs.config.architectures != [HF_ARCHITECTURE]:
        raise VerificationError(f"{hf_dir}: config.json architectures={theirs.config.architectures}")
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


def verify_export(hf_dir: str | Path, state_dict: dict[str, torch.Tensor], config: BertConfig,
                  tokenizer_dir: str | Path, atol: float = VERIFY_ATOL) -> tuple[float, float]:
    """Reload ``hf_dir`` with transformers: its tokenizer must give bert_ds's ids (:func:`verify_tokenizer`), its model
    bert_ds's MLM and NSP logits (fp32, dropout off). Returns the max abs logit differences; raises
    :class:`VerificationError` on a tokenizer difference or a logit difference above ``atol``."""
    verify_tokenizer(hf_dir, tokenizer_dir)
    return _verify_logits(hf_dir, state_dict, config, atol)


def _current_umask() -> int:
    # os.umask is the only portable way to read it, and it writes: set and restore at once (single-threaded here).
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def apply_umask(root: str | Path) -> None:
    """Give ``root`` and everything in it the modes a plain ``mkdir`` / ``open`` would under the user's umask.
    ``tempfile.mkdtemp`` creates 0700 and safetensors writes 0600 (safetensors 0.8), so without this nobody else on
    a shared cluster could load an export or a fine-tuned model, whatever the umask said."""
    root = Path(root)
    mask = _current_umask()
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def convert_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, tag: str | None = None,
                       verify: bool = True) -> tuple[float, float] | None:
    """Export ``checkpoint_dir`` (tag ``latest`` unless given) to ``out_dir`` as an HF ``BertForPreTraining``.

    Everything is written into a temporary directory beside ``out_dir`` and renamed at the end, so a failure leaves
    nothing half-written; the result has the modes the user's umask gives new files (022: 0755 / 0644). Returns the
    verification's max abs (MLM, NSP) logit differences, or None if skipped."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(f"{out_dir}: already exists and is not an empty directory; choose another --out")
    try:
        # Held against pruning while it is read: a training run still writing this directory skips the tag at its
        # next prune instead of deleting it under the converter.
        with reading_tag(checkpoint_dir, tag) as held:
            ref = find_checkpoint(checkpoint_dir, held)  # tokenizer/ is what the tag learned; checksums verified
            state = consolidate_checkpoint(ref)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        export_model(state, ref.config, tmp, ref.tokenizer_dir, source=f"{ref.checkpoint_dir / ref.tag}")
        diffs = verify_export(tmp, state, ref.config, ref.tokenizer_dir) if verify else None
        apply_umask(tmp)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename cannot replace a directory
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return diffs


_CONVERT_DEFAULTS = defaults_of(convert_checkpoint)


@dataclass(kw_only=True)
class ConvertArgs:
    """``bert-ds-convert-checkpoint``'s options (:mod:`bert_ds.cli_args`); defaults are :func:`convert_checkpoint`'s."""

    checkpoint: str
    """DeepSpeed save dir, RUN_DIR/checkpoints (holds 'latest', tags, model_config.json, tokenizer/)."""
    tag: str | None = _CONVERT_DEFAULTS["tag"]
    """Checkpoint tag (default: the one named in 'latest')."""
    out: str
    """Output HF directory (must not exist or be empty)."""
    verify: bool = option(_CONVERT_DEFAULTS["verify"], help="skip reloading the output with transformers and "
                          "comparing logits and token ids")


def cli_parser() -> argparse.ArgumentParser:
    return build_parser(ConvertArgs, "bert-ds-convert-checkpoint", "Convert a bert_ds DeepSpeed checkpoint to a "
                        "verified Hugging Face BertForPreTraining directory.")


main = alias("convert-checkpoint")


def _run(args: ConvertArgs) -> int:
    """``bert-ds-convert-checkpoint`` / ``tools/convert_checkpoint.py``. Exit codes: 0 ok, 1 the reloaded model or
    tokenizer does not reproduce bert_ds's logits or token ids, 2 bad input."""
    diffs = convert_checkpoint(args.checkpoint, args.out, tag=args.tag, verify=args.verify)
    if diffs is None:
        print(f"wrote {args.out} (not verified)")
    else:
        print(f"wrote {args.out}; verified against bert_ds: same token ids, max |MLM logit diff| {diffs[0]:.2e}, "
              f"max |NSP logit diff| {diffs[1]:.2e}")
    return 0
