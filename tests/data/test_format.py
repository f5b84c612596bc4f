"""The ``.pair`` record layout has one encoder: ``encode_samples`` (batched, what shard creation calls) and
``encode_sample`` (one record) write the same bytes, which ``decode_sample`` reads back."""

from __future__ import annotations

import numpy as np
import pytest

from bert_ds.data.format import Sample, decode_sample, encode_sample, encode_samples, id_dtype_for_vocab


def _samples(n: int, vocab: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(5, 130))
        ids = rng.integers(0, vocab, size=length)
        positions = np.sort(rng.choice(np.arange(1, length - 1), size=int(rng.integers(0, 6)), replace=False))
        out.append(Sample(ids, int(rng.integers(2, length - 1)), positions, rng.integers(0, vocab, len(positions)),
                          int(rng.integers(0, 2))))
    return out


@pytest.mark.parametrize("vocab", [30522, 70000])  # uint16 and uint32 token ids
def test_batched_records_are_the_single_records(vocab):
    samples = _samples(50, vocab)
    dtype = id_dtype_for_vocab(vocab)
    offsets = np.cumsum([0] + [s.length for s in samples])
    masked_offsets = np.cumsum([0] + [len(s.masked_positions) for s in samples])
    records = encode_samples(np.concatenate([s.input_ids for s in samples]), offsets,
                             np.array([s.segment_a_length for s in samples]),
                             np.concatenate([s.masked_positions for s in samples]), masked_offsets,
                             np.concatenate([s.masked_ids for s in samples]),
                             np.array([s.nsp_label for s in samples]), dtype)
    assert records == [encode_sample(s, dtype) for s in samples]
    for record, s in zip(records, samples, strict=True):
        back = decode_sample(record, dtype)
        assert np.array_equal(back.input_ids, s.input_ids) and np.array_equal(back.masked_ids, s.masked_ids)
        assert np.array_equal(back.masked_positions, s.masked_positions)
        assert (back.segment_a_length, back.nsp_label) == (s.segment_a_length, s.nsp_label)
        assert len(record) == 8 + s.length * dtype.itemsize + len(s.masked_positions) * (2 + dtype.itemsize)


def test_bad_sample_is_named():
    good, bad = _samples(2, 1000)
    bad.segment_a_length = bad.length
    lengths = [good.length, bad.length]
    with pytest.raises(ValueError, match=rf"bad sample 1: length={bad.length} segment_a_length={bad.length}"):
        encode_samples(np.concatenate([good.input_ids, bad.input_ids]), np.cumsum([0, *lengths]),
                       np.array([good.segment_a_length, bad.segment_a_length]), np.zeros(0, np.uint16),
                       np.zeros(3, np.int64), np.zeros(0, np.int64), np.array([0, 1]), np.dtype("<u2"))
    with pytest.raises(ValueError, match="bad sample 0"):
        encode_sample(bad, np.dtype("<u2"))
