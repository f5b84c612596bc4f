"""The rule that draws each global batch's sources (``bert_ds.data.mix``, rule 2): a pure function of (seed, batch),
the proportions over many Philox counter blocks, positions independent of the source, a resumed base across block
boundaries, the rule pinned by a golden, and a loader state of the old rule refused by name."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bert_ds.data.loader import MixChangedError, Source, build_loader
from bert_ds.data.mix import MIX_RULE, MixSchedule

WEIGHTS = (5.0, 3.0, 2.0)
P = np.asarray(WEIGHTS) / sum(WEIGHTS)


def _within_binomial(counts: np.ndarray, n: int, p: np.ndarray) -> None:
    bound = 4 * np.sqrt(n * p * (1 - p))  # 4 binomial standard deviations
    assert np.all(np.abs(counts - n * p) <= bound), (counts, n * p, bound)


def test_proportions_hold_over_many_counter_blocks():
    """64 blocks of 256 global batches: streams at neighbouring counters that overlapped (the counter in Philox's
    bottom word) drew the same values shifted and missed n * p by 7 to 11 standard deviations here."""
    for seed in (7, 8):
        counts = MixSchedule(WEIGHTS, 16, seed).counts_of(0, 256 * 64)
        assert np.all(counts.sum(axis=1) == 16)
        _within_binomial(counts.sum(axis=0), 256 * 64 * 16, P)


def test_each_position_of_a_batch_draws_the_weights():
    """The order is a uniform permutation of the counts: source 0 (half the weight) is at every position about half
    the time (laid out source by source without the permutation, position 0 would always be source 0)."""
    sources = MixSchedule(WEIGHTS, 16, 7).sources_of(0, 2000)
    for position in range(16):
        _within_binomial(np.bincount(sources[:, position], minlength=3), 2000, P)


def test_a_batch_is_the_same_alone_in_a_block_or_from_another_start():
    schedule = MixSchedule(WEIGHTS, 32, 7)
    block = schedule.sources_of(200, 100)  # crosses the counts' block boundary at 256
    for i in (0, 55, 56, 57, 99):
        assert np.array_equal(block[i], MixSchedule(WEIGHTS, 32, 7).sources_of(200 + i, 1)[0])
        assert np.array_equal(np.bincount(block[i], minlength=3), schedule.counts_of(200 + i, 1)[0])


def test_counts_before_from_a_resumed_base_match_the_full_schedule():
    full = MixSchedule(WEIGHTS, 32, 7)
    drawn = np.cumsum(np.concatenate([np.zeros((1, 3), np.int64), full.counts_of(0, 800)]), axis=0)
    resumed = MixSchedule(WEIGHTS, 32, 7)
    resumed.set_base(300, drawn[300])
    for batch in (799, 300, 301, 511, 512, 513, 768, 450):  # backwards too: blocks recomputed on demand
        assert np.array_equal(resumed.counts_before(batch), drawn[batch]), batch
        assert np.array_equal(full.counts_before(batch), drawn[batch]), batch
    with pytest.raises(IndexError, match="precedes the schedule's base 300"):
        resumed.counts_before(299)


def test_the_rule_is_pinned():
    """The first batches of one schedule, as rule 2 draws them: a change to the rule (or to numpy's multinomial
    over a Philox stream) fails here; bump ``MIX_RULE`` with it, so saved runs are refused rather than reordered."""
    schedule = MixSchedule(WEIGHTS, 16, 7)
    assert MIX_RULE == 2
    assert schedule.counts_of(0, 3).tolist() == [[11, 4, 1], [11, 2, 3], [7, 6, 3]]
    assert schedule.counts_of(256, 1).tolist() == [[13, 0, 3]] and schedule.counts_of(1000, 1).tolist() == [[5, 6, 5]]
    assert schedule.sources_of(0, 1)[0].tolist() == [0, 2, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0]


def _loader(mix_shards_128):
    sources = [Source(str(mix_shards_128["licenses"]), 1.0), Source(str(mix_shards_128["stdlib"]), 3.0)]
    return build_loader(sources, global_batch_size=16, micro_batch_size=4, seed=7, num_workers=0, verify="size")


def test_a_state_of_the_old_rule_is_refused_by_name_unless_a_new_mix_is_asked(mix_shards_128):
    """A state saved by rule 1 has no ``mix_rule`` field (the fields it had are those of today's state)."""
    old = _loader(mix_shards_128)
    for _ in itertools.islice(old, 12):  # 3 global batches
        pass
    state = old.state_dict()
    assert state["mix_rule"] == MIX_RULE
    del state["mix_rule"]
    with pytest.raises(MixChangedError, match=r"field 'mix_rule' is missing \(rule 1, an older bert_ds\) but this "
                                              r"bert_ds draws the mix by rule 2"):
        _loader(mix_shards_128).load_state_dict(state)
    accepted = _loader(mix_shards_128)
    accepted.load_state_dict(state, continue_with_new_mix=True)
    assert "field 'mix_rule' is missing" in accepted.mix_change
    # each source goes on where the old rule left it
    assert np.array_equal(accepted.source_samples(3), state["source_samples"])
    mid = {**state, "micro_steps_into_global_batch": 1}
    with pytest.raises(ValueError, match="a new mix can only start on a global-batch boundary"):
        _loader(mix_shards_128).load_state_dict(mid, continue_with_new_mix=True)
