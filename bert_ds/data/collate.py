"""Collate: read samples by global id and pack one padded micro batch (the :mod:`bert_ds.data.batch` contract).

Runs inside a DataLoader worker (or the main process with ``num_workers=0``): reads each sample, applies the static
masks or :class:`~bert_ds.data.dynamic_masking.DynamicMasking`, checks token ids against ``index.json``'s
``vocab_size`` and masked positions against the pair length (one :class:`ShardError` naming shard, member, field and
value), and returns one flat int32 array that :meth:`Collator.unpack` turns into the batch dict in the consumer.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from bert_ds.data.batch import BATCH_FIELDS, BATCH_KEYS, IGNORE_INDEX
from bert_ds.data.dynamic_masking import DynamicMasking
from bert_ds.data.format import Sample
from bert_ds.data.masking import counter_hash
from bert_ds.data.reader import ShardError, ShardReader

__all__ = ["Collator"]

_TAG_MASK = 0x4D41534B  # keys of the batched dynamic masking: counter_hash(_TAG_MASK, seed, epoch, sample id)


class _SampleRng:
    """A generator reset to a stream that depends only on (seed, epoch, global sample id).

    Resetting one PCG64's 128-bit state and (odd) increment from a BLAKE2b digest costs ~10 us; building a fresh
    ``default_rng([seed, epoch, id])`` per sample (SeedSequence) cost ~45 us, as much as masking the sample."""

    def __init__(self) -> None:
        self._bits = np.random.PCG64(0)
        self._gen = np.random.Generator(self._bits)

    def __call__(self, seed: int, epoch: int, sample_id: int) -> np.random.Generator:
        digest = hashlib.blake2b(b"bert_ds.mask/%d/%d/%d" % (seed, epoch, sample_id), digest_size=32).digest()
        self._bits.state = {
            "bit_generator": "PCG64",
            "state": {"state": int.from_bytes(digest[:16], "little"), "inc": int.from_bytes(digest[16:], "little") | 1},
            "has_uint32": 0, "uinteger": 0,
        }
        return self._gen


class Collator:
    """Reads samples by global id and packs them into one padded micro batch of torch tensors."""

    def __init__(self, reader: ShardReader, *, seq_len: int, max_predictions: int,
                 dynamic_masking: DynamicMasking | None, seed: int):
        self.reader = reader
        self.seq_len = seq_len
        self.max_predictions = max_predictions
        self.dynamic = dynamic_masking
        self.seed = seed
        self._rng = _SampleRng()

    def row_width(self) -> int:
        sizes = {"B": 1, "S": self.seq_len, "P": self.max_predictions}
        return sum(math.prod(sizes[d] for d in dims) for dims in BATCH_FIELDS.values())

    def __call__(self, global_ids: np.ndarray, epoch: int) -> np.ndarray:
        """The micro batch packed into one flat int32 numpy array (field after field, see :meth:`unpack`).

        Why not seven int64 tensors: a DataLoader worker pays a shared-memory segment per returned tensor (~2 ms per
        batch measured here, more than building it), while one small array goes through the pipe in ~0.4 ms;
        int32 halves the bytes (token ids < 2**31). :meth:`unpack` widens to int64 in the consumer."""
        b, p = len(global_ids), self.max_predictions
        # Zero padding in every field. For input_ids the pad value is no token id anyone relies on: padded positions
        # have attention_mask 0 and no label, so whatever id they hold reaches neither the loss nor another position.
        flat = np.zeros(b * self.row_width(), dtype=np.int32)
        input_ids, token_type, attention, positions, labels, nsp, lengths = self._views(flat, b)
        labels.fill(IGNORE_INDEX)
        shards, indices = self.reader.locate(global_ids)
        if self.dynamic is not None and not self.dynamic.whole_word:
            self._remask_batch(flat, global_ids, epoch, shards, indices)
            return flat
        for row in range(b):
            shard, index = int(shards[row]), int(indices[row])
            sample = self._sample(shard, index)
            n = sample.length
            if self.dynamic is None:
                ids, pos, orig = sample.input_ids, sample.masked_positions, sample.masked_ids
            else:  # whole-word: the continuation table is indexed by token id, so check this sample first
                self._check_sample(sample, shard, index)
                rng = self._rng(self.seed, epoch, int(global_ids[row]))
                ids, pos, orig = self.dynamic.mask(sample.original_ids(), sample.segment_a_length, rng, p)
            k = len(pos)
            if k > p:
                raise ShardError(f"{self._where(shard, index)}: {k} masked positions exceed max_predictions={p}")
            input_ids[row, :n] = ids
            token_type[row, sample.segment_a_length:n] = 1
            attention[row, :n] = 1
            positions[row, :k] = pos
            labels[row, :k] = orig
            nsp[row] = sample.nsp_label
            lengths[row] = n
        if self.dynamic is None:
            chosen_rows, chosen_cols = np.nonzero(labels != IGNORE_INDEX)
            self._check_positions(chosen_rows, positions[chosen_rows, chosen_cols], lengths, shards, indices)
            self._check_ids("input_ids", input_ids, shards, indices)
            self._check_ids("masked_lm_ids", labels, shards, indices)
        return flat

    def _remask_batch(self, flat: np.ndarray, global_ids: np.ndarray, epoch: int, shards: np.ndarray,
                      indices: np.ndarray) -> None:
        """Per-token dynamic masking: restore every row's stored originals, then mask the whole batch at once
        (``DynamicMasking.mask_batch``, each row keyed by (seed, epoch, global sample id)). Fills ``flat``."""
        b, s, p = len(global_ids), self.seq_len, self.max_predictions
        input_ids, token_type, attention, positions, labels, nsp, lengths = self._views(flat, b)
        if b == 0:
            return
        segment_a, row_lengths, nsp_labels, stored_pos, stored_ids = [], [], [], [], []
        for row in range(b):
            shard, index = int(shards[row]), int(indices[row])
            sample = self._sample(shard, index)
            n = sample.length
            input_ids[row, :n] = sample.input_ids
            segment_a.append(sample.segment_a_length)
            row_lengths.append(n)
            nsp_labels.append(sample.nsp_label)
            stored_pos.append(sample.masked_positions)
            stored_ids.append(sample.masked_ids)
        lengths[:] = row_lengths
        nsp[:] = nsp_labels
        rows = np.repeat(np.arange(b), [len(x) for x in stored_pos])
        stored_pos = np.concatenate(stored_pos)
        self._check_positions(rows, stored_pos, lengths, shards, indices)
        input_ids[rows, stored_pos] = np.concatenate(stored_ids)  # back to the stored originals
        self._check_ids("input_ids", input_ids, shards, indices)  # before masking reads them
        cols = np.arange(s)
        segment_a = np.asarray(segment_a, dtype=np.int64)
        attention[...] = cols < lengths[:, None]
        token_type[...] = (cols >= segment_a[:, None]) & (cols < lengths[:, None])
        keys = counter_hash(_TAG_MASK, self.seed, epoch, np.asarray(global_ids, dtype=np.int64))
        masked, pos, orig = self.dynamic.mask_batch(input_ids, segment_a, lengths, keys, p)
        input_ids[...] = masked
        k = pos.shape[1]
        chosen = pos >= 0
        positions[:, :k] = np.where(chosen, pos, 0)
        labels[:, :k] = np.where(chosen, orig, IGNORE_INDEX)

    def _views(self, flat, b: int) -> list:
        sizes = {"B": b, "S": self.seq_len, "P": self.max_predictions}
        views, off = [], 0
        for shape in ([sizes[d] for d in dims] for dims in BATCH_FIELDS.values()):
            size = math.prod(shape)
            views.append(flat[off:off + size].reshape(shape))
            off += size
        return views

    def place(self, out: np.ndarray, out_rows: int, rows: np.ndarray, part: np.ndarray) -> None:
        """Copy the rows of ``part`` (a packed batch from :meth:`__call__`) to rows ``rows`` of ``out``, a packed batch
        of ``out_rows`` rows (a mixed micro batch assembled from its sources' collators)."""
        for dst, src in zip(self._views(out, out_rows), self._views(part, len(rows)), strict=True):
            dst[rows] = src

    def unpack(self, flat: np.ndarray) -> dict[str, torch.Tensor]:
        """Flat array from :meth:`__call__` -> the batch dict of int64 tensors (contiguous views of one buffer)."""
        b = flat.shape[0] // self.row_width()
        return dict(zip(BATCH_KEYS, self._views(torch.from_numpy(flat).to(torch.int64), b), strict=True))

    def _sample(self, shard: int, index: int) -> Sample:
        """One stored sample, refused if it is longer than the shard set's seq_len."""
        sample = self.reader.sample(shard, index)
        if sample.length > self.seq_len:
            raise ShardError(f"{self._where(shard, index)}: length {sample.length} exceeds index.json "
                             f"seq_len={self.seq_len}")
        return sample

    def _where(self, shard: int | np.integer, index: int | np.integer) -> str:
        return self.reader.member_name(int(shard), int(index))

    def _check_ids(self, name: str, ids: np.ndarray, shards: np.ndarray, indices: np.ndarray) -> None:
        """Refuse a token id outside the vocabulary (the model's embedding lookup would fail on it: an IndexError on
        CPU, a device-side assert on GPU), naming the shard and member. One max() over the (b, n) array; ids are
        stored unsigned, so one >= 2**31 wrapped negative in int32: compare as uint32, padding labels as 0."""
        values = ids.view(np.uint32)
        if name == "masked_lm_ids":
            values = np.where(ids == IGNORE_INDEX, 0, values)
        vocab = self.reader.index.vocab_size
        if values.size == 0 or int(values.max()) < vocab:
            return
        row, col = (int(x) for x in np.argwhere(values >= vocab)[0])
        raise ShardError(f"{self._where(shards[row], indices[row])}: field '{name}' holds token id "
                         f"{int(values[row, col])} (slot {col}), not below index.json vocab_size={vocab}")

    def _check_positions(self, rows: np.ndarray, positions: np.ndarray, lengths: np.ndarray, shards: np.ndarray,
                         indices: np.ndarray) -> None:
        """Refuse a stored masked position outside its pair (it would index past the sequence or label padding)."""
        bad = np.flatnonzero(positions >= lengths[rows])
        if bad.shape[0]:
            row = int(rows[bad[0]])
            raise ShardError(f"{self._where(shards[row], indices[row])}: field 'masked_positions' holds "
                             f"{int(positions[bad[0]])}, not below the pair's length {int(lengths[row])}")

    def _check_sample(self, sample: Sample, shard: int, index: int) -> None:
        """The checks of :meth:`_check_ids`/:meth:`_check_positions` for one sample (the whole-word path)."""
        vocab = self.reader.index.vocab_size
        if sample.masked_positions.shape[0] and int(sample.masked_positions.max()) >= sample.length:
            raise ShardError(f"{self._where(shard, index)}: field 'masked_positions' holds "
                             f"{int(sample.masked_positions.max())}, not below the pair's length {sample.length}")
        for name, ids in (("input_ids", sample.input_ids), ("masked_lm_ids", sample.masked_ids)):
            if ids.shape[0] and int(ids.max()) >= vocab:
                raise ShardError(f"{self._where(shard, index)}: field '{name}' holds token id {int(ids.max())}, "
                                 f"not below index.json vocab_size={vocab}")
