"""Masked-LM masking (BERT paper §3.1, Google's ``create_masked_lm_predictions``), vectorised with numpy.

Used both when shards are created (static masking, one mask per duplicate) and by the loader (dynamic masking).
"""

from __future__ import annotations

import numpy as np

__all__ = ["MASK_PROB", "RANDOM_PROB", "KEEP_PROB", "default_max_predictions", "num_predictions",
           "word_ids_from_pieces", "mask_tokens", "choose_pair_positions", "replacement_kinds"]

# BERT paper §3.1: of the chosen tokens 80% become [MASK], 10% a random token, 10% stay unchanged.
MASK_PROB = 0.8
RANDOM_PROB = 0.1
KEEP_PROB = 0.1


def default_max_predictions(seq_len: int) -> int:
    """Google/NVIDIA: 20 predictions at sequence length 128, 80 at 512; otherwise round(15% of the length)."""
    return {128: 20, 512: 80}.get(seq_len, max(1, round(0.15 * seq_len)))


def num_predictions(eligible: int, masked_lm_prob: float, max_predictions: int) -> int:
    """Google: round(prob * tokens), at least 1, at most max_predictions (counted here over eligible tokens)."""
    if eligible <= 0:
        return 0
    return min(max_predictions, max(1, int(round(eligible * masked_lm_prob))), eligible)


def word_ids_from_pieces(ids: np.ndarray, is_continuation: np.ndarray) -> np.ndarray:
    """Per-position word index: a ``##`` piece shares the index of the piece before it (Google's whole-word rule).

    ``is_continuation`` is the (vocab_size,) table ``WordPieceTokenizer.continuation_table()``."""
    return np.cumsum(~is_continuation[ids], dtype=np.int64)


def _apply(ids: np.ndarray, positions: np.ndarray, rng: np.random.Generator, vocab_size: int,
           mask_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    masked = ids.copy()
    u = rng.random(positions.shape[0])
    masked[positions[u < MASK_PROB]] = mask_id
    rand = positions[u >= MASK_PROB + KEEP_PROB]  # the last 10%: a random token from the whole vocabulary, as Google
    if rand.shape[0]:
        masked[rand] = rng.integers(0, vocab_size, size=rand.shape[0])
    return masked, positions, ids[positions]


def mask_tokens(ids: np.ndarray, rng: np.random.Generator, *, candidates: np.ndarray, max_predictions: int,
                vocab_size: int, mask_id: int, masked_lm_prob: float = 0.15, word_ids: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (masked_ids (same dtype as ids), positions (int64 ascending), original_ids at positions).

    candidates: bool per position (False for [CLS]/[SEP]/[PAD]); word_ids: per-position word index (continuation
    pieces share their word's index) for whole-word masking, None = per-token.

    round(masked_lm_prob * eligible tokens), at least 1, at most ``max_predictions`` positions are chosen uniformly
    without replacement. With ``word_ids`` whole words are chosen in random order and a word that would overshoot
    the count is skipped for a smaller one, as Google's loop does, so the cap is never exceeded and no word is split.
    """
    cand = np.flatnonzero(candidates)
    num = num_predictions(cand.shape[0], masked_lm_prob, max_predictions)
    if num == 0:
        empty = np.zeros(0, dtype=np.int64)
        return ids.copy(), empty, ids[empty]
    if word_ids is None:
        # num smallest of uniform keys = a uniform num-subset, without a full permutation.
        keys = rng.random(cand.shape[0])
        chosen = cand[np.argpartition(keys, num - 1)[:num]] if num < cand.shape[0] else cand
        positions = np.sort(chosen).astype(np.int64, copy=False)
        return _apply(ids, positions, rng, vocab_size, mask_id)

    # Whole words: group candidate positions by word id (candidates of one word are contiguous).
    wid = np.asarray(word_ids)[cand]
    starts = np.flatnonzero(np.r_[True, wid[1:] != wid[:-1]])
    lengths = np.diff(np.r_[starts, cand.shape[0]])
    order = rng.permutation(starts.shape[0])
    shuffled = lengths[order]
    csum = np.cumsum(shuffled)
    take = int(np.searchsorted(csum, num, side="right"))  # the prefix of words that fits
    picked = order[:take].tolist()
    count = int(csum[take - 1]) if take else 0
    if count < num:  # Google skips words that would overshoot and keeps looking for ones that fit
        for j, length in zip(order[take:].tolist(), shuffled[take:].tolist(), strict=True):
            if count + length <= num:
                picked.append(j)
                count += length
                if count == num:
                    break
    chosen_words = np.zeros(starts.shape[0], dtype=bool)
    chosen_words[picked] = True
    sel = np.repeat(chosen_words, lengths)
    positions = cand[sel].astype(np.int64, copy=False)
    return _apply(ids, positions, rng, vocab_size, mask_id)


def choose_pair_positions(len_a: np.ndarray, len_b: np.ndarray, rng: np.random.Generator, *, max_predictions: int,
                          masked_lm_prob: float = 0.15) -> tuple[np.ndarray, np.ndarray]:
    """``mask_tokens``'s per-token choice for a batch of ``[CLS] A [SEP] B [SEP]`` samples at once (shard creation).

    -> (counts (n,), positions (n, max count) int64: each row's chosen positions ascending, padded with -1). Each
    row gets ``num_predictions(len A + len B)`` positions drawn uniformly without replacement from A and B (never
    [CLS]/[SEP]), by a partial Fisher-Yates shuffle run across all rows together."""
    eligible = np.asarray(len_a, dtype=np.int64) + np.asarray(len_b, dtype=np.int64)
    n = eligible.shape[0]
    counts = np.minimum(np.minimum(max_predictions, np.maximum(1, np.rint(eligible * masked_lm_prob))), eligible)
    counts = counts.astype(np.int64)
    k = int(counts.max()) if n else 0
    if k == 0:
        return counts, np.full((n, 0), -1, dtype=np.int64)
    perm = np.tile(np.arange(int(eligible.max()), dtype=np.int32), (n, 1))
    rows = np.arange(n)
    u = rng.random((n, k))
    for j in range(k):
        # row i swaps slot j with a uniform slot in [j, eligible_i) while it still needs positions
        r = np.where(counts > j, j + (u[:, j] * (eligible - j)).astype(np.int64), j)
        pj = perm[:, j].copy()
        perm[:, j] = perm[rows, r]
        perm[rows, r] = pj
    chosen = perm[:, :k].astype(np.int64)
    valid = np.arange(k) < counts[:, None]
    big = np.iinfo(np.int64).max
    chosen = np.sort(np.where(valid, chosen, big), axis=1)
    # candidate c -> position: A is at 1..len_a, the middle [SEP] at len_a + 1, B after it
    positions = chosen + 1 + (chosen >= np.asarray(len_a, dtype=np.int64)[:, None])
    return counts, np.where(valid, positions, -1)


def replacement_kinds(shape: tuple[int, ...], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """BERT's 80/10/10 for chosen positions -> (to_mask, to_random) boolean arrays; the rest stay unchanged."""
    u = rng.random(shape)
    return u < MASK_PROB, u >= MASK_PROB + KEEP_PROB
