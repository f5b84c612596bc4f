"""What a fine-tuning run is, by content: the model directory's hash over its weights, config and tokenizer files,
the hashes of the data files, and the settings. Two runs are the same when these agree (the suite reuses a finished
run only then), and a tokenizer is the model's when its vocabulary is the model's token by id, never just by size.

* :func:`model_sha256`: sha256 over (file name, file sha256) of the directory's weight, config and tokenizer files.
* :func:`check_vocabulary`: a ``--tokenizer`` other than the model's own against the model directory's vocabulary
  (``vocab.txt``, else ``tokenizer.json``: :func:`bert_ds.data.tokenizer.directory_vocabulary`), and any tokenizer
  against ``config.vocab_size``: an id past the embedding is an index error, or a silently wrong row on a GPU gather.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from bert_ds.data.tokenizer import directory_vocabulary, vocabulary_difference
from bert_ds.errors import BadInput

__all__ = ["MODEL_FILES", "WEIGHT_SUFFIXES", "file_sha256", "model_sha256", "check_vocabulary"]

WEIGHT_SUFFIXES = (".safetensors", ".bin")
"""Weight files transformers loads (``model.safetensors``, sharded ``model-0000x-of-0000y.safetensors``,
``pytorch_model.bin``), with the shard index (``*.index.json``) counted by :data:`MODEL_FILES`' pattern."""
MODEL_FILES = ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "tokenizer_meta.json")
"""Config and tokenizer files that decide what the weights compute, beside the weights themselves. Fine-tuning
outputs in the same directory (``finetune_metrics.json``, predictions) are not part of the model."""


def file_sha256(path: str | Path) -> str:
    return _cached_sha256(*_stat_key(Path(path)))


def _stat_key(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns


@lru_cache(maxsize=256)
def _cached_sha256(path: str, size: int, mtime_ns: int) -> str:
    # Keyed on size and mtime too: a suite hashes its start model once per run, and BERT-large's weights are 1.3 GB.
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def model_sha256(directory: str | Path) -> str:
    """Hash of a model directory's content: sha256 over ``name sha256`` lines (sorted) of its weight files and the
    config and tokenizer files it has. A directory without weights is refused (it is not a model)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such model directory")
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and (
        p.name in MODEL_FILES or p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(".index.json")))
    if not any(n.endswith(WEIGHT_SUFFIXES) for n in names):
        raise BadInput(f"{directory}: no weight file ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) to identify "
                       "the model by")
    lines = "".join(f"{name} {file_sha256(directory / name)}\n" for name in names)
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def _tokens_by_id(tokenizer) -> list[str | None]:
    vocab = tokenizer.get_vocab()
    tokens: list[str | None] = [None] * (max(vocab.values()) + 1 if vocab else 0)
    for token, i in vocab.items():
        tokens[i] = token
    return tokens


def check_vocabulary(model_dir: str | Path, tokenizer, tokenizer_dir: str | Path | None,
                     config_vocab_size: int) -> None:
    """Refuse (BadInput, one line) a ``tokenizer_dir`` other than ``model_dir`` whose vocabulary differs from the
    model directory's own, naming the first id that differs (or the sizes), and any tokenizer with more ids than the
    model's ``config.vocab_size`` embedding rows. A tokenizer with fewer ids than rows is fine (a vocabulary padded to
    a multiple of 8 for the GPU)."""
    model_dir = Path(model_dir)
    name = Path(tokenizer_dir) if tokenizer_dir is not None else model_dir
    ids = _tokens_by_id(tokenizer)
    own = directory_vocabulary(model_dir)
    if tokenizer_dir is not None and name.resolve() != model_dir.resolve() and own is not None:
        tokens, source = own
        difference = vocabulary_difference(tokens, ids, str(source), str(name))
        if difference:
            raise BadInput(f"--tokenizer {name} is not the model's vocabulary: {difference}; fine-tune with the "
                           f"model's own tokenizer")
    if len(ids) > config_vocab_size:
        raise BadInput(f"tokenizer {name}: {len(ids)} tokens, but {model_dir}'s config.vocab_size is "
                       f"{config_vocab_size}: ids {config_vocab_size}-{len(ids) - 1} have no embedding row")
