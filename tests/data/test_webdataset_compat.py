"""The shards are WebDataset tar shards: ``webdataset.WebDataset`` reads a shard set made by ``create_shards`` and
yields, in order, the same ``.pair`` records that ``ShardReader`` does."""

from __future__ import annotations

import numpy as np
import webdataset as wds  # install_requires: a missing webdataset is a failure here, not a skip

from bert_ds.data.format import MEMBER_SUFFIX, decode_sample
from bert_ds.data.index import ShardIndex
from bert_ds.data.reader import ShardReader


def test_webdataset_reads_the_shards_in_order(shards_128):
    index = ShardIndex.load(shards_128)
    urls = [str(shards_128 / s.name) for s in index.shards]
    dtype = np.dtype(index.id_dtype)
    # No shard shuffle, no decoder: raw bytes of every member, grouped by key, shards in index.json order.
    records = list(wds.WebDataset(urls, shardshuffle=False))
    reader = ShardReader(shards_128, verify="sha256")
    assert len(records) == len(reader) == index.total_samples > 0
    for g, record in enumerate(records):
        assert set(record) >= {"__key__", "__url__", MEMBER_SUFFIX}
        shard, i = (int(x[0]) for x in reader.locate(np.asarray([g])))
        assert record["__url__"] == urls[shard]
        assert f"{record['__key__']}.{MEMBER_SUFFIX}" == reader.open(shard).members.names[i]
        ours, theirs = reader.sample(shard, i), decode_sample(record[MEMBER_SUFFIX], dtype, where=record["__key__"])
        assert theirs.input_ids.tobytes() == ours.input_ids.tobytes()
        assert theirs.segment_a_length == ours.segment_a_length and theirs.nsp_label == ours.nsp_label
        assert theirs.masked_positions.tobytes() == ours.masked_positions.tobytes()
        assert theirs.masked_ids.tobytes() == ours.masked_ids.tobytes()
    reader.close()
