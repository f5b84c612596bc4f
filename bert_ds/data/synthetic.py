"""Synthetic shard sets with real tar files, for loader tests and benchmarks (no tokenizer or text needed).

Every sample carries its own global id in its original tokens 1 and 2 (``ID_BASE + id // ID_RADIX`` and
``ID_BASE + id % ID_RADIX``), so a test can tell which sample a batch row holds: :func:`sample_ids_of_batch`
restores the original tokens from the masked batch and reads the id back. Every chosen position holds [MASK] (no
80/10/10): these shards test the loader's bookkeeping, not masking statistics. The [CLS]/[SEP]/[MASK] ids are
arguments without defaults, so the shards agree with whatever vocabulary a test pairs them with.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bert_ds.config import IGNORE_INDEX
from bert_ds.data.format import Sample, encode_sample, id_dtype_for_vocab
from bert_ds.data.index import ShardIndex, ShardWriter, shard_name
from bert_ds.errors import BadInput

__all__ = ["ID_BASE", "ID_RADIX", "write_synthetic_shards", "sample_ids_of_batch"]

ID_BASE = 1000
ID_RADIX = 10000


def _make_sample(gid: int, rng: np.random.Generator, *, seq_len: int, vocab_size: int, max_predictions: int,
                 masked_lm_prob: float, cls_id: int, sep_id: int, mask_id: int) -> Sample:
    length = int(rng.integers(max(8, seq_len // 2), seq_len + 1))
    seg_a = int(rng.integers(4, length - 2))
    ids = rng.integers(ID_BASE, vocab_size, size=length).astype(np.int64)
    ids[0] = cls_id
    ids[seg_a - 1] = sep_id
    ids[length - 1] = sep_id
    ids[1] = ID_BASE + gid // ID_RADIX
    ids[2] = ID_BASE + gid % ID_RADIX
    candidates = np.setdiff1d(np.arange(1, length - 1), [seg_a - 1])
    n_pred = min(max_predictions, max(1, round(length * masked_lm_prob)))
    positions = np.sort(rng.choice(candidates, size=n_pred, replace=False))
    originals = ids[positions].copy()
    masked = ids.copy()
    masked[positions] = mask_id
    return Sample(masked, seg_a, positions.astype(np.uint16), originals, int(rng.integers(0, 2)))


def write_synthetic_shards(directory: str | Path, *, num_samples: int, samples_per_shard: int, cls_id: int,
                           sep_id: int, mask_id: int, seq_len: int = 128, vocab_size: int = 30522,
                           max_predictions: int = 20, masked_lm_prob: float = 0.15, seed: int = 0,
                           vocab_sha256: str = "synthetic") -> ShardIndex:
    """Write ``num_samples`` random pairs into ``shard-NNNNNN.tar`` files plus ``index.json``; return the index.

    The last shard holds the remainder, so shard sizes can be uneven. ``cls_id``/``sep_id``/``mask_id`` are the
    special tokens' ids in the vocabulary the shards stand for (a tokenizer's ``cls_id`` etc.); they must lie below
    ``ID_BASE``, where the random tokens start."""
    specials = {"cls_id": cls_id, "sep_id": sep_id, "mask_id": mask_id}
    for name, value in specials.items():
        if not 0 <= value < ID_BASE:
            raise BadInput(f"{name}={value} must be in [0, {ID_BASE}): random tokens start at ID_BASE={ID_BASE}")
    if ID_BASE + (num_samples - 1) // ID_RADIX >= vocab_size or ID_BASE + ID_RADIX > vocab_size:
        raise BadInput(f"num_samples={num_samples} too large to encode ids with vocab_size={vocab_size}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    id_dtype = id_dtype_for_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    shards = []
    for shard, start in enumerate(range(0, num_samples, samples_per_shard)):
        with ShardWriter(directory / shard_name(shard)) as writer:
            for gid in range(start, min(start + samples_per_shard, num_samples)):
                sample = _make_sample(gid, rng, seq_len=seq_len, vocab_size=vocab_size,
                                      max_predictions=max_predictions, masked_lm_prob=masked_lm_prob, **specials)
                writer.write(f"{gid:012d}.pair", encode_sample(sample, id_dtype))
            shards.append(writer.close())
    index = ShardIndex(
        seq_len=seq_len, vocab_size=vocab_size, vocab_sha256=vocab_sha256, id_dtype=id_dtype.str, lowercase=True,
        masking={"masked_lm_prob": masked_lm_prob, "max_predictions": max_predictions, "whole_word_mask": False},
        pairing={"synthetic": True}, seed=seed, shards=shards, total_samples=num_samples)
    index.write(directory)
    return index


def sample_ids_of_batch(batch: dict) -> np.ndarray:
    """Global sample ids of the rows of a loader batch built from :func:`write_synthetic_shards` data."""
    ids = batch["input_ids"].numpy().copy()
    positions = batch["masked_lm_positions"].numpy()
    labels = batch["masked_lm_ids"].numpy()
    rows, cols = np.nonzero(labels != IGNORE_INDEX)
    ids[rows, positions[rows, cols]] = labels[rows, cols]
    return (ids[:, 1] - ID_BASE) * ID_RADIX + (ids[:, 2] - ID_BASE)
