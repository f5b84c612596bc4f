"""Sentence-pair (NSP) instances, as Google's ``create_instances_from_document`` builds them.

Documents are tokenized once into one flat id array; a segment is a run of whole sentences, so every A and B (also
after truncation) is a contiguous slice of that array and a pair is six integers, not a list of tokens.

Per document (google-research/bert ``create_pretraining_data.py``, ``create_instances_from_document``, 2018): target
length ``seq_len - 3``, with probability ``short_seq_prob`` a random shorter one in [2, seq_len - 3]; sentences are
collected until the target is reached; A takes a random number of them; B is the rest (IsNext, label 0) or, with
probability 1/2, sentences from a random start in a random *other* document until B reaches ``target - len(A)``
(NotNext, label 1), and the sentences not used by A are put back. The longer side is then trimmed one token at a
time, at its front or its back at random, until ``len(A) + len(B) <= seq_len - 3``.

Departures from Google, each for a stated reason:

* When only one sentence was collected Google forces NotNext; with a short target every sentence is such a chunk,
  so whole documents become NotNext and the labels drift well above 50% (56% measured on the test corpus at 128).
  Here the coin still decides: IsNext takes B from the sentences after it (up to the target), or, for a document's
  last sentence, takes that sentence as B and the one before it as A.
* The random document is drawn from the *other* documents directly (Google retries 10 times and may end on the same
  document: a NotNext pair from the same document is a wrong label).
* Documents with fewer than two sentences are skipped and counted: they cannot make an IsNext pair.
* The front/back choices of a truncation are drawn as one binomial count per side (the same distribution as
  Google's per-token coin, in two calls).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from bert_ds.data.tokenizer import WordPieceTokenizer
from bert_ds.errors import BadInput

__all__ = ["TokenizedDocuments", "Pair", "tokenize_documents", "create_pairs", "truncate_pair", "pair_input_ids"]

IS_NEXT, NOT_NEXT = 0, 1  # NSP labels, Google / Hugging Face convention


@dataclass
class TokenizedDocuments:
    """Documents tokenized into one flat array: document d holds sentences ``document_offsets[d]:[d+1]``, sentence s
    holds tokens ``ids[sentence_offsets[s]:sentence_offsets[s+1]]``; every document has >= 2 non-empty sentences."""

    ids: np.ndarray  # (T,) int32
    sentence_offsets: np.ndarray  # (S+1,) int64
    document_offsets: np.ndarray  # (D+1,) int64
    skipped_short_documents: int = 0
    """Documents dropped for having fewer than two sentences with tokens."""
    skipped_empty_sentences: int = 0
    """Sentences dropped because they tokenize to nothing."""

    @property
    def num_documents(self) -> int:
        return int(self.document_offsets.shape[0] - 1)

    def document_tokens(self, d: int) -> tuple[int, int]:
        """The token range [start, end) of document d."""
        so = self.sentence_offsets
        return int(so[self.document_offsets[d]]), int(so[self.document_offsets[d + 1]])


class Pair(NamedTuple):
    """One NSP instance as token ranges into ``TokenizedDocuments.ids`` plus provenance (document indices)."""

    a_start: int
    a_end: int
    b_start: int
    b_end: int
    nsp_label: int
    a_document: int
    b_document: int


def tokenize_documents(documents: Sequence[Sequence[str]], tokenizer: WordPieceTokenizer) -> TokenizedDocuments:
    """Tokenize every sentence of every document once, in one batched call of the fast tokenizer."""
    sentences = [s for doc in documents for s in doc]
    flat, offsets = tokenizer.encode_batch(sentences)
    lengths = np.diff(offsets)
    per_doc = np.fromiter((len(doc) for doc in documents), dtype=np.int64, count=len(documents))
    doc_of_sentence = np.repeat(np.arange(len(documents)), per_doc)
    keep_sentence = lengths > 0
    kept_per_doc = np.bincount(doc_of_sentence[keep_sentence], minlength=len(documents))
    keep_doc = kept_per_doc >= 2
    keep_sentence &= keep_doc[doc_of_sentence]
    kept_lengths = lengths[keep_sentence]
    token_keep = np.repeat(keep_sentence, lengths)
    sentence_offsets = np.zeros(kept_lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(kept_lengths, out=sentence_offsets[1:])
    document_offsets = np.zeros(int(keep_doc.sum()) + 1, dtype=np.int64)
    np.cumsum(kept_per_doc[keep_doc], out=document_offsets[1:])
    return TokenizedDocuments(
        ids=flat[token_keep], sentence_offsets=sentence_offsets, document_offsets=document_offsets,
        skipped_short_documents=int((per_doc > 0).sum() - keep_doc.sum()),
        skipped_empty_sentences=int((~(lengths > 0)).sum()),
    )


def truncate_pair(la: int, lb: int, max_tokens: int, rng: random.Random) -> tuple[int, int, int, int]:
    """Google's ``truncate_seq_pair`` on lengths: drop from the longer side (B on ties) until the pair fits, each
    drop at the front or the back with probability 1/2. -> (drop A front, drop A back, drop B front, drop B back)."""
    excess = la + lb - max_tokens
    if excess <= 0:
        return 0, 0, 0, 0
    # The side dropped from depends only on the lengths: take the longer down to the shorter, then alternate.
    gap = abs(la - lb)
    first = min(gap, excess)
    rest = excess - first
    ka = first if la > lb else 0
    kb = first - ka
    # From equal lengths Google drops B first (ties go to B), then A, alternately.
    kb += (rest + 1) // 2
    ka += rest // 2
    fa = rng.getrandbits(ka).bit_count() if ka else 0
    fb = rng.getrandbits(kb).bit_count() if kb else 0
    return fa, ka - fa, fb, kb - fb


def create_pairs(docs: TokenizedDocuments, rng: random.Random, *, seq_len: int, short_seq_prob: float = 0.1
                 ) -> list[Pair]:
    """All NSP instances of one pass over ``docs`` (one duplicate), in document order."""
    if seq_len < 5:
        raise BadInput(f"seq_len={seq_len} is too small for [CLS] A [SEP] B [SEP] (needs at least 5)")
    n_docs = docs.num_documents
    if n_docs < 2:
        raise BadInput(f"NSP needs at least 2 documents with 2+ sentences to draw a random B from, got {n_docs}")
    max_tokens = seq_len - 3
    soff = docs.sentence_offsets.tolist()
    doff = docs.document_offsets.tolist()
    pairs: list[Pair] = []
    for d in range(n_docs):
        s_begin, s_end = doff[d], doff[d + 1]
        target = max_tokens
        if rng.random() < short_seq_prob:
            target = rng.randint(2, max_tokens)
        chunk_start = i = s_begin
        while i < s_end:
            if i == s_end - 1 or soff[i + 1] - soff[chunk_start] >= target:
                n = i - chunk_start + 1
                a_end = chunk_start + (rng.randint(1, n - 1) if n >= 2 else 1)  # sentence index, exclusive
                a0, a1 = soff[chunk_start], soff[a_end]
                if rng.random() < 0.5:
                    label = NOT_NEXT
                    b_doc = rng.randint(0, n_docs - 2)
                    b_doc += b_doc >= d
                    r_begin, r_end = doff[b_doc], doff[b_doc + 1]
                    j = rng.randint(r_begin, r_end - 1)
                    b0 = soff[j]
                    need = target - (a1 - a0)
                    while j < r_end:
                        j += 1
                        if soff[j] - b0 >= need:
                            break
                    b1 = soff[j]
                    i = a_end - 1  # put the sentences A did not use back
                else:
                    label, b_doc = IS_NEXT, d
                    if n >= 2:
                        b0, b1 = a1, soff[i + 1]
                    elif i + 1 < s_end:  # one sentence collected: B from the sentences after it, up to the target
                        j = i + 1
                        b0, need = soff[j], target - (a1 - a0)
                        while j < s_end:
                            j += 1
                            if soff[j] - b0 >= need:
                                break
                        b1 = soff[j]
                        i = j - 1
                    else:  # the document's last sentence alone: it is B, the sentence before it A
                        a0, a1, b0, b1 = soff[i - 1], soff[i], soff[i], soff[i + 1]
                fa, ba, fb, bb = truncate_pair(a1 - a0, b1 - b0, max_tokens, rng)
                pairs.append(Pair(a0 + fa, a1 - ba, b0 + fb, b1 - bb, label, d, b_doc))
                chunk_start = i + 1
            i += 1
    return pairs


def pair_input_ids(ids: np.ndarray, pair: Pair, *, cls_id: int, sep_id: int, dtype: np.dtype
                   ) -> tuple[np.ndarray, int]:
    """``[CLS] A [SEP] B [SEP]`` as an array of ``dtype`` -> (ids, segment_a_length = len(A) + 2)."""
    la, lb = pair.a_end - pair.a_start, pair.b_end - pair.b_start
    out = np.empty(la + lb + 3, dtype=dtype)
    out[0] = cls_id
    out[1:la + 1] = ids[pair.a_start:pair.a_end]
    out[la + 1] = sep_id
    out[la + 2:la + 2 + lb] = ids[pair.b_start:pair.b_end]
    out[-1] = sep_id
    return out, la + 2
