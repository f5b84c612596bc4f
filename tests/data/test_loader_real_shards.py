"""The loader on a shard set made from real text by bert_ds.data.create (conftest ``shards_128``)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from bert_ds.data.index import ShardIndex
from bert_ds.data.loader import IGNORE_INDEX, DynamicMasking, build_eval_loader, build_loader
from bert_ds.data.reader import ShardReader
from bert_ds.data.tokenizer import load_tokenizer, vocab_sha256


def _originals(batch: dict) -> torch.Tensor:
    ids = batch["input_ids"].clone()
    labels, pos = batch["masked_lm_ids"], batch["masked_lm_positions"]
    rows, cols = torch.nonzero(labels != IGNORE_INDEX, as_tuple=True)
    ids[rows, pos[rows, cols]] = labels[rows, cols]
    return ids


def test_static_and_dynamic_batches_match_the_shards(shards_128, tokenizer_dir):
    index = ShardIndex.load(shards_128)
    tok = load_tokenizer(tokenizer_dir)
    run = {"expected_seq_len": 128, "expected_vocab_sha256": vocab_sha256(tokenizer_dir / "vocab.txt")}
    reader = ShardReader(shards_128, verify="sha256")
    dyn = DynamicMasking(vocab_size=index.vocab_size, masked_lm_prob=0.3, whole_word=True, vocab=tokenizer_dir,
                         mask_id=tok.mask_id)
    for dynamic in (None, dyn):
        loader = build_loader(shards_128, global_batch_size=32, micro_batch_size=16, num_workers=1,
                              dynamic_masking=dynamic, verify="sha256", **run)
        for m, batch in enumerate(itertools.islice(iter(loader), 4)):
            originals = _originals(batch)
            for row, gid in enumerate(loader.sample_ids(m)):
                sample = reader.get(int(gid))
                n = sample.length
                assert originals[row, :n].tolist() == sample.original_ids().tolist()
                assert batch["input_ids"][row, 0] == tok.cls_id and batch["input_ids"][row, n - 1] == tok.sep_id
                if dynamic is None:
                    assert batch["input_ids"][row, :n].tolist() == sample.input_ids.tolist()
                predicted = int((batch["masked_lm_ids"][row] != IGNORE_INDEX).sum())
                assert 0 < predicted <= batch["masked_lm_ids"].shape[1]
        if dynamic is not None:
            assert batch["masked_lm_ids"].shape[1] == 39  # ceil(0.3 * 128)


def test_eval_loader_reads_every_real_sample_once(shards_128):
    total = ShardIndex.load(shards_128).total_samples
    rows = sum(len(b["lengths"]) for r in range(3)
               for b in build_eval_loader(shards_128, micro_batch_size=100, rank=r, world_size=3))
    assert rows == total
    lengths = np.concatenate([b["lengths"].numpy() for b in build_eval_loader(shards_128, micro_batch_size=500)])
    assert lengths.max() <= 128 and lengths.min() > 3


def test_dynamic_masking_from_tokenizer(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    dyn = DynamicMasking.from_tokenizer(tokenizer_dir, whole_word=True, masked_lm_prob=0.3)
    assert (dyn.vocab_size, dyn.mask_id, dyn.masked_lm_prob) == (tok.vocab_size, tok.mask_id, 0.3)
    assert np.array_equal(dyn.continuation, tok.continuation_table())
