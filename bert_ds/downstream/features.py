"""The BERT paper's feature-based approach (§5.3, Table 7): fixed contextual features from an exported model's hidden
layers, for a downstream model trained on top (the paper's best, concatenating the last four hidden layers, came
within 0.3 F1 of fine-tuning on CoNLL-2003 NER).

Input: a text file, one sequence per line; a line ``A ||| B`` is a sentence pair (segment ids 0 / 1), the separator
of Google's ``extract_features.py``. Empty lines are skipped. Output: ``OUT.npy`` (float32) plus ``OUT.json``
describing it: the shape, which layers were combined and how, the pooling, and per sequence its input line number,
its WordPieces and whether it was truncated.

* ``layers``: indices into the model's hidden states, 0 = the embedding output, 1..L = the encoder layers; negative
  counts from the last (-1 = the last layer, as Google's ``--layers=-1,-2,-3,-4``).
* ``combine``: ``concat`` (in the order given; width = len(layers) x hidden size), ``sum`` or ``mean`` (hidden size).
* ``pooling``: ``tokens`` keeps every WordPiece ([CLS] and [SEP] included): shape (sequences, longest sequence,
  width), zeros after each sequence's last token; ``cls`` takes the [CLS] vector and ``mean`` averages the sequence's
  tokens: shape (sequences, width).

The array is written through a memory map batch by batch, so memory stays at one batch whatever the file's size.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bert_ds import cli_args
from bert_ds.cli import alias
from bert_ds.cli_args import option
from bert_ds.errors import BadInput

__all__ = ["PAIR_SEPARATOR", "COMBINATIONS", "POOLINGS", "FeatureSpec", "parse_layers", "default_layers",
           "resolve_layers", "read_sequences", "combine_layers", "pool", "extract_features", "main"]

log = logging.getLogger(__name__)

PAIR_SEPARATOR = " ||| "
COMBINATIONS = ("concat", "sum", "mean")
POOLINGS = ("tokens", "cls", "mean")


@dataclass(frozen=True)
class FeatureSpec:
    layers: tuple[int, ...] | None = None
    """Hidden-state indices (0 = embeddings, negative from the last layer). None: the last four encoder layers, BERT
    paper §5.3's best (every encoder layer of a model with fewer than four, :func:`default_layers`)."""
    combine: str = "concat"
    """How the layers are combined: one of :data:`COMBINATIONS`."""
    pooling: str = "tokens"
    """One of :data:`POOLINGS`."""

    def __post_init__(self) -> None:
        if self.layers is not None and not self.layers:
            raise BadInput("layers: give at least one layer index")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            raise BadInput(f"layers={list(self.layers)}: an index is repeated")
        if self.combine not in COMBINATIONS:
            raise BadInput(f"combine={self.combine!r}: choose one of {COMBINATIONS}")
        if self.pooling not in POOLINGS:
            raise BadInput(f"pooling={self.pooling!r}: choose one of {POOLINGS}")


def parse_layers(text: str) -> tuple[int, ...]:
    """``"-1,-2,-3,-4"`` -> (-1, -2, -3, -4)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError as exc:
        raise BadInput(f"layers={text!r}: expected comma-separated integers such as -1,-2,-3,-4") from exc


def default_layers(num_hidden_layers: int) -> tuple[int, ...]:
    """-1, -2, -3, -4: the last four encoder layers, or all of a model that has fewer (never the embedding output)."""
    return tuple(-i for i in range(1, min(4, num_hidden_layers) + 1))


def resolve_layers(layers: tuple[int, ...], num_hidden_layers: int) -> list[int]:
    """Non-negative indices into ``output_hidden_states`` (which has ``num_hidden_layers + 1`` entries)."""
    count = num_hidden_layers + 1
    resolved = []
    for layer in layers:
        if not -count <= layer < count:
            raise BadInput(f"layer {layer}: the model has {num_hidden_layers} layers, so indices run from "
                           f"{-count} to {num_hidden_layers} (0 and {-count} = the embedding output)")
        resolved.append(layer % count)
    if len(set(resolved)) != len(resolved):
        raise BadInput(f"layers={list(layers)} name the same layer twice ({resolved} counted from 0)")
    return resolved


def read_sequences(path: str | Path) -> list[tuple[int, str, str | None]]:
    """``(line number, text A, text B or None)`` for every non-empty line of ``path``."""
    path = Path(path)
    sequences = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            a, sep, b = line.partition(PAIR_SEPARATOR.strip())
            if sep and (not a.strip() or not b.strip()):
                raise BadInput(f"{path}:{number}: a pair needs text on both sides of {PAIR_SEPARATOR.strip()!r}")
            sequences.append((number, a.strip(), b.strip() if sep else None))
    if not sequences:
        raise BadInput(f"{path}: no text (every line is empty)")
    return sequences


def combine_layers(hidden_states: tuple[torch.Tensor, ...], indices: list[int], combine: str) -> torch.Tensor:
    """(B, T, H) per layer -> (B, T, width): concatenated in the order of ``indices``, summed or averaged."""
    chosen = [hidden_states[i] for i in indices]
    if combine == "concat":
        return torch.cat(chosen, dim=-1)
    total = torch.stack(chosen).sum(0)
    return total / len(chosen) if combine == "mean" else total


def pool(features: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """(B, T, W) -> (B, T, W) with padding zeroed (``tokens``), or (B, W) (``cls``, ``mean`` of real tokens)."""
    mask = attention_mask.unsqueeze(-1).to(features.dtype)
    if pooling == "tokens":
        return features * mask
    if pooling == "cls":
        return features[:, 0]
    return (features * mask).sum(1) / mask.sum(1)


def _encode(tokenizer, sequences, max_seq_length: int) -> tuple[list[dict], list[bool]]:
    encoded, truncated = [], []
    for _, a, b in sequences:
        full = tokenizer(a, b)
        enc = tokenizer(a, b, truncation=True, max_length=max_seq_length)
        encoded.append(enc)
        truncated.append(len(full["input_ids"]) > len(enc["input_ids"]))
    return encoded, truncated


def _sidecar(out: Path, shape: tuple, model_dir, input_file, spec: FeatureSpec, layers, indices, config, max_seq_length,
             sequences, encoded, truncated, tokenizer) -> dict:
    return {
        "array": out.name, "shape": list(shape), "dtype": "float32", "model": str(model_dir), "input": str(input_file),
        "layers": list(layers), "hidden_state_indices": indices, "num_hidden_layers": config.num_hidden_layers,
        "combine": spec.combine, "pooling": spec.pooling, "hidden_size": config.hidden_size,
        "max_seq_length": max_seq_length,
        "sequences": [{"line": number, "pair": b is not None, "truncated": cut,
                       "tokens": tokenizer.convert_ids_to_tokens(enc["input_ids"])}
                      for (number, _, b), enc, cut in zip(sequences, encoded, truncated, strict=True)],
    }


def extract_features(model_dir: str | Path, input_file: str | Path, out_file: str | Path,
                     spec: FeatureSpec = FeatureSpec(), *, max_seq_length: int = 128, batch_size: int = 32,
                     device: str | None = None) -> dict:
    """Write the features of every line of ``input_file`` to ``out_file`` (``.npy``) and its description to the
    ``.json`` beside it; returns that description. Both are written under temporary names and renamed at the end."""
    import transformers

    out = Path(out_file)
    if out.suffix != ".npy":
        raise BadInput(f"{out}: the output must end in .npy")
    sequences = read_sequences(input_file)
    config = transformers.AutoConfig.from_pretrained(model_dir)  # refusals first, before any weights are read
    if max_seq_length > config.max_position_embeddings:
        raise BadInput(f"max_seq_length={max_seq_length} exceeds the model's max_position_embeddings="
                       f"{config.max_position_embeddings}")
    layers = spec.layers or default_layers(config.num_hidden_layers)
    if spec.layers is None and len(layers) < 4:
        log.info("the model has %d encoder layers: combining all of them (%s), not the last four",
                 config.num_hidden_layers, ",".join(map(str, layers)))
    indices = resolve_layers(layers, config.num_hidden_layers)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    width = config.hidden_size * (len(indices) if spec.combine == "concat" else 1)
    encoded, truncated = _encode(tokenizer, sequences, max_seq_length)
    longest = max(len(e["input_ids"]) for e in encoded)
    shape = (len(encoded), longest, width) if spec.pooling == "tokens" else (len(encoded), width)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        array = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=shape)
        with torch.no_grad():
            for start in range(0, len(encoded), batch_size):
                batch = tokenizer.pad(encoded[start:start + batch_size], padding="longest", return_tensors="pt")
                batch = {k: v.to(device) for k, v in batch.items()}
                hidden = model(**batch, output_hidden_states=True).hidden_states
                pooled = pool(combine_layers(hidden, indices, spec.combine), batch["attention_mask"], spec.pooling)
                rows = pooled.float().cpu().numpy()
                array[start:start + len(rows), ...] = 0.0
                array[start:start + len(rows), :rows.shape[1]] = rows
        array.flush()
        del array
        sidecar = _sidecar(out, shape, model_dir, input_file, spec, layers, indices, config, max_seq_length, sequences,
                           encoded, truncated, tokenizer)
        out.with_suffix(".json").write_text(json.dumps(sidecar, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("wrote %s %s (%d sequences, %d truncated to %d WordPieces)", out, shape, len(encoded), sum(truncated),
             max_seq_length)
    return sidecar


_DEFAULTS = cli_args.defaults_of(extract_features)


@dataclass
class FeaturesArgs:
    """``bert-ds-extract-features``' options (:mod:`bert_ds.cli_args`); the defaults are FeatureSpec's and
    :func:`extract_features`' own, read from there. Checked when the command runs, so a bad value is one line."""

    model: str
    """Export directory (bert-ds-convert-checkpoint --out)."""
    input: str = option(help=f"text file, one sequence a line; 'A{PAIR_SEPARATOR}B' is a sentence pair")
    out: str = option(help="output .npy (the sidecar is the same name with .json)")
    layers: str | None = None
    """Hidden states to combine: 0 = embeddings, 1..L the layers, negative from the last (default: -1,-2,-3,-4, the
    paper's last four; every encoder layer of a model with fewer)."""
    combine: str = option(FeatureSpec.combine, choices=COMBINATIONS, help="how the layers are combined")
    pooling: str = option(FeatureSpec.pooling, choices=POOLINGS, help="tokens: one vector per WordPiece; cls: the "
                          "[CLS] vector; mean: the mean over the sequence's tokens")
    max_seq_length: int = _DEFAULTS["max_seq_length"]
    """WordPieces per sequence, [CLS]/[SEP] included; longer lines are truncated."""
    batch_size: int = _DEFAULTS["batch_size"]
    """Sequences per forward pass."""
    device: str | None = None
    """Torch device (default: cuda if available, else cpu)."""


def cli_parser() -> argparse.ArgumentParser:
    return cli_args.build_parser(FeaturesArgs, "bert-ds-extract-features", "Write fixed BERT features of a text "
                                 "file (BERT paper §5.3) to .npy, with a .json sidecar describing them.")


main = alias("extract-features")


def _run(args: FeaturesArgs) -> int:
    """``bert-ds-extract-features`` / ``tools/extract_features.py``: exit 0 after writing, 2 for bad input."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for name in ("max_seq_length", "batch_size"):
        if getattr(args, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    spec = FeatureSpec(parse_layers(args.layers) if args.layers is not None else None, args.combine, args.pooling)
    sidecar = extract_features(args.model, args.input, args.out, spec, max_seq_length=args.max_seq_length,
                               batch_size=args.batch_size, device=args.device)
    print(f"wrote {args.out} {tuple(sidecar['shape'])} and {Path(args.out).with_suffix('.json')}")
    return 0
