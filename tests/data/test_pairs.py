"""Sentence pairs (NSP) as Google builds them, checked on the real English corpus and on the shards."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bert_ds.data.pairs import create_pairs, tokenize_documents, truncate_pair
from bert_ds.data.tokenizer import load_tokenizer


def _documents(corpus) -> list[list[str]]:
    return [d.splitlines() for d in corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()]


@pytest.fixture(scope="module")
def corpus_docs(english_corpus, tokenizer_dir):
    return tokenize_documents(_documents(english_corpus), load_tokenizer(tokenizer_dir))


def _google_truncate(la: int, lb: int, max_tokens: int) -> tuple[int, int]:
    """Google's truncate_seq_pair loop, counting the tokens it drops from each side."""
    ka = kb = 0
    while la + lb > max_tokens:
        if la > lb:
            la, ka = la - 1, ka + 1
        else:
            lb, kb = lb - 1, kb + 1
    return ka, kb


def test_truncation_drops_as_google():
    rng = random.Random(0)
    for _ in range(2000):
        la, lb, m = rng.randint(1, 300), rng.randint(1, 300), rng.randint(2, 300)
        fa, ba, fb, bb = truncate_pair(la, lb, m, rng)
        assert (fa + ba, fb + bb) == _google_truncate(la, lb, m)
        assert min(fa, ba, fb, bb) >= 0


@pytest.mark.parametrize("seq_len", [128, 512])
def test_pairs_from_real_documents(corpus_docs, seq_len):
    docs = corpus_docs
    pairs = []
    for dupe in range(3):
        pairs += create_pairs(docs, random.Random(dupe), seq_len=seq_len, short_seq_prob=0.1)
    doc_range = [docs.document_tokens(d) for d in range(docs.num_documents)]
    sent_starts = set(docs.sentence_offsets.tolist())
    for p in pairs:
        la, lb = p.a_end - p.a_start, p.b_end - p.b_start
        assert la >= 1 and lb >= 1 and la + lb <= seq_len - 3
        a0, a1 = doc_range[p.a_document]
        assert a0 <= p.a_start < p.a_end <= a1
        b0, b1 = doc_range[p.b_document]
        assert b0 <= p.b_start < p.b_end <= b1
        if p.nsp_label == 1:
            assert p.b_document != p.a_document  # random B never from the same document
        else:
            assert p.b_document == p.a_document and p.b_start >= p.a_end  # B follows A
    not_next = np.mean([p.nsp_label for p in pairs])
    assert abs(not_next - 0.5) <= 0.02, not_next
    # untruncated pairs start on sentence boundaries (segments are whole sentences)
    whole = [p for p in pairs if p.a_end - p.a_start + p.b_end - p.b_start < seq_len - 3]
    assert whole and np.mean([p.a_start in sent_starts for p in whole]) > 0.9


def test_short_seq_prob_makes_shorter_pairs(corpus_docs):
    def mean_len(prob):
        ps = create_pairs(corpus_docs, random.Random(1), seq_len=128, short_seq_prob=prob)
        return np.mean([p.a_end - p.a_start + p.b_end - p.b_start for p in ps])

    assert mean_len(1.0) < 0.8 * mean_len(0.0)


def test_deterministic_for_a_seed(corpus_docs):
    a = create_pairs(corpus_docs, random.Random(5), seq_len=128)
    assert a == create_pairs(corpus_docs, random.Random(5), seq_len=128)
    assert a != create_pairs(corpus_docs, random.Random(6), seq_len=128)


def test_one_sentence_documents_are_skipped_and_counted(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    docs = tokenize_documents([["Only one sentence here."], ["First of two.", "Second of two."],
                               ["A lone line.", "   "], ["Three.", "Sentences.", "Here."]], tok)
    assert docs.num_documents == 2 and docs.skipped_short_documents == 2
    assert docs.skipped_empty_sentences == 1
    with pytest.raises(ValueError, match="at least 2 documents"):
        create_pairs(tokenize_documents([["One.", "Two."]], tok), random.Random(0), seq_len=128)
    with pytest.raises(ValueError, match="too small"):
        create_pairs(docs, random.Random(0), seq_len=4)


@pytest.mark.parametrize("fixture,seq_len", [("shards_128", 128), ("shards_512", 512)])
def test_shard_samples_are_well_formed(fixture, seq_len, request, tokenizer_dir, shard_reader):
    tok = load_tokenizer(tokenizer_dir)
    samples = shard_reader(request.getfixturevalue(fixture))
    labels = []
    for _, _, s in samples:
        ids = s.original_ids()
        assert s.length <= seq_len
        assert ids[0] == tok.cls_id and ids[s.segment_a_length - 1] == tok.sep_id and ids[-1] == tok.sep_id
        assert 2 <= s.segment_a_length <= s.length - 2  # A and B both non-empty
        seg = s.segment_ids()
        assert seg[:s.segment_a_length].sum() == 0 and seg[s.segment_a_length:].all()
        assert int((ids == tok.cls_id).sum()) == 1 and int((ids == tok.sep_id).sum()) == 2
        assert not (ids == tok.pad_id).any()
        labels.append(s.nsp_label)
    assert set(labels) == {0, 1}
    assert abs(np.mean(labels) - 0.5) <= 0.02, np.mean(labels)
