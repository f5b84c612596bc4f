"""Masked-LM masking: the mask_tokens contract, and masking statistics on shards made from real English text."""

from __future__ import annotations

import numpy as np
import pytest

from bert_ds.data.create import create_shards
from bert_ds.data.masking import default_max_predictions, mask_tokens, num_predictions, word_ids_from_pieces
from bert_ds.data.tokenizer import load_tokenizer

MASK, VOCAB = 4, 1000


def _sample(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(5, VOCAB, size=n).astype(np.uint16)
    ids[0], ids[n // 2], ids[-1] = 2, 3, 3
    cand = np.ones(n, dtype=bool)
    cand[[0, n // 2, n - 1]] = False
    return ids, cand


def test_contract_dtype_order_and_counts():
    ids, cand = _sample(128)
    rng = np.random.default_rng(1)
    masked, pos, orig = mask_tokens(ids, rng, candidates=cand, max_predictions=20, vocab_size=VOCAB, mask_id=MASK)
    assert masked.dtype == ids.dtype and masked.shape == ids.shape
    assert pos.dtype == np.int64 and np.all(np.diff(pos) > 0)
    assert len(pos) == num_predictions(125, 0.15, 20) == 19
    assert np.array_equal(orig, ids[pos]) and cand[pos].all()
    untouched = np.setdiff1d(np.arange(128), pos)
    assert np.array_equal(masked[untouched], ids[untouched])
    # same seed, same result; the input is never modified
    again = mask_tokens(ids, np.random.default_rng(1), candidates=cand, max_predictions=20, vocab_size=VOCAB,
                        mask_id=MASK)
    assert all(np.array_equal(a, b) for a, b in zip((masked, pos, orig), again, strict=True))


def test_cap_minimum_and_empty():
    ids, cand = _sample(512)
    _, pos, _ = mask_tokens(ids, np.random.default_rng(0), candidates=cand, max_predictions=80, vocab_size=VOCAB,
                            mask_id=MASK)
    assert len(pos) == 76  # round(0.15 * 509) = 76 < 80
    _, pos, _ = mask_tokens(ids, np.random.default_rng(0), candidates=cand, max_predictions=10, vocab_size=VOCAB,
                            mask_id=MASK)
    assert len(pos) == 10
    small, small_cand = _sample(5)
    _, pos, _ = mask_tokens(small, np.random.default_rng(0), candidates=small_cand, max_predictions=20,
                            vocab_size=VOCAB, mask_id=MASK)
    assert len(pos) == 1  # at least one
    masked, pos, orig = mask_tokens(small, np.random.default_rng(0), candidates=np.zeros(5, bool),
                                    max_predictions=20, vocab_size=VOCAB, mask_id=MASK)
    assert len(pos) == 0 and len(orig) == 0 and np.array_equal(masked, small)
    assert default_max_predictions(128) == 20 and default_max_predictions(512) == 80
    assert default_max_predictions(256) == 38


def test_whole_word_keeps_words_whole_and_respects_cap():
    rng = np.random.default_rng(3)
    for trial in range(300):
        n = int(rng.integers(8, 200))
        ids, cand = _sample(n, seed=trial)
        is_cont = rng.random(n) < 0.4
        is_cont[0] = False
        word_ids = np.cumsum(~is_cont)
        cap = int(rng.integers(1, 30))
        masked, pos, orig = mask_tokens(ids, rng, candidates=cand, max_predictions=cap, vocab_size=VOCAB,
                                        mask_id=MASK, word_ids=word_ids)
        want = num_predictions(int(cand.sum()), 0.15, cap)
        assert len(pos) <= want and np.all(np.diff(pos) > 0) and cand[pos].all()
        chosen = set(pos.tolist())
        for w in np.unique(word_ids[pos]):
            members = [p for p in np.flatnonzero(word_ids == w).tolist() if cand[p]]
            assert chosen.issuperset(members), (trial, w)


def _masking_stats(samples, tok):
    eligible = predicted = n_mask = n_keep = 0
    specials = {tok.cls_id, tok.sep_id, tok.pad_id}
    for _, _, s in samples:
        pos = s.masked_positions.astype(np.int64)
        assert not set(s.masked_ids.tolist()) & specials, "a special token was chosen for prediction"
        assert not set(pos.tolist()) & {0, s.segment_a_length - 1, s.length - 1}
        eligible += s.length - 3
        predicted += len(pos)
        after = s.input_ids[pos]
        n_mask += int((after == tok.mask_id).sum())
        n_keep += int((after == s.masked_ids).sum())
    return predicted / eligible, n_mask / predicted, n_keep / predicted, 1 - (n_mask + n_keep) / predicted


@pytest.mark.parametrize("fixture", ["shards_128", "shards_512"])
def test_masking_statistics_on_real_text(fixture, request, tokenizer_dir, shard_reader):
    tok = load_tokenizer(tokenizer_dir)
    samples = shard_reader(request.getfixturevalue(fixture))
    frac, mask, keep, rand = _masking_stats(samples, tok)
    assert abs(frac - 0.15) <= 0.01, frac  # BERT §3.1: 15% of the (non-special) tokens
    # 80/10/10; a random replacement equal to the original counts as kept (1/vocab of them).
    assert abs(mask - 0.8) <= 0.02 and abs(keep - 0.1) <= 0.02 and abs(rand - 0.1) <= 0.02, (mask, keep, rand)


def test_whole_word_mask_shards_keep_words_whole(english_corpus, tokenizer_dir, tmp_path, shard_reader):
    tok = load_tokenizer(tokenizer_dir)
    is_cont = tok.continuation_table()
    create_shards([english_corpus], tokenizer_dir, tmp_path, seq_len=128, whole_word_mask=True, seed=7,
                  samples_per_shard=1000, progress=False)
    samples = shard_reader(tmp_path)
    split_words = 0
    multi_piece = 0
    for _, _, s in samples:
        original = s.original_ids()
        words = word_ids_from_pieces(original, is_cont)
        cand = np.ones(s.length, dtype=bool)
        cand[[0, s.segment_a_length - 1, s.length - 1]] = False
        pos = set(s.masked_positions.tolist())
        for w in np.unique(words[s.masked_positions.astype(np.int64)]):
            members = [p for p in np.flatnonzero(words == w).tolist() if cand[p]]
            multi_piece += len(members) > 1
            split_words += not pos.issuperset(members)
    assert split_words == 0
    assert multi_piece > 100  # the check is not vacuous: many masked words have several pieces
    frac, mask, keep, rand = _masking_stats(samples, tok)
    assert abs(frac - 0.15) <= 0.015, frac  # whole words may leave the count a little under 15%


def test_batched_pair_positions_match_the_per_sample_rule():
    from bert_ds.data.masking import choose_pair_positions

    rng = np.random.default_rng(0)
    la = rng.integers(1, 120, size=4000)
    lb = rng.integers(1, 120, size=4000)
    counts, pos = choose_pair_positions(la, lb, rng, max_predictions=20)
    hits = np.zeros(250)
    for i in range(len(la)):
        row = pos[i][pos[i] >= 0]
        assert len(row) == counts[i] == num_predictions(int(la[i] + lb[i]), 0.15, 20)
        assert np.all(np.diff(row) > 0)
        length = la[i] + lb[i] + 3
        assert not set(row.tolist()) & {0, la[i] + 1, length - 1} and row.max() < length - 1
        hits[row] += 1
    # uniform over candidates: position 1 (always A) and position la+2 (first of B) equally likely
    first_a = hits[1] / len(la)
    first_b = sum(1 for i in range(len(la)) if la[i] + 2 in pos[i]) / len(la)
    assert abs(first_a - first_b) < 0.03, (first_a, first_b)


def test_shard_records_are_what_encode_sample_writes(shards_128, shard_reader):
    import tarfile

    from bert_ds.data.format import encode_sample
    from bert_ds.data.index import ShardIndex

    index = ShardIndex.load(shards_128)
    dtype = np.dtype(index.id_dtype)
    by_member = {m: s for _, m, s in shard_reader(shards_128)}
    with tarfile.open(shards_128 / index.shards[0].name) as tar:
        for member in tar:
            assert tar.extractfile(member).read() == encode_sample(by_member[member.name], dtype)


def test_mask_pairs_rows_depend_only_on_their_key():
    from bert_ds.data.masking import counter_hash, mask_pairs

    rng = np.random.default_rng(5)
    n, seq = 300, 64
    lengths = rng.integers(5, seq + 1, size=n)
    seg_a = np.array([rng.integers(3, length - 1) for length in lengths])  # len(A) + 2, len(A), len(B) >= 1
    ids = rng.integers(5, VOCAB, size=(n, seq)).astype(np.int32)
    keys = counter_hash(1, 2, np.arange(n))
    kw = {"max_predictions": 12, "vocab_size": VOCAB, "mask_id": MASK, "masked_lm_prob": 0.3}
    masked, pos, orig = mask_pairs(ids, seg_a, lengths, keys, **kw)
    for i in range(n):  # alone, or in a batch with other rows (and a different padding width): the same mask
        m1, p1, o1 = mask_pairs(ids[i:i + 1], seg_a[i:i + 1], lengths[i:i + 1], keys[i:i + 1], **kw)
        k = p1.shape[1]
        assert np.array_equal(masked[i], m1[0]) and np.array_equal(pos[i, :k], p1[0]) and (pos[i, k:] == -1).all()
        assert np.array_equal(orig[i, :k], o1[0])
        row = pos[i][pos[i] >= 0]
        assert len(row) == num_predictions(int(lengths[i] - 3), 0.3, 12) and np.all(np.diff(row) > 0)
        assert not set(row.tolist()) & {0, int(seg_a[i]) - 1, int(lengths[i]) - 1} and row.max() < lengths[i]
        assert np.array_equal(orig[i, :len(row)], ids[i, row])
        untouched = np.setdiff1d(np.arange(seq), row)
        assert np.array_equal(masked[i, untouched], ids[i, untouched])
    # 80/10/10 (BERT paper §3.1), and a fresh key gives a fresh mask
    chosen = pos >= 0
    after = np.take_along_axis(masked, np.where(chosen, pos, 0), axis=1)[chosen]
    assert 0.77 < (after == MASK).mean() < 0.83
    assert 0.08 < (after == orig[chosen]).mean() < 0.12
    _, other, _ = mask_pairs(ids, seg_a, lengths, counter_hash(1, 3, np.arange(n)), **kw)
    assert (other != pos).any(axis=1).mean() > 0.9


def test_counter_uniforms_are_uniform():
    from bert_ds.data.masking import counter_hash, counter_uniforms

    u = counter_uniforms(counter_hash(0, 0, np.arange(20000)), np.arange(10))
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert np.histogram(u, bins=10, range=(0, 1))[0].min() > 0.97 * u.size / 10
    assert abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.03  # neighbouring counters of one key
    assert counter_hash(2**64 + 7) == counter_hash(7)  # keys are taken modulo 2**64


@pytest.mark.parametrize("source", ["generator", "uniforms"])
def test_replace_chosen_is_80_10_10(source):
    """BERT paper §3.1 / A.1, the one implementation: shares of [MASK], random and kept tokens, random tokens uniform
    over the whole vocabulary, positions not chosen untouched; both sources of random tokens."""
    from bert_ds.data.masking import replace_chosen

    rng = np.random.default_rng(11)
    n = 400_000
    ids = np.full(n + 1000, 7, dtype=np.int64)  # 7: a token the 10% random draw rarely lands on (1 in VOCAB)
    at = np.sort(rng.choice(ids.shape[0], size=n, replace=False))
    random_tokens = rng if source == "generator" else rng.random(n)
    replace_chosen(ids, at, rng.random(n), mask_id=MASK, vocab_size=VOCAB, random_tokens=random_tokens)
    after = ids[at]
    mask, keep = (after == MASK).mean(), (after == 7).mean()
    assert abs(mask - 0.8) < 0.003 and abs(keep - 0.1) < 0.003, (mask, keep)
    drawn = after[(after != MASK) & (after != 7)]
    assert abs(drawn.shape[0] / n - 0.1 * (1 - 2 / VOCAB)) < 0.003
    assert drawn.min() >= 0 and drawn.max() < VOCAB
    counts = np.bincount(drawn, minlength=VOCAB)
    counts = np.delete(counts, [MASK, 7])  # ~40 per id; chi-square over 998 ids: mean 997, sd 45
    assert ((counts - counts.mean()) ** 2 / counts.mean()).sum() < 1.25 * counts.shape[0]
    untouched = np.setdiff1d(np.arange(ids.shape[0]), at)
    assert (ids[untouched] == 7).all()


def test_every_masking_path_applies_the_rule_through_replace_chosen(monkeypatch):
    """Static (per sample, batched), dynamic (counter-based): replace the one rule by "always [MASK]" and every path
    follows, so none of them carries its own copy."""
    from bert_ds.data import masking

    def always_mask(ids, at, u, *, mask_id, vocab_size, random_tokens):
        ids[at] = mask_id

    monkeypatch.setattr(masking, "replace_chosen", always_mask)
    ids, cand = _sample(200)
    masked, pos, _ = masking.mask_tokens(ids, np.random.default_rng(0), candidates=cand, max_predictions=30,
                                         vocab_size=VOCAB, mask_id=MASK)
    assert (masked[pos] == MASK).all() and len(pos) == 30
    la, lb = np.array([50, 70]), np.array([60, 40])
    flat = np.arange(5, 5 + int((la + lb + 3).sum())) % VOCAB
    starts = np.array([0, 113])
    masked, counts, pos, _ = masking.mask_packed_pairs(flat, starts, la, lb, np.random.default_rng(0),
                                                       max_predictions=20, vocab_size=VOCAB, mask_id=MASK)
    assert (masked == MASK).sum() == counts.sum() == 2 * num_predictions(110, 0.15, 20)
    batch = np.tile(np.arange(5, 69), (2, 1))
    keys = masking.counter_hash(1, 2, np.arange(2))
    masked, pos, _ = masking.mask_pairs(batch, np.array([30, 20]), np.array([64, 50]), keys, max_predictions=20,
                                        vocab_size=VOCAB, mask_id=MASK)
    assert (masked == MASK).sum() == (pos >= 0).sum() > 0
