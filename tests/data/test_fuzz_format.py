"""Property-based fuzzing of what bert_ds reads from disk: the ``.pair`` record decoder, the tar scan plus record-header
check of a shard, and ``index.json`` parsing. Random and mutated inputs must either parse or raise the module's own
one-line error (``ShardError`` / ``ValueError`` naming the file), never IndexError, struct.error, KeyError,
UnicodeDecodeError, MemoryError or AttributeError. Derandomized with a bounded example count, so CI is stable."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bert_ds.data.format import Sample, ShardError, decode_sample, encode_sample
from bert_ds.data.index import INDEX_NAME, MIN_MEMBER_BYTES, ShardIndex, ShardWriter, shard_name
from bert_ds.data.reader import ShardReader, scan_tar

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
U16 = np.dtype("<u2")


def _record(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 40))
    positions = np.sort(rng.choice(np.arange(1, n - 1), size=int(rng.integers(0, 4)), replace=False))
    return encode_sample(Sample(rng.integers(0, 1000, n), int(rng.integers(1, n)), positions,
                                rng.integers(0, 1000, len(positions)), int(rng.integers(0, 2))), U16)


def _mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
    out = bytearray(data)
    for pos, value in edits:
        if out:
            out[pos % len(out)] = value
    return bytes(out[:cut] if cut is not None else out)


def _check_sample(sample: Sample, size: int) -> None:
    assert 0 < sample.segment_a_length < sample.length
    assert 8 + 2 * sample.length + 4 * len(sample.masked_positions) == size
    assert sample.nsp_label in (0, 1)


@FUZZ
@given(st.binary(max_size=300))
def test_decode_random_bytes(data):
    try:
        sample = decode_sample(data, U16, where="fuzz")
    except ShardError as exc:
        assert str(exc).startswith("fuzz: ") and "\n" not in str(exc)
        return
    _check_sample(sample, len(data))


@FUZZ
@given(st.integers(0, 2**32 - 1), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
       st.one_of(st.none(), st.integers(0, 200)))
def test_decode_mutated_records(seed, edits, cut):
    data = _mutate(_record(seed), edits, cut)
    try:
        _check_sample(decode_sample(data, U16, where="fuzz"), len(data))
    except ShardError as exc:
        assert str(exc).startswith("fuzz: ")


def _write_shard(directory: Path, seeds: list[int]) -> ShardIndex:
    with ShardWriter(directory / shard_name(0)) as writer:
        for i, seed in enumerate(seeds):
            writer.write(f"{i:012d}.pair", _record(seed))
        info = writer.close()
    index = ShardIndex(seq_len=64, vocab_size=1000, vocab_sha256="fuzz", id_dtype="<u2", lowercase=True,
                       masking={"max_predictions": 4}, pairing={}, seed=0, shards=[info], total_samples=len(seeds))
    index.write(directory)
    return index


@FUZZ
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=5),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
       st.one_of(st.none(), st.integers(0, 6000)))
def test_mutated_shard_scan_and_headers(seeds, edits, cut):
    """A mutated shard (index.json's size and count kept in step, so the tar scan and the record-header check are
    what must catch it) reads cleanly or raises ShardError."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        index = _write_shard(directory, seeds)
        path = directory / shard_name(0)
        data = _mutate(path.read_bytes(), edits, cut)
        path.write_bytes(data)
        try:
            members = scan_tar(data, where="fuzz")
        except ShardError:
            members = None
        index.shards[0].bytes = len(data)
        index.shards[0].samples = len(members) if members is not None else index.shards[0].samples
        index.write(directory)
        if index.shards[0].samples * MIN_MEMBER_BYTES > len(data):  # a cut shard too small for the samples it claims
            with pytest.raises(ValueError, match=r"'shards\[shard-000000.tar\].samples' is \d+, need at most"):
                ShardReader(directory, verify="headers")
            return
        reader = ShardReader(directory, verify="headers")
        try:
            for i in range(index.shards[0].samples):
                _check_sample(reader.sample(0, i), int(reader.open(0).members.sizes[i]))
        except ShardError as exc:
            assert "\n" not in str(exc)
        finally:
            reader.close()


def _valid_index() -> dict:
    return {"seq_len": 128, "vocab_size": 30522, "vocab_sha256": "ab" * 32, "id_dtype": "<u2", "lowercase": True,
            "masking": {"max_predictions": 20}, "pairing": {}, "seed": 1,
            "shards": [{"name": "shard-000000.tar", "samples": 3, "bytes": 10240, "sha256": "cd" * 32}],
            "total_samples": 3, "format": "bert_ds.pairs", "format_version": 1, "extra": {}}


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=8)


def _load(text: bytes) -> ShardIndex | None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / INDEX_NAME).write_bytes(text)
        try:
            return ShardIndex.load(tmp)
        except ValueError as exc:
            assert INDEX_NAME in str(exc)
            return None


@FUZZ
@given(st.sampled_from(sorted(_valid_index())), JSON_VALUES)
def test_index_field_replaced(name, value):
    data = _valid_index()
    data[name] = value
    index = _load(json.dumps(data).encode())
    if index is not None:  # accepted: then it is well-typed
        assert isinstance(index.seq_len, int) and index.seq_len > 0
        assert all(isinstance(s.samples, int) and "/" not in s.name for s in index.shards)


@FUZZ
@given(st.sampled_from(["name", "samples", "bytes", "sha256", "extra_key"]), JSON_VALUES)
def test_index_shard_entry_replaced(name, value):
    data = _valid_index()
    data["shards"][0][name] = value
    index = _load(json.dumps(data).encode())
    if index is not None:
        assert index.shards[0].name == "shard-000000.tar" or index.shards[0].name.endswith(".tar")


@FUZZ
@given(st.binary(max_size=200) | st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3))
def test_index_random_or_mutated_bytes(data):
    text = data if isinstance(data, bytes) else _mutate(json.dumps(_valid_index()).encode(), data, None)
    _load(text)


def test_index_refuses_path_in_shard_name():
    data = _valid_index()
    data["shards"][0]["name"] = "../../etc/passwd.tar"
    assert _load(json.dumps(data).encode()) is None
    data["shards"][0]["name"] = "shard-000000.tar"
    assert _load(json.dumps(data).encode()) is not None
