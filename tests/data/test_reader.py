"""ShardReader: tar scan, random access, and the verification errors (real tar files)."""

from __future__ import annotations

import json
import pickle
import tarfile

import numpy as np
import pytest

from bert_ds.data.format import Sample, encode_sample, id_dtype_for_vocab
from bert_ds.data.index import ShardIndex, ShardWriter, shard_name
from bert_ds.data.reader import ShardError, ShardReader, scan_tar
from bert_ds.data.synthetic import ID_BASE, ID_RADIX, write_synthetic_shards

# [CLS], [SEP], [MASK] in bert_ds's special-token order (tokenizer.SPECIAL_TOKENS): the synthetic shards' specials.
SPECIAL_IDS = {"cls_id": 2, "sep_id": 3, "mask_id": 4}


@pytest.fixture()
def shard_dir(tmp_path):
    write_synthetic_shards(tmp_path / "shards", num_samples=250, samples_per_shard=100, seq_len=64,
                           max_predictions=10, **SPECIAL_IDS)
    return tmp_path / "shards"


def _gid(sample: Sample) -> int:
    ids = sample.original_ids().astype(np.int64)
    return int((ids[1] - ID_BASE) * ID_RADIX + ids[2] - ID_BASE)


def test_scan_matches_tarfile(shard_dir):
    path = shard_dir / shard_name(0)
    members = scan_tar(path.read_bytes(), where=path.name)
    with tarfile.open(path) as tar:
        infos = tar.getmembers()
        assert members.names == [m.name for m in infos]
        assert members.offsets.tolist() == [m.offset_data for m in infos]
        assert members.sizes.tolist() == [m.size for m in infos]


def test_random_access_by_global_id(shard_dir):
    reader = ShardReader(shard_dir, verify="sha256")
    assert len(reader) == 250 and reader.num_shards == 3
    for gid in [0, 99, 100, 199, 200, 249, 137]:
        assert _gid(reader.get(gid)) == gid
    shards, indices = reader.locate(np.array([0, 100, 249]))
    assert shards.tolist() == [0, 1, 2] and indices.tolist() == [0, 0, 49]
    with pytest.raises(IndexError):
        reader.locate(np.array([250]))
    with tarfile.open(shard_dir / shard_name(1)) as tar:
        member = tar.getmembers()[7]
        assert reader.raw(1, 7) == tar.extractfile(member).read()


def test_pickle_drops_open_maps(shard_dir):
    reader = ShardReader(shard_dir)
    reader.get(5)
    clone = pickle.loads(pickle.dumps(reader))
    assert _gid(clone.get(5)) == 5


def test_a_shard_its_cache_evicted_is_let_go_and_fetched_again(shard_dir, tmp_path):
    """Read through a cache (``fetch``): a mapped shard whose file was removed (evicted under --cache-limit) is
    closed when another shard is opened, so its disk space is freed, and fetched again when it is read next. A
    local set (no ``fetch``) keeps reading what it mapped."""
    spare = tmp_path / "spare"
    spare.mkdir()
    fetched = []

    def fetch(shard: int) -> None:
        fetched.append(shard)
        path = shard_dir / shard_name(shard)
        if not path.exists():
            path.write_bytes((spare / path.name).read_bytes())

    def evict(shard: int) -> None:
        path = shard_dir / shard_name(shard)
        (spare / path.name).write_bytes(path.read_bytes())
        path.unlink()

    reader = ShardReader(shard_dir, fetch=fetch)
    assert _gid(reader.get(5)) == 5 and fetched == [0]
    evict(0)
    assert _gid(reader.get(105)) == 105 and fetched == [0, 1] and list(reader._open) == [1]  # shard 0 let go
    assert _gid(reader.get(6)) == 6 and fetched == [0, 1, 0]
    evict(1)
    assert _gid(reader.get(106)) == 106 and fetched == [0, 1, 0, 1]  # a mapped shard read after its eviction
    assert _gid(reader.get(107)) == 107 and fetched == [0, 1, 0, 1]  # present: the map serves it
    local = ShardReader(shard_dir)
    local.get(105)
    (shard_dir / shard_name(1)).unlink()
    assert _gid(local.get(205)) == 205 and _gid(local.get(106)) == 106


def test_sha256_mismatch_names_shard_and_field(shard_dir):
    path = shard_dir / shard_name(1)
    data = bytearray(path.read_bytes())
    data[512 + 20] ^= 0xFF  # inside the first member's payload: only the checksum can see it
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"shards/shard-000001\.tar: sha256 mismatch \(index\.json says [0-9a-f]{64}, "
                                         r"file has [0-9a-f]{64}\)"):
        ShardReader(shard_dir, verify="sha256").get(150)
    ShardReader(shard_dir, verify="size").get(50)  # other shards still readable


def test_truncated_shard(shard_dir):
    path = shard_dir / shard_name(2)
    path.write_bytes(path.read_bytes()[:-1024])
    with pytest.raises(ShardError, match=r"shard-000002\.tar: byte size mismatch \(index\.json says \d+, file has"):
        ShardReader(shard_dir).get(210)


def test_corrupt_header_detected_without_sha(shard_dir):
    path = shard_dir / shard_name(0)
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01  # a member name byte of the first header
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"shard-000000\.tar: corrupt tar header at byte 0"):
        ShardReader(shard_dir, verify="size").get(0)


def test_sample_count_mismatch(shard_dir):
    index = json.loads((shard_dir / "index.json").read_text())
    index["shards"][0]["samples"] += 1
    index["total_samples"] += 1
    (shard_dir / "index.json").write_text(json.dumps(index))
    with pytest.raises(ShardError, match=r"shard-000000\.tar: sample count mismatch \(index\.json says 101, "
                                         r"file has 100\)"):
        ShardReader(shard_dir).get(0)


def test_foreign_member_is_named(tmp_path):
    vocab = 30522
    dtype = id_dtype_for_vocab(vocab)
    sample = Sample(np.array([101, 2000, 102, 2001, 102]), 3, np.array([1], dtype=np.uint16), np.array([2000]), 0)
    with ShardWriter(tmp_path / shard_name(0)) as writer:
        writer.write("000000000000.pair", encode_sample(sample, dtype))
        writer.write("000000000001.json", b"{}")
        info = writer.close()
    ShardIndex(seq_len=8, vocab_size=vocab, vocab_sha256="x", id_dtype=dtype.str, lowercase=True,
               masking={"max_predictions": 2}, pairing={}, seed=0, shards=[info], total_samples=2).write(tmp_path)
    with pytest.raises(ShardError, match=r"member '000000000001\.json' is not named '<key>\.pair'"):
        ShardReader(tmp_path).get(0)


def test_bad_verify_mode(shard_dir):
    with pytest.raises(ValueError, match="verify='md5'"):
        ShardReader(shard_dir, verify="md5")


def test_open_shards_bounded(shard_dir):
    reader = ShardReader(shard_dir, verify="sha256", max_open_shards=2)
    for gid in [0, 150, 240, 10, 160]:
        assert _gid(reader.get(gid)) == gid
        assert len(reader._open) <= 2
    assert list(reader._open) == [0, 1]  # most recently used last; shard 2 was closed
