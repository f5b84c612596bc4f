"""Masked-LM masking (BERT paper §3.1, Google's ``create_masked_lm_predictions``), vectorised with numpy.

Used both when shards are created (static masking, one mask per duplicate) and by the loader (dynamic masking). Every
path chooses positions its own way (per sample, batched, counter-based) and then hands them to
:func:`replace_chosen`, the one place the 80/10/10 replacement rule is applied.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MASK_PROB", "RANDOM_PROB", "KEEP_PROB", "default_max_predictions", "num_predictions",
           "prediction_counts", "word_ids_from_pieces", "replace_chosen", "mask_tokens", "choose_pair_positions",
           "pair_positions", "mask_packed_pairs", "counter_hash", "counter_uniforms", "mask_pairs"]


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


def prediction_counts(eligible: np.ndarray, masked_lm_prob: float, max_predictions: int) -> np.ndarray:
    """``num_predictions`` for many samples at once -> int64 counts (np.rint rounds half to even, as ``round``)."""
    eligible = np.asarray(eligible, dtype=np.int64)
    counts = np.minimum(np.minimum(max_predictions, np.maximum(1, np.rint(eligible * masked_lm_prob))), eligible)
    return counts.astype(np.int64)


def word_ids_from_pieces(ids: np.ndarray, is_continuation: np.ndarray) -> np.ndarray:
    """Per-position word index: a ``##`` piece shares the index of the piece before it (Google's whole-word rule).

    ``is_continuation`` is the (vocab_size,) table ``WordPieceTokenizer.continuation_table()``."""
    return np.cumsum(~is_continuation[ids], dtype=np.int64)


def replace_chosen(ids: np.ndarray, at: np.ndarray, u: np.ndarray, *, mask_id: int, vocab_size: int,
                   random_tokens: np.random.Generator | np.ndarray) -> None:
    """BERT paper §3.1 / Appendix A.1 on the chosen positions ``ids[at]``, in place: where ``u < 0.8`` [MASK], where
    ``u >= 0.9`` a token drawn uniformly from the whole vocabulary (specials included, as Google's code), else the
    token stays. The one implementation of the rule: static and dynamic masking all call it.

    ids: 1-D (a batch passes its flat view); at: int positions into it; u: one uniform in [0, 1) per position.
    random_tokens: a Generator draws ``integers(0, vocab_size)`` for just the positions that need one, in order, after
    ``u`` was drawn (the sequential streams of shard creation); an array of uniforms, one per position, gives
    ``floor(u * vocab_size)`` (counter-based masking, where every slot has its own uniforms; biased by at most
    vocab_size / 2**53)."""
    ids[at[u < MASK_PROB]] = mask_id
    to_random = u >= MASK_PROB + KEEP_PROB
    if isinstance(random_tokens, np.random.Generator):
        count = int(np.count_nonzero(to_random))
        if count:
            ids[at[to_random]] = random_tokens.integers(0, vocab_size, size=count)
    else:
        ids[at[to_random]] = (random_tokens[to_random] * vocab_size).astype(np.int64)


def _apply(ids: np.ndarray, positions: np.ndarray, rng: np.random.Generator, vocab_size: int,
           mask_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    masked = ids.copy()
    replace_chosen(masked, positions, rng.random(positions.shape[0]), mask_id=mask_id, vocab_size=vocab_size,
                   random_tokens=rng)
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
    [CLS]/[SEP]); the uniforms are one ``rng.random((n, max count))`` draw, see :func:`pair_positions`."""
    counts = prediction_counts(np.asarray(len_a, dtype=np.int64) + np.asarray(len_b, dtype=np.int64),
                               masked_lm_prob, max_predictions)
    n = counts.shape[0]
    k = int(counts.max()) if n else 0
    if k == 0:
        return counts, np.full((n, 0), -1, dtype=np.int64)
    return counts, pair_positions(len_a, len_b, counts, rng.random((n, k)))


def pair_positions(len_a: np.ndarray, len_b: np.ndarray, counts: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Choose ``counts[i]`` of the ``len_a[i] + len_b[i]`` A and B positions of ``[CLS] A [SEP] B [SEP]`` row ``i``,
    uniformly without replacement, by a partial Fisher-Yates shuffle run across all rows together.

    ``u`` (n, k), counts.max() <= k <= max(len_a + len_b): uniforms in [0, 1); row i reads only ``u[i, :counts[i]]``,
    so a row's choice never depends on the other rows. -> (n, k) int64: each row's positions ascending, -1 padded."""
    len_a = np.asarray(len_a, dtype=np.int64)
    eligible = len_a + np.asarray(len_b, dtype=np.int64)
    n, k = u.shape
    width = int(eligible.max()) if n else 0
    steps = int(counts.max()) if n else 0
    # Step j: row i swaps slot j with a uniform slot r in [j, eligible_i) while it still needs positions (else r = j).
    j = np.arange(steps)
    r = np.where(counts[:, None] > j, j + (u[:, :steps] * (eligible[:, None] - j)).astype(np.int64), j)
    # As flat indices into perm: one gather + scatter per step swaps the pair in every row (rows never share a slot;
    # r = j swaps a slot with itself).
    base = np.arange(n, dtype=np.int64)[:, None] * width
    swap_to = np.ascontiguousarray(np.concatenate([base + j, base + r], axis=0).T)  # (steps, 2n)
    swap_from = np.ascontiguousarray(np.concatenate([base + r, base + j], axis=0).T)
    perm = np.tile(np.arange(width, dtype=np.int32), n)
    for step in range(steps):
        perm[swap_to[step]] = perm[swap_from[step]]
    chosen = perm.reshape(n, width)[:, :k].astype(np.int64)
    valid = np.arange(k) < counts[:, None]
    big = np.iinfo(np.int64).max
    chosen = np.sort(np.where(valid, chosen, big), axis=1)
    # candidate c -> position: A is at 1..len_a, the middle [SEP] at len_a + 1, B after it
    positions = chosen + 1 + (chosen >= len_a[:, None])
    return np.where(valid, positions, -1)


def mask_packed_pairs(flat: np.ndarray, starts: np.ndarray, len_a: np.ndarray, len_b: np.ndarray,
                      rng: np.random.Generator, *, max_predictions: int, vocab_size: int, mask_id: int,
                      masked_lm_prob: float = 0.15) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Static per-token masking of ``[CLS] A [SEP] B [SEP]`` rows packed end to end in ``flat`` (row i starts at
    ``starts[i]``; shard creation): positions by :func:`choose_pair_positions`, then :func:`replace_chosen`.

    -> (masked flat, counts (n,), positions (counts.sum(),) int64 within their row, ascending per row, original ids
    at them). The draws, in order: the positions' uniforms, one uniform per (row, slot) including the padded slots,
    then the random tokens; the shard bytes depend on that order."""
    counts, pos = choose_pair_positions(len_a, len_b, rng, max_predictions=max_predictions,
                                        masked_lm_prob=masked_lm_prob)
    valid = pos >= 0
    at = (pos + np.asarray(starts, dtype=np.int64)[:, None])[valid]
    u = rng.random(pos.shape)[valid]
    masked = flat.copy()
    replace_chosen(masked, at, u, mask_id=mask_id, vocab_size=vocab_size, random_tokens=rng)
    return masked, counts, pos[valid], flat[at]


# ---- counter-based randomness (dynamic masking in the loader) -------------------------------------------------------
# SplitMix64 (Steele, Lea & Flood 2014; Vigna's splitmix64.c): output c of the stream keyed by k is
# mix(k + (c + 1) * GOLDEN). Every value is a pure function of (key, counter), so a sample's mask can be computed
# for any batch of samples at once and never depends on which batch, rank or worker the sample lands in.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_STREAMS = 3  # per prediction slot j: counter 3j chooses, 3j + 1 picks [MASK]/random/keep, 3j + 2 the random token


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def counter_hash(*words: int | np.ndarray) -> np.ndarray:
    """A 64-bit key from integers (scalars or arrays, broadcast; taken modulo 2**64): h = mix(h ^ w + GOLDEN) per word,
    starting from 0. ``counter_hash(seed, epoch, sample_ids)`` is one key per sample."""
    h = np.zeros((), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for w in words:
            w = np.uint64(w % 2**64) if isinstance(w, int) else np.asarray(w).astype(np.uint64)
            h = _mix((h ^ w) + _GOLDEN)
    return h


def counter_uniforms(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """(n,) uint64 keys x (m,) counters -> (n, m) float64 uniforms in [0, 1) (53 bits), SplitMix64 output
    ``counters`` of each key's stream."""
    with np.errstate(over="ignore"):
        z = _mix(keys[:, None] + (np.asarray(counters, dtype=np.uint64)[None, :] + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def mask_pairs(ids: np.ndarray, segment_a_lengths: np.ndarray, lengths: np.ndarray, keys: np.ndarray, *,
               max_predictions: int, vocab_size: int, mask_id: int, masked_lm_prob: float = 0.15
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-token masking of a batch of ``[CLS] A [SEP] B [SEP]`` rows, each row's randomness from its own key.

    ids (n, S): originals, row i valid up to ``lengths[i]``; segment_a_lengths = len(A) + 2. Row i gets exactly the
    distribution of ``mask_tokens`` (``num_predictions`` positions uniformly without replacement from A and B, then
    80/10/10) with its uniforms taken from :func:`counter_uniforms` of ``keys[i]`` at counters 3j, 3j + 1, 3j + 2
    for prediction slot j, so its mask is the same whatever rows it is batched with.
    -> (masked ids (n, S) same dtype, positions (n, k) int64 ascending, -1 padded, originals (n, k), 0 padded)."""
    len_a = np.asarray(segment_a_lengths, dtype=np.int64) - 2
    len_b = np.asarray(lengths, dtype=np.int64) - len_a - 3
    counts = prediction_counts(len_a + len_b, masked_lm_prob, max_predictions)
    n = counts.shape[0]
    k = int(counts.max()) if n else 0
    u = counter_uniforms(keys, np.arange(_STREAMS * k)).reshape(n, k, _STREAMS)
    positions = pair_positions(len_a, len_b, counts, np.ascontiguousarray(u[:, :, 0]))
    valid = positions >= 0
    rows = np.broadcast_to(np.arange(n)[:, None], positions.shape)
    at = np.where(valid, positions, 0)
    original = np.where(valid, ids[rows, at], 0)
    masked = np.array(ids, order="C")  # a copy whose flat view replace_chosen writes through
    flat_at = (rows * ids.shape[1] + at)[valid]
    replace_chosen(masked.reshape(-1), flat_at, u[:, :, 1][valid], mask_id=mask_id, vocab_size=vocab_size,
                   random_tokens=u[:, :, 2][valid])
    return masked, positions, original
