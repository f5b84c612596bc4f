"""Dynamic masking: every sample re-masked each epoch from its stored original tokens (instead of the static masks
in the shards), at a configurable rate (e.g. MosaicBERT's 30%), optionally whole-word.

The mask depends only on ``(seed, epoch, global sample id)``: per-token masking is vectorised over a micro batch with
each sample's uniforms from a counter-based generator (``masking.counter_uniforms``), so a sample's mask is the same
in a batch of 1 or 64, on any rank or worker; whole-word masking (Google's sequential skip loop) runs per sample. The
loader's collator (:mod:`bert_ds.data.collate`) calls it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert_ds.data.masking import default_max_predictions, mask_pairs, mask_tokens, word_ids_from_pieces
from bert_ds.data.tokenizer import continuation_table, load_tokenizer, read_vocab
from bert_ds.errors import BadInput

__all__ = ["DynamicMasking"]


@dataclass(kw_only=True)
class DynamicMasking:
    """Re-mask every sample each epoch from its stored original tokens (instead of the static masks in the shards).

    ``whole_word`` masks all pieces of a word together; it needs the vocabulary to know which tokens continue a
    word: pass ``vocab`` (tokenizer dir or vocab.txt) or ``continuation`` (one bool per token id). Usually built by
    :meth:`from_tokenizer`, which takes every id from the tokenizer."""

    vocab_size: int
    """Size of the WordPiece vocabulary (random replacements are drawn from it); must match index.json."""
    mask_id: int
    """Id of [MASK]; no default: it is 4 in bert_ds vocabularies and 103 in Google's, so it comes from the tokenizer."""
    masked_lm_prob: float = 0.15
    """Fraction of maskable tokens to predict (BERT paper: 0.15; MosaicBERT: 0.30)."""
    max_predictions: int | None = None
    """Cap on predictions per sample; None -> the larger of Google's default (20 at 128, 80 at 512) and
    ceil(seq_len * masked_lm_prob)."""
    whole_word: bool = False
    vocab: str | Path | None = None
    continuation: Sequence[bool] | np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise BadInput(f"DynamicMasking.vocab_size={self.vocab_size}: must be positive")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise BadInput(f"DynamicMasking.masked_lm_prob={self.masked_lm_prob}: must be in (0, 1)")
        if self.max_predictions is not None and self.max_predictions <= 0:
            raise BadInput(f"DynamicMasking.max_predictions={self.max_predictions}: must be positive")
        if not 0 <= self.mask_id < self.vocab_size:
            raise BadInput(f"DynamicMasking.mask_id={self.mask_id}: outside the vocabulary")
        if self.whole_word:
            if self.continuation is None and self.vocab is None:
                raise BadInput("DynamicMasking.whole_word=True needs 'vocab' (tokenizer dir or vocab.txt) "
                               "or 'continuation' (a bool per token id)")
            if self.continuation is None:
                self.continuation = continuation_table(read_vocab(self.vocab))
            self.continuation = np.asarray(self.continuation, dtype=bool)
            if self.continuation.shape != (self.vocab_size,):
                raise BadInput(f"DynamicMasking.continuation has {self.continuation.shape[0]} entries but "
                               f"vocab_size={self.vocab_size}")

    @classmethod
    def from_tokenizer(cls, tokenizer_dir: str | Path, **kwargs) -> DynamicMasking:
        """Take ``vocab_size``, ``mask_id`` and (for whole-word masking) the continuation table from a tokenizer."""
        tok = load_tokenizer(tokenizer_dir)
        return cls(vocab_size=tok.vocab_size, mask_id=tok.mask_id, continuation=tok.continuation_table(), **kwargs)

    def resolved_max_predictions(self, seq_len: int) -> int:
        if self.max_predictions is not None:
            return self.max_predictions
        # Google/NVIDIA's 20 at 128 and 80 at 512 for 15%; higher rates (MosaicBERT 30%) need room for all of them.
        return max(default_max_predictions(seq_len), math.ceil(seq_len * self.masked_lm_prob - 1e-9))

    def describe(self) -> dict:
        """JSON-safe summary recorded in the loader state (the vocab table by hash only)."""
        table = None
        if self.continuation is not None:
            table = hashlib.sha256(np.asarray(self.continuation, dtype=bool).tobytes()).hexdigest()
        return {"vocab_size": self.vocab_size, "masked_lm_prob": self.masked_lm_prob,
                "max_predictions": self.max_predictions, "whole_word": self.whole_word, "mask_id": self.mask_id,
                "continuation_sha256": table}

    def mask_batch(self, original: np.ndarray, segment_a_lengths: np.ndarray, lengths: np.ndarray, keys: np.ndarray,
                   max_predictions: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-token masking of a padded batch (not whole-word): (masked ids (b, S), positions (b, k) -1 padded,
        original ids at them); row i's mask is a function of ``keys[i]`` alone (see ``masking.mask_pairs``)."""
        return mask_pairs(original, segment_a_lengths, lengths, keys, max_predictions=max_predictions,
                          vocab_size=self.vocab_size, mask_id=self.mask_id, masked_lm_prob=self.masked_lm_prob)

    def mask(self, original: np.ndarray, segment_a_length: int, rng: np.random.Generator,
             max_predictions: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(masked ids, ascending positions, original ids at those positions) for one ``[CLS] A [SEP] B [SEP]``,
        one sample at a time through ``mask_tokens`` (the whole-word path)."""
        length = original.shape[0]
        # Never [CLS] (0) or the two [SEP]s (end of A, end of B) — BERT paper §3.1.
        candidates = np.ones(length, dtype=bool)
        candidates[[0, segment_a_length - 1, length - 1]] = False
        word_ids = word_ids_from_pieces(original, self.continuation) if self.whole_word else None
        return mask_tokens(original, rng, candidates=candidates, max_predictions=max_predictions,
                           vocab_size=self.vocab_size, mask_id=self.mask_id,
                           masked_lm_prob=self.masked_lm_prob, word_ids=word_ids)
