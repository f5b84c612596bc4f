"""Weighted mixes of real shard sets (licence texts and standard-library docstrings): the proportions, the global
sequence on 1, 2 and 4 ranks, upsampling, exact resume on the same and another rank count, and the refusals."""

from __future__ import annotations

import itertools
import json
import math
import shutil

import numpy as np
import pytest
import torch

from bert_ds.data.loader import MixChangedError, MixedShardLoader, ShardLoader, Source, build_loader
from bert_ds.data.mix import parse_sources
from bert_ds.data.reader import ShardReader

G = 16


def _mix(shards: dict, weights: dict[str, float]) -> list[Source]:
    return [Source(str(shards[name]), w) for name, w in weights.items()]


def _loader(sources, world_size: int = 1, rank: int = 0, micro: int = 4, **kw):
    kw.setdefault("num_workers", 0)
    return build_loader(sources, global_batch_size=G, micro_batch_size=micro, rank=rank, world_size=world_size,
                        seed=7, verify="size", **kw)


def _global_batches(sources, world_size: int, n: int, **kw) -> list[dict[str, torch.Tensor]]:
    """The first ``n`` global batches as every rank together sees them: micro slice k = a * W + r, in k order."""
    loaders = [_loader(sources, world_size, r, micro=4, **kw) for r in range(world_size)]
    iters = [iter(x) for x in loaders]
    accumulation = loaders[0].gradient_accumulation_steps
    out = []
    for _ in range(n):
        slices = [None] * (accumulation * world_size)
        for a in range(accumulation):
            for r, it in enumerate(iters):
                slices[a * world_size + r] = next(it)
        out.append({k: torch.cat([s[k] for s in slices]) for k in slices[0]})
    return out


def test_one_unweighted_source_is_the_single_set_loader(mix_shards_128):
    path = mix_shards_128["stdlib"]
    plain, listed = _loader(path), _loader([Source(str(path))])
    assert type(plain) is type(listed) is ShardLoader
    for a, b in zip(itertools.islice(plain, 6), itertools.islice(listed, 6), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert plain.state_dict() == listed.state_dict()


def test_realised_proportions_are_within_binomial_bounds(mix_shards_128):
    weights = {"licenses": 1.0, "stdlib": 3.0}
    loader = _loader(_mix(mix_shards_128, weights))
    assert isinstance(loader, MixedShardLoader)
    batches = 400  # 6,400 samples: licences run out and start their next epochs on the way
    refs = [loader.sample_refs(m)[0] for m in range(batches * loader.gradient_accumulation_steps)]
    counts = np.bincount(np.concatenate(refs), minlength=2)
    n = batches * G
    for s, w in enumerate(weights.values()):
        p = w / sum(weights.values())
        bound = 4 * math.sqrt(n * p * (1 - p))  # 4 binomial standard deviations
        assert abs(counts[s] - n * p) <= bound, (s, counts[s], n * p, bound)
    assert np.array_equal(loader.source_samples(batches), counts)  # what the start-of-phase print counts
    assert counts[0] > 1124  # the small source was upsampled past one epoch


def test_a_source_that_runs_out_starts_its_next_epoch_with_every_sample_once(mix_shards_128):
    loader = _loader(_mix(mix_shards_128, {"licenses": 3.0, "stdlib": 1.0}))
    size = ShardReader(mix_shards_128["licenses"]).num_samples
    seen: dict[int, list[int]] = {}
    m = 0
    while len(seen.get(1, [])) < size // 2:
        sources, epochs, ids = loader.sample_refs(m)
        for e, i in zip(epochs[sources == 0], ids[sources == 0], strict=True):
            seen.setdefault(int(e), []).append(int(i))
        m += 1
    assert sorted(seen[0]) == list(range(size))  # epoch 0: each licence sample exactly once, no tail dropped
    assert seen[1] != seen[0][:len(seen[1])]  # epoch 1 is reshuffled


def test_batches_carry_the_samples_of_their_source(mix_shards_128):
    sources = _mix(mix_shards_128, {"licenses": 1.0, "stdlib": 1.0})
    loader = _loader(sources, micro=8)
    readers = [ShardReader(s.path) for s in sources]
    for m, batch in enumerate(itertools.islice(loader, 6)):
        src, _, ids = loader.sample_refs(m)
        for row in range(len(ids)):
            sample = readers[src[row]].get(int(ids[row]))
            assert torch.equal(batch["input_ids"][row, :sample.length], torch.from_numpy(
                sample.input_ids.astype(np.int64)))


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_global_sequence_is_the_same_on_1_2_and_4_ranks(mix_shards_128, world_size):
    sources = _mix(mix_shards_128, {"licenses": 2.0, "stdlib": 1.0})
    one = _global_batches(sources, 1, 12)
    many = _global_batches(sources, world_size, 12)
    for a, b in zip(one, many, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def _drain(loader, n: int) -> None:
    """Deliver ``n`` micro batches (islice stops without pulling one more)."""
    for _ in itertools.islice(loader, n):
        pass


def _continue(loader, state: dict, n: int) -> list[dict]:
    loader.load_state_dict(json.loads(json.dumps(state)))
    return list(itertools.islice(loader, n))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_resume_is_exact_on_the_same_rank_count(mix_shards_128, num_workers):
    sources = _mix(mix_shards_128, {"licenses": 3.0, "stdlib": 1.0})
    reference = list(itertools.islice(_loader(sources, 2, 1, num_workers=num_workers), 212))
    first = _loader(sources, 2, 1, num_workers=num_workers)
    _drain(first, 199)  # mid global batch (199 % 2), in the licences' second epoch
    state = first.state_dict()
    licences = ShardReader(mix_shards_128["licenses"]).num_samples
    assert state["micro_steps_into_global_batch"] == 1 and state["source_samples"][0] > licences
    resumed = _continue(_loader(sources, 2, 1, num_workers=num_workers), state, 13)
    for a, b in zip(reference[199:], resumed, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_on_another_rank_count_continues_the_same_global_sequence(mix_shards_128):
    sources = _mix(mix_shards_128, {"licenses": 3.0, "stdlib": 1.0})
    reference = _global_batches(sources, 1, 56)
    two = [_loader(sources, 2, r) for r in range(2)]
    for loader in two:
        _drain(loader, 50 * loader.gradient_accumulation_steps)
    state = two[0].state_dict()
    assert state["consumed_global_batches"] == 50
    for r in range(4):  # 4 ranks x micro batch 4: rank r's one micro batch is rows [4r, 4r + 4) of each batch
        loader = _loader(sources, 4, r, micro=4)
        loader.load_state_dict(json.loads(json.dumps(state)))
        it = iter(loader)
        for g in range(6):
            assert torch.equal(next(it)["input_ids"], reference[50 + g]["input_ids"][r * 4:(r + 1) * 4])


def test_a_changed_mix_is_refused_by_name_unless_accepted(mix_shards_128):
    old = _loader(_mix(mix_shards_128, {"licenses": 1.0, "stdlib": 3.0}))
    _drain(old, 40)
    state = old.state_dict()
    new_sources = _mix(mix_shards_128, {"licenses": 1.0, "stdlib": 1.0})
    with pytest.raises(MixChangedError, match=r"source '.*stdlib128' weight 3.0 -> 1"):
        _loader(new_sources).load_state_dict(state)
    accepted = _loader(new_sources)
    accepted.load_state_dict(state, continue_with_new_mix=True)
    assert "stdlib128' weight 3.0 -> 1" in accepted.mix_change
    # each source goes on where it was: its next sample is the one after the last the old mix drew
    src, epochs, ids = accepted.sample_refs(10 * accepted.gradient_accumulation_steps)
    old_next = _next_of_source(old, 0, state["source_samples"][0])
    assert (int(epochs[src == 0][0]), int(ids[src == 0][0])) == old_next


def _next_of_source(loader, s: int, k: int) -> tuple[int, int]:
    order = loader._dataset.orders[s]
    epoch, pos = divmod(k, order.num_samples)
    return epoch, int(order.ids(epoch, pos, pos + 1)[0])


def test_removed_and_reordered_sources_are_named(mix_shards_128, shards_128):
    state = _loader(_mix(mix_shards_128, {"licenses": 1.0, "stdlib": 1.0})).state_dict()
    with pytest.raises(MixChangedError, match=r"source '.*licenses128' \(shard set [0-9a-f]{12}\.\.\.\) removed"):
        _loader([Source(str(mix_shards_128["stdlib"]), 1.0), Source(str(shards_128), 1.0)]).load_state_dict(state)
    with pytest.raises(MixChangedError, match="another order"):
        _loader(_mix(mix_shards_128, {"stdlib": 1.0, "licenses": 1.0})).load_state_dict(state)


def test_a_mix_and_a_single_set_do_not_resume_each_other(mix_shards_128):
    mixed = _loader(_mix(mix_shards_128, {"licenses": 1.0, "stdlib": 1.0}))
    single = _loader(mix_shards_128["stdlib"])
    with pytest.raises(ValueError, match="field 'mix' lists"):
        _loader(mix_shards_128["stdlib"]).load_state_dict(mixed.state_dict())
    with pytest.raises(ValueError, match="field 'mix' is missing"):
        _loader(_mix(mix_shards_128, {"licenses": 1.0, "stdlib": 1.0})).load_state_dict(single.state_dict(),
                                                                                        continue_with_new_mix=True)


def test_a_forged_source_count_is_refused(mix_shards_128):
    loader = _loader(_mix(mix_shards_128, {"licenses": 1.0, "stdlib": 1.0}))
    _drain(loader, 8)
    state = loader.state_dict()
    state["source_samples"][0] += 1
    with pytest.raises(ValueError, match="field 'source_samples'"):
        _loader(_mix(mix_shards_128, {"licenses": 1.0, "stdlib": 1.0})).load_state_dict(state)


def test_a_source_with_another_seq_len_is_named(mix_shards_128, tmp_path):
    odd = tmp_path / "odd128"
    shutil.copytree(mix_shards_128["licenses"], odd)
    index = json.loads((odd / "index.json").read_text())
    index["seq_len"] = 256
    (odd / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"mix source 'odd128': .* field 'seq_len' is 256 but source 'stdlib128'"):
        _loader([Source(str(mix_shards_128["stdlib"]), 1.0), Source(str(odd), 1.0)])
    with pytest.raises(ValueError, match=r"mix source 'odd128': .*odd128/index.json: field 'seq_len' is 256"):
        _loader([Source(str(mix_shards_128["stdlib"]), 1.0), Source(str(odd), 1.0)], expected_seq_len=128)


def test_the_same_shard_set_twice_is_refused(mix_shards_128, tmp_path):
    twin = tmp_path / "twin"
    shutil.copytree(mix_shards_128["licenses"], twin)
    with pytest.raises(ValueError, match="'licenses128' and 'twin' hold the same shard set"):
        _loader([Source(str(mix_shards_128["licenses"]), 1.0), Source(str(twin), 1.0)])


@pytest.mark.parametrize("spec, message", [
    ("a:x", "weight 'x' is not a positive number"),
    ("a:0", "weight '0' is not a positive number"),
    ("a:-1", "weight '-1' is not a positive number"),
    ("a:inf", "weight 'inf' is not a positive number"),
    ("a:1,b", "'b' has no weight"),
    ("a:1,,b:1", "an empty element"),
    ("x/a:1,y/a:1", "name 'a' is listed twice"),
])
def test_bad_data_specs_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_sources(spec, "--data")


def test_parse_sources_reads_weights_and_eval_lists():
    assert parse_sources("wiki128/:3,books128/:1", "--data") == [Source("wiki128/", 3.0), Source("books128/", 1.0)]
    assert parse_sources("plain", "--data") == [Source("plain")]
    assert [s.name for s in parse_sources("a/wiki,b/books", "--eval-data", weighted=False)] == ["wiki", "books"]
    with pytest.raises(ValueError, match="eval data takes no weight"):
        parse_sources("a:1", "--eval-data", weighted=False)


def test_the_start_of_phase_lines_count_what_the_loader_draws(mix_shards_128):
    loader = _loader(_mix(mix_shards_128, {"licenses": 3.0, "stdlib": 1.0}))
    lines = loader.describe(100)
    drawn = np.bincount(np.concatenate([loader.sample_refs(m)[0] for m in range(100 * 4)]), minlength=2)
    size = ShardReader(mix_shards_128["licenses"]).num_samples
    assert lines[0] == "data mix over 100 global batches (1600 samples):"
    assert lines[1].startswith(f"  licenses128: weight 3 (75.0%), {drawn[0]} samples = {drawn[0] / size:.2f} epochs "
                               f"of {size}, {drawn[0] * 128} tokens (padded to seq_len 128)")


def test_a_sample_longer_than_seq_len_is_named_in_its_source(tmp_path):
    """The mixed collator reads rows straight from each source's reader: an over-long record is still refused, naming
    its source's shard and member (two synthetic sources whose index.json both claim seq_len 16)."""
    from bert_ds.data.reader import ShardError
    from bert_ds.data.synthetic import write_synthetic_shards

    sources = []
    for i in range(2):
        path = tmp_path / f"source{i}"
        write_synthetic_shards(path, num_samples=40, samples_per_shard=20, seq_len=64, max_predictions=10, seed=i,
                               cls_id=1, sep_id=2, mask_id=4)
        index = json.loads((path / "index.json").read_text())
        index["seq_len"] = 16
        (path / "index.json").write_text(json.dumps(index))
        sources.append(Source(str(path), 1.0))
    loader = build_loader(sources, global_batch_size=8, micro_batch_size=8, num_workers=0, verify="size")
    with pytest.raises(ShardError, match=r"^source[01]/shard-\d{6}\.tar:\S+: length \d+ exceeds index\.json "
                                         r"seq_len=16$"):
        next(iter(loader))
