"""The distributed, world-size-invariant, exactly resumable training loader (and the finite eval loader).

The chain of stages, with the rank/worker split made explicit::

    index.json ──check──> run (seq_len, vocab hash, vocab size)
    EpochOrder(seed, epoch): position in epoch -> global sample id      (same on every rank and worker)
    global batch b = order[b*G : (b+1)*G]                               (G = global_batch_size)
    micro step a of rank r = global batch b [(a*W + r)*M : +M]          (W = world_size, M = micro_batch_size)
    _MicroBatches[m]: this rank's m-th micro batch -> read + decode + (re)mask + collate, inside a DataLoader worker
    ShardLoader: delivers micro batches in order m = 0, 1, 2, ...; counts what it delivered

Guarantees, as implemented:

* **World-size invariance.** The sequence of global batches depends only on ``seed``, ``global_batch_size``,
  ``shuffle``/``shuffle_window_shards`` and the shard set; never on ``world_size``, ``rank``, ``micro_batch_size``
  or ``num_workers``. ``gradient_accumulation_steps = G // (M * W)`` and must be exact. A run resumed on another
  number of nodes continues the same sample stream.
* **Shuffle.** Deterministic in ``(seed, epoch)`` and fresh each epoch: the shard order is permuted, the permuted
  list is cut into windows of ``shuffle_window_shards`` consecutive shards, and the samples of each window are
  permuted together. Memory is O(number of shards + 2 windows of sample ids), not O(total samples): with 8 shards of
  50k samples a window is 400k int64 ids (3.2 MB). Each sample appears exactly once per epoch's order. The price:
  one global batch draws from one window (two at a window edge), i.e. from ``shuffle_window_shards`` shards, whose
  pairs ``bert_ds.data.create`` already shuffled within each shard; raise the window for more mixing (a window
  covering all shards is a full permutation). ``shuffle=False`` keeps index.json order.
* **Epoch boundaries.** An epoch has ``num_samples // G`` global batches; its last ``num_samples % G`` positions are
  dropped (the *documented tail*). The tail is different samples every epoch, because the order is reshuffled;
  nothing is duplicated and nothing else is dropped. The loader is infinite: epoch follows epoch.
* **Workers.** Micro batch ``m`` is one map-style item, built whole by one DataLoader worker; the DataLoader returns
  items in sampler order, so the consumer sees the same batches for any ``num_workers``.
* **Exact resume.** ``state_dict()`` counts micro batches *delivered to the consumer* (not prefetched), stored as
  ``consumed_global_batches`` plus ``micro_steps_into_global_batch``. ``load_state_dict`` (before iterating) makes the
  next batch exactly the one an uninterrupted run would have delivered. With a different ``world_size`` or
  ``micro_batch_size`` the state must lie on a global-batch boundary, else it is refused with a clear error; the
  seed, global batch size, shuffle settings and shard set must match (refused, naming the field).
* **Masking.** By default the static masks stored in the shards are used. With :class:`DynamicMasking`, every epoch
  re-masks each sample from its stored original tokens with 80/10/10 replacement at a configurable rate (e.g.
  MosaicBERT's 30%), optionally whole-word; the mask depends only on ``(seed, epoch, global sample id)``. Per-token
  masking is vectorised over the micro batch: each sample's uniforms come from a counter-based generator (SplitMix64,
  ``masking.counter_uniforms``) keyed by a hash of ``(seed, epoch, global sample id)``, so a sample's mask is the
  same in a batch of 1 or 64, on any rank or worker. Whole-word masking (Google's sequential skip loop) stays per
  sample, with a generator reset per sample from the same triple.
* **Checks before data.** ``build_loader`` checks index.json against the run (``expected_seq_len``,
  ``expected_vocab_sha256``, the dynamic-masking vocab size) and every shard's byte size before anything is
  yielded; each shard is verified on first open in each process at the ``verify`` level (``reader.VERIFY_MODES``).
  The default ``"sha256"`` hashes each shard the first time a worker opens it (streamed; 0.7 GB/s measured on a
  loaded 2-core machine; once per process per shard), so a flipped byte stops training naming the shard instead of
  training on it; pass ``"headers"`` when the set was just hashed ahead of time (``tools/verify_shards.py``).
* **Token ids and positions.** Every micro batch is checked against ``index.json``'s ``vocab_size`` (one max() per
  array) and stored masked positions against the pair length, so a bad record is one :class:`ShardError` naming
  shard, member, field and value, not an IndexError (or a device-side assert) in the model.
* **Errors in workers.** A :class:`ShardError` in a DataLoader worker is returned as data and raised in the main
  process with its one-line message; a worker that dies (a signal) raises :class:`LoaderWorkerError` naming the
  shard and member it was reading, whether the main process was waiting for data or computing.
* **Global RNG untouched.** Each DataLoader has its own ``torch.Generator`` (seeded from the loader seed), so
  iterating a loader never draws from torch's global generator: a resumed run's restored RNG state is what the
  next step's dropout uses.

The eval loader is finite and unshuffled: micro batch ``j = 0, 1, ...`` holds samples ``[j*M, (j+1)*M)`` and goes
to rank ``j % W``; every sample is read exactly once across ranks, the last batch may have fewer rows, and ranks may
get one batch more or fewer than each other (reduce eval metrics once at the end, not per batch).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import multiprocessing.sharedctypes
import os
import re
import signal
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from bert_ds.data.format import Sample
from bert_ds.data.index import ShardIndex
from bert_ds.data.masking import counter_hash, default_max_predictions, mask_pairs, mask_tokens, word_ids_from_pieces
from bert_ds.data.reader import ShardError, ShardReader
from bert_ds.data.tokenizer import continuation_table, load_tokenizer, read_vocab

__all__ = [
    "DynamicMasking", "EpochOrder", "ShardLoader", "EvalLoader", "build_loader", "build_eval_loader",
    "STATE_FORMAT", "IGNORE_INDEX", "BATCH_KEYS", "LoaderWorkerError",
]

STATE_FORMAT = "bert_ds.loader/1"
IGNORE_INDEX = -100
"""Label value of padded prediction slots (``torch.nn.CrossEntropyLoss``'s default ``ignore_index``)."""

BATCH_KEYS = ("input_ids", "token_type_ids", "attention_mask", "masked_lm_positions", "masked_lm_ids",
              "next_sentence_label", "lengths")
"""Fields of a batch: (B, S) ids, segment ids, attention mask; (B, P) positions, labels (-100 padded); (B,) NSP
label (0 IsNext, 1 NotNext) and true length."""

# Distinct tags keep the shard-order and window random streams independent for the same (seed, epoch).
_TAG_SHARDS, _TAG_WINDOW = 0x5A4D, 0x57494E
_TAG_MASK = 0x4D41534B  # keys of the batched dynamic masking: counter_hash(_TAG_MASK, seed, epoch, sample id)
_TAG_WORKERS = 0x574B5253  # the DataLoader's own generator (worker base seeds): counter_hash(_TAG_WORKERS, seed)


# --------------------------------------------------------------------------------------------------------- masking
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
            raise ValueError(f"DynamicMasking.vocab_size={self.vocab_size}: must be positive")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"DynamicMasking.masked_lm_prob={self.masked_lm_prob}: must be in (0, 1)")
        if self.max_predictions is not None and self.max_predictions <= 0:
            raise ValueError(f"DynamicMasking.max_predictions={self.max_predictions}: must be positive")
        if not 0 <= self.mask_id < self.vocab_size:
            raise ValueError(f"DynamicMasking.mask_id={self.mask_id}: outside the vocabulary")
        if self.whole_word:
            if self.continuation is None and self.vocab is None:
                raise ValueError("DynamicMasking.whole_word=True needs 'vocab' (tokenizer dir or vocab.txt) "
                                 "or 'continuation' (a bool per token id)")
            if self.continuation is None:
                self.continuation = continuation_table(read_vocab(self.vocab))
            self.continuation = np.asarray(self.continuation, dtype=bool)
            if self.continuation.shape != (self.vocab_size,):
                raise ValueError(f"DynamicMasking.continuation has {self.continuation.shape[0]} entries but "
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


# ----------------------------------------------------------------------------------------------------------- order
class EpochOrder:
    """Deterministic per-epoch sample order: position in epoch -> global sample id.

    See the module docstring for the shuffle; ``ids(epoch, start, stop)`` builds only the windows it touches and
    keeps the two most recent, so a worker walking forward through an epoch permutes each window once."""

    def __init__(self, shard_counts: Sequence[int], *, seed: int, shuffle: bool, window_shards: int):
        if window_shards <= 0:
            raise ValueError(f"shuffle_window_shards={window_shards}: must be positive")
        self.counts = np.asarray(shard_counts, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self.num_samples = int(self.starts[-1])
        self.seed = seed
        self.shuffle = shuffle
        self.window_shards = window_shards
        self._layout: tuple[int, np.ndarray, np.ndarray] | None = None
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def _epoch_layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard order, window start positions incl. the end) for ``epoch``."""
        if self._layout is None or self._layout[0] != epoch:
            n = len(self.counts)
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch, _TAG_SHARDS]).permutation(n)
            else:
                order = np.arange(n)
            per_window = [int(self.counts[order[i:i + self.window_shards]].sum())
                          for i in range(0, n, self.window_shards)]
            bounds = np.concatenate([[0], np.cumsum(per_window)]).astype(np.int64)
            self._layout = (epoch, order, bounds)
        return self._layout[1], self._layout[2]

    def _window(self, epoch: int, w: int) -> np.ndarray:
        key = (epoch, w)
        ids = self._windows.get(key)
        if ids is None:
            order, _ = self._epoch_layout(epoch)
            shards = order[w * self.window_shards:(w + 1) * self.window_shards]
            ids = np.concatenate([np.arange(self.starts[s], self.starts[s + 1]) for s in shards])
            if self.shuffle:
                np.random.default_rng([self.seed, epoch, w, _TAG_WINDOW]).shuffle(ids)
            self._windows[key] = ids
            while len(self._windows) > 2:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
        return ids

    def ids(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Global sample ids at positions ``[start, stop)`` of ``epoch``'s order."""
        if not 0 <= start <= stop <= self.num_samples:
            raise IndexError(f"positions [{start}, {stop}) outside an epoch of {self.num_samples} samples")
        _, bounds = self._epoch_layout(epoch)
        parts = []
        w = int(np.searchsorted(bounds, start, side="right")) - 1
        pos = start
        while pos < stop:
            lo, hi = int(bounds[w]), int(bounds[w + 1])
            take = min(stop, hi)
            parts.append(self._window(epoch, w)[pos - lo:take - lo])
            pos = take
            w += 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# --------------------------------------------------------------------------------------------------------- collate
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


class _Collator:
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
        return 3 * self.seq_len + 2 * self.max_predictions + 2

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
        s, p = self.seq_len, self.max_predictions
        shapes = [(b, s), (b, s), (b, s), (b, p), (b, p), (b,), (b,)]
        views, off = [], 0
        for shape in shapes:
            size = math.prod(shape)
            views.append(flat[off:off + size].reshape(shape))
            off += size
        return views

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


# -------------------------------------------------------------------------------------------------------- datasets
class _MicroBatches(Dataset):
    """Map-style: item ``m`` is this rank's ``m``-th training micro batch (``m`` counts across epochs)."""

    def __init__(self, order: EpochOrder, collate: _Collator, *, global_batch_size: int, micro_batch_size: int,
                 rank: int, world_size: int):
        self.order = order
        self.collate = collate
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.accumulation = global_batch_size // (micro_batch_size * world_size)
        self.batches_per_epoch = order.num_samples // global_batch_size

    def sample_ids(self, m: int) -> tuple[int, np.ndarray]:
        """(epoch, global sample ids) of micro batch ``m``."""
        global_batch, micro_step = divmod(m, self.accumulation)
        epoch, batch_in_epoch = divmod(global_batch, self.batches_per_epoch)
        start = (batch_in_epoch * self.global_batch_size
                 + (micro_step * self.world_size + self.rank) * self.micro_batch_size)
        return epoch, self.order.ids(epoch, start, start + self.micro_batch_size)

    def __getitem__(self, m: int) -> np.ndarray:
        epoch, ids = self.sample_ids(m)
        return self.collate(ids, epoch)


class _EvalBatches(Dataset):
    def __init__(self, num_samples: int, collate: _Collator, *, micro_batch_size: int, rank: int, world_size: int):
        self.num_samples = num_samples
        self.collate = collate
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        total_batches = -(-num_samples // micro_batch_size)
        self.length = max(0, -(-(total_batches - rank) // world_size))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, k: int) -> np.ndarray:
        if not 0 <= k < self.length:
            raise IndexError(k)
        j = k * self.world_size + self.rank
        start = j * self.micro_batch_size
        ids = np.arange(start, min(start + self.micro_batch_size, self.num_samples), dtype=np.int64)
        return self.collate(ids, 0)


class _CountFrom(Sampler[int]):
    """Infinite sampler: start, start+1, ..."""

    def __init__(self, start: int):
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return itertools.count(self.start)


def _iterate(dataset: _MicroBatches | _EvalBatches, indices: Iterator[int] | Sampler, num_workers: int,
             prefetch_factor: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    if num_workers == 0:
        return (dataset.collate.unpack(dataset[i]) for i in indices)
    return _from_workers(dataset, indices, num_workers, prefetch_factor, seed)


class LoaderWorkerError(RuntimeError):
    """A DataLoader worker process died (killed by a signal, e.g. SIGBUS on a shard truncated while mapped, or the
    out-of-memory killer); the one-line message names the shard and member it was reading."""


class _Failure:
    """A :class:`ShardError` caught in a worker and returned as data, so the main process raises it with its own
    one-line message (torch re-raises a worker's exception wrapped in a multi-line traceback text)."""

    def __init__(self, message: str):
        self.message = message


class _Guarded(Dataset):
    def __init__(self, inner: _MicroBatches | _EvalBatches):
        self.inner = inner

    def __getitem__(self, m: int) -> np.ndarray | _Failure:
        try:
            return self.inner[m]
        except ShardError as exc:
            return _Failure(str(exc))


def _init_worker(slots, worker_id: int) -> None:
    """Point the worker's reader at its (pid, shard, index) slot in shared memory: what it was reading if it dies."""
    view = np.frombuffer(slots, dtype=np.int64)[3 * worker_id:3 * worker_id + 3]
    view[:] = (os.getpid(), -1, -1)
    torch.utils.data.get_worker_info().dataset.inner.collate.reader.reading = view[1:]


def _from_workers(dataset: _MicroBatches | _EvalBatches, indices: Iterator[int] | Sampler, num_workers: int,
                  prefetch_factor: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    slots = multiprocessing.sharedctypes.RawArray("q", 3 * num_workers)
    # Its own generator: creating the iterator draws the workers' base seed from it, never from torch's global RNG,
    # which a resumed run has just restored (a draw there would shift every later dropout mask). Batches do not
    # depend on worker seeds: masking is keyed by (seed, epoch, sample id).
    generator = torch.Generator().manual_seed(int(counter_hash(_TAG_WORKERS, seed)) >> 1)
    loader = DataLoader(_Guarded(dataset), batch_size=None, sampler=indices, num_workers=num_workers,
                        prefetch_factor=prefetch_factor, collate_fn=_identity, generator=generator,
                        worker_init_fn=functools.partial(_init_worker, slots))
    it = iter(loader)
    watch = (slots, dataset.collate.reader)
    _WATCHED[id(watch)] = watch
    _translate_sigchld()
    try:
        while True:
            try:
                flat = next(it)
            except StopIteration:
                return
            except RuntimeError as exc:
                if isinstance(exc, LoaderWorkerError) or "DataLoader worker" not in str(exc):
                    raise
                raise LoaderWorkerError(_death_message(str(exc), [watch])) from None
            if isinstance(flat, _Failure):
                raise ShardError(flat.message)
            yield dataset.collate.unpack(flat)
    finally:
        _WATCHED.pop(id(watch), None)


_WATCHED: dict[int, tuple] = {}
"""(slots, reader) of every live worker pool in this process, for naming a dead worker's shard."""
_SIGCHLD_WRAPPED = False


def _death_message(torch_message: str, watched: list[tuple]) -> str:
    """One line: which worker died, what it was reading, and torch's first line."""
    first = torch_message.strip().splitlines()[0] if torch_message.strip() else "a worker exited"
    match = re.search(r"pid(?:\(s\))? ([\d, ]+)\)", first)
    dead = {int(x) for x in re.findall(r"\d+", match.group(1))} if match else set()
    reading = []
    for slots, reader in watched:
        table = np.frombuffer(slots, dtype=np.int64).reshape(-1, 3)
        for worker, (pid, shard, index) in enumerate(table.tolist()):
            if pid in dead or (not dead and pid):
                where = (f"{reader.shard_path(shard)[1]} member #{index}" if shard >= 0
                         else "nothing yet (it died before reading a shard)")
                reading.append(f"worker {worker} (pid {pid}) was reading {where}")
    what = "; ".join(reading) if reading else "the shard it was reading is unknown"
    return f"a DataLoader worker died: {what} [torch: {first}]"


def _translate_sigchld() -> None:
    """Wrap torch's SIGCHLD handler (installed by the first worker pool) so that a worker dying while the main
    process computes also raises :class:`LoaderWorkerError` naming the shard, not torch's bare RuntimeError."""
    global _SIGCHLD_WRAPPED
    if _SIGCHLD_WRAPPED or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGCHLD)
    if not callable(previous):
        return

    def handler(signum, frame):
        try:
            previous(signum, frame)
        except RuntimeError as exc:
            if "DataLoader worker" not in str(exc) or not _WATCHED:
                raise
            raise LoaderWorkerError(_death_message(str(exc), list(_WATCHED.values()))) from None

    signal.signal(signal.SIGCHLD, handler)
    _SIGCHLD_WRAPPED = True


def _identity(batch):
    return batch


# --------------------------------------------------------------------------------------------------------- loaders
class ShardLoader:
    """Infinite training loader; see the module docstring for its guarantees. Build it with :func:`build_loader`."""

    def __init__(self, dataset: _MicroBatches, *, num_workers: int, prefetch_factor: int, fingerprint: dict):
        self._dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self._fingerprint = fingerprint
        self._delivered = 0

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._dataset.accumulation

    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch (the incomplete tail of each epoch is dropped)."""
        return self._dataset.batches_per_epoch

    @property
    def consumed_global_batches(self) -> int:
        return self._delivered // self._dataset.accumulation

    @property
    def epoch(self) -> int:
        """Epoch of the next micro batch."""
        return self.consumed_global_batches // self._dataset.batches_per_epoch

    def sample_ids(self, m: int) -> np.ndarray:
        """Global sample ids of this rank's micro batch ``m`` (counted from the start of training)."""
        return self._dataset.sample_ids(m)[1]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in _iterate(self._dataset, _CountFrom(self._delivered), self.num_workers, self.prefetch_factor,
                              self._dataset.collate.seed):
            self._delivered += 1
            yield batch

    def state_dict(self) -> dict:
        """JSON-serialisable position: micro batches delivered to the consumer, as global batches + remainder."""
        consumed, into = divmod(self._delivered, self._dataset.accumulation)
        return {
            "format": STATE_FORMAT,
            **self._fingerprint,
            "consumed_global_batches": consumed,
            "micro_steps_into_global_batch": into,
            "world_size": self._dataset.world_size,
            "micro_batch_size": self._dataset.micro_batch_size,
            "epoch": consumed // self._dataset.batches_per_epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (call before iterating). Refuses a state from another data stream, and a
        mid-global-batch state when the world size or micro batch size changed."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"loader state: field 'format' is {state.get('format')!r}, expected {STATE_FORMAT!r}")
        for name, want in self._fingerprint.items():
            if name == "dynamic_masking":
                continue  # changing the masking recipe on resume is allowed; it does not move the sample stream
            if state.get(name) != want:
                raise ValueError(f"loader state: field '{name}' is {state.get(name)!r} but this loader has "
                                 f"{want!r}; resuming would not continue the same sample stream")
        consumed = int(state["consumed_global_batches"])
        into = int(state["micro_steps_into_global_batch"])
        if into:
            same = (state.get("world_size") == self._dataset.world_size
                    and state.get("micro_batch_size") == self._dataset.micro_batch_size)
            if not same:
                raise ValueError(
                    f"loader state is {into} micro step(s) into global batch {consumed} (saved with "
                    f"world_size={state.get('world_size')}, micro_batch_size={state.get('micro_batch_size')}); "
                    f"with world_size={self._dataset.world_size}, micro_batch_size={self._dataset.micro_batch_size} "
                    "it can only resume on a global-batch boundary: save at the end of an optimizer step")
        self._delivered = consumed * self._dataset.accumulation + into


class EvalLoader:
    """Finite, unshuffled eval loader: every sample exactly once across ranks. Build with :func:`build_eval_loader`."""

    def __init__(self, dataset: _EvalBatches, *, num_workers: int, prefetch_factor: int):
        self._dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor

    def __len__(self) -> int:
        return len(self._dataset)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return _iterate(self._dataset, iter(range(len(self._dataset))), self.num_workers, self.prefetch_factor,
                        self._dataset.collate.seed)


# -------------------------------------------------------------------------------------------------------- builders
def _open_checked(data_dir: str | Path, *, expected_seq_len: int | None, expected_vocab_sha256: str | None,
                  dynamic_masking: DynamicMasking | None, max_predictions: int | None,
                  verify: str, max_open_shards: int = 32) -> tuple[ShardReader, int]:
    """Load + check index.json and shard sizes; return the reader and the prediction slots per row."""
    index = ShardIndex.load(data_dir)
    where = str(data_dir)
    index.check_compatible(seq_len=expected_seq_len, vocab_sha256=expected_vocab_sha256, where=where)
    if dynamic_masking is not None:
        index.check_compatible(vocab_size=dynamic_masking.vocab_size, where=where)
    reader = ShardReader(data_dir, verify=verify, index=index, max_open_shards=max_open_shards)
    if reader.num_samples == 0:
        raise ValueError(f"{where}/index.json lists no samples")
    for shard in range(reader.num_shards):  # cheap: one stat per shard; the `verify` level runs on first open
        reader.check_size(shard)
    if dynamic_masking is not None:
        needed = dynamic_masking.resolved_max_predictions(index.seq_len)
    else:
        needed = index.masking.get("max_predictions")
        if needed is None:
            raise ValueError(f"{where}/index.json: field 'masking.max_predictions' missing; pass max_predictions=")
    if max_predictions is None:
        max_predictions = int(needed)
    elif max_predictions < needed:
        raise ValueError(f"max_predictions={max_predictions} is below the {needed} predictions per sample "
                         f"{'dynamic masking makes' if dynamic_masking else 'index.json allows'}")
    return reader, max_predictions


def _check_rank(rank: int, world_size: int, micro_batch_size: int, num_workers: int) -> None:
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size={micro_batch_size}: must be positive")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers}: must be >= 0")


def build_loader(data_dir: str | Path, *, global_batch_size: int, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, num_workers: int = 2, expected_seq_len: int | None = None,
                 expected_vocab_sha256: str | None = None, max_predictions: int | None = None,
                 dynamic_masking: DynamicMasking | None = None, shuffle: bool = True, verify: str = "sha256",
                 shuffle_window_shards: int = 8, prefetch_factor: int = 2) -> ShardLoader:
    """The infinite training loader for this rank; ``gradient_accumulation_steps = G // (M * W)`` must be exact."""
    _check_rank(rank, world_size, micro_batch_size, num_workers)
    per_step = micro_batch_size * world_size
    if global_batch_size <= 0 or global_batch_size % per_step:
        raise ValueError(f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size * "
                         f"world_size = {micro_batch_size} * {world_size} = {per_step}")
    # A batch touches at most two windows; keep both mapped so no shard is rescanned mid-window.
    reader, p = _open_checked(data_dir, expected_seq_len=expected_seq_len,
                              expected_vocab_sha256=expected_vocab_sha256, dynamic_masking=dynamic_masking,
                              max_predictions=max_predictions, verify=verify,
                              max_open_shards=max(32, 2 * shuffle_window_shards + 2))
    if reader.num_samples < global_batch_size:
        raise ValueError(f"{data_dir}: {reader.num_samples} samples is less than one global batch "
                         f"({global_batch_size})")
    index = reader.index
    order = EpochOrder([s.samples for s in index.shards], seed=seed, shuffle=shuffle,
                       window_shards=shuffle_window_shards)
    collate = _Collator(reader, seq_len=index.seq_len, max_predictions=p, dynamic_masking=dynamic_masking,
                        seed=seed)
    dataset = _MicroBatches(order, collate, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                            rank=rank, world_size=world_size)
    shard_list = json.dumps([[s.name, s.samples, s.sha256] for s in index.shards])
    fingerprint = {
        "seed": seed, "global_batch_size": global_batch_size, "shuffle": shuffle,
        "shuffle_window_shards": shuffle_window_shards, "num_samples": reader.num_samples,
        "shard_set_sha256": hashlib.sha256(shard_list.encode()).hexdigest(),
        "dynamic_masking": dynamic_masking.describe() if dynamic_masking is not None else None,
    }
    return ShardLoader(dataset, num_workers=num_workers, prefetch_factor=prefetch_factor, fingerprint=fingerprint)


def build_eval_loader(data_dir: str | Path, *, micro_batch_size: int, rank: int = 0, world_size: int = 1,
                      num_workers: int = 0, expected_seq_len: int | None = None,
                      expected_vocab_sha256: str | None = None, max_predictions: int | None = None,
                      dynamic_masking: DynamicMasking | None = None, verify: str = "sha256", seed: int = 0,
                      prefetch_factor: int = 2) -> EvalLoader:
    """Finite eval loader; static masks by default, or ``dynamic_masking`` at epoch 0 of ``seed`` (fixed masks)."""
    _check_rank(rank, world_size, micro_batch_size, num_workers)
    reader, p = _open_checked(data_dir, expected_seq_len=expected_seq_len,
                              expected_vocab_sha256=expected_vocab_sha256, dynamic_masking=dynamic_masking,
                              max_predictions=max_predictions, verify=verify)
    collate = _Collator(reader, seq_len=reader.index.seq_len, max_predictions=p, dynamic_masking=dynamic_masking,
                        seed=seed)
    dataset = _EvalBatches(reader.num_samples, collate, micro_batch_size=micro_batch_size, rank=rank,
                           world_size=world_size)
    return EvalLoader(dataset, num_workers=num_workers, prefetch_factor=prefetch_factor)

