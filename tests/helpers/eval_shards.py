"""Evaluation inputs: a small shard set over any vocabulary (random token pairs, static masks) in the real on-disk
format, and the real corpus's last documents as a held-out text."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bert_ds.data.format import Sample, encode_sample, id_dtype_for_vocab
from bert_ds.data.index import ShardIndex, ShardWriter, shard_name
from bert_ds.data.tokenizer import read_vocab, vocab_sha256


def write_shards(directory: Path, vocab_file: Path, *, num_samples: int, seq_len: int = 32, max_predictions: int = 5,
                 samples_per_shard: int = 16, seed: int = 0) -> ShardIndex:
    """A small shard set over ``vocab_file`` (random token pairs, static masks) in the real on-disk format."""
    vocab = read_vocab(vocab_file)
    rng = np.random.default_rng(seed)
    id_dtype = id_dtype_for_vocab(len(vocab))
    cls, sep, mask = vocab.index("[CLS]"), vocab.index("[SEP]"), vocab.index("[MASK]")
    directory.mkdir(parents=True)
    shards = []
    for shard, start in enumerate(range(0, num_samples, samples_per_shard)):
        with ShardWriter(directory / shard_name(shard)) as writer:
            for key in range(start, min(start + samples_per_shard, num_samples)):
                length = int(rng.integers(12, seq_len + 1))
                seg_a = int(rng.integers(4, length - 4))
                ids = rng.integers(5, len(vocab), size=length)
                ids[0], ids[seg_a - 1], ids[length - 1] = cls, sep, sep
                candidates = np.setdiff1d(np.arange(1, length - 1), [seg_a - 1])
                positions = np.sort(rng.choice(candidates, size=int(rng.integers(1, max_predictions + 1)),
                                               replace=False))
                masked = ids.copy()
                masked[positions] = mask
                sample = Sample(masked, seg_a, positions.astype(np.uint16), ids[positions], int(rng.integers(0, 2)))
                writer.write(f"{key:012d}.pair", encode_sample(sample, id_dtype))
            shards.append(writer.close())
    index = ShardIndex(seq_len=seq_len, vocab_size=len(vocab), vocab_sha256=vocab_sha256(vocab_file),
                       id_dtype=id_dtype.str, lowercase=True,
                       masking={"masked_lm_prob": 0.15, "max_predictions": max_predictions, "whole_word_mask": False},
                       pairing={"test": True}, seed=seed, shards=shards, total_samples=num_samples)
    index.write(directory)
    return index


def write_corpus_tail(corpus: Path, out: Path, chars: int) -> Path:
    """``out``: the last documents of ``corpus`` (BERT layout, blank-line separated), at least ``chars`` characters."""
    docs = corpus.read_text(encoding="utf-8").strip().split("\n\n")
    tail, total = [], 0
    while total < chars:
        tail.insert(0, docs.pop())
        total += len(tail[0])
    out.write_text("\n\n".join(tail) + "\n", encoding="utf-8")
    return out
