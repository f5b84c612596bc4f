"""The distributed, world-size-invariant, exactly resumable training loader (and the finite eval loader).

The chain of stages, with the rank/worker split made explicit::

    index.json ──check──> run (seq_len, vocab hash, vocab size)
    EpochOrder(seed, epoch): position in epoch -> global sample id      (same on every rank and worker)
    global batch b = order[b*G : (b+1)*G]                               (G = global_batch_size)
    micro step a of rank r = global batch b [(a*W + r)*M : +M]          (W = world_size, M = micro_batch_size)
    _MicroBatches[m]: this rank's m-th micro batch -> read + decode + (re)mask + collate, inside a DataLoader worker
    ShardLoader: delivers micro batches in order m = 0, 1, 2, ...; counts what it delivered

Its stages live in their own modules: ``epoch_order`` (the order), ``collate`` (read + mask + pack, the batch
contract of ``batch``), ``dynamic_masking``, ``workers`` (DataLoader workers, a dead worker named); this module cuts
global batches into each rank's micro batches and holds the loaders, their resumable state and their builders.

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
  shard and member it was reading: at once when the main process waits for data, else at the next batch or the
  training loop's next step boundary (:func:`raise_if_worker_died`; the SIGCHLD handler only records the death).
* **Global RNG untouched.** Each DataLoader has its own ``torch.Generator`` (seeded from the loader seed), so
  iterating a loader never draws from torch's global generator: a resumed run's restored RNG state is what the
  next step's dropout uses.

The eval loader is finite and unshuffled: micro batch ``j = 0, 1, ...`` holds samples ``[j*M, (j+1)*M)`` and goes
to rank ``j % W``; every sample is read exactly once across ranks, the last batch may have fewer rows, and ranks may
get one batch more or fewer than each other (reduce eval metrics once at the end, not per batch).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from bert_ds.data.batch import BATCH_KEYS, IGNORE_INDEX
from bert_ds.data.collate import Collator
from bert_ds.data.dynamic_masking import DynamicMasking
from bert_ds.data.epoch_order import EpochOrder
from bert_ds.data.index import ShardIndex
from bert_ds.data.mix import (
    MIX_RULE,
    MixChangedError,
    MixedMicroBatches,
    MixSchedule,
    Source,
    check_source_samples,
    is_mix,
    mix_changes,
    mix_summary,
    rule_changes,
    source_seed,
)
from bert_ds.data.prefetch import Prefetcher
from bert_ds.data.reader import ShardReader
from bert_ds.data.remote import is_url
from bert_ds.data.shard_cache import ShardCache, open_cache
from bert_ds.data.workers import LoaderWorkerError, iterate, raise_if_worker_died
from bert_ds.errors import BadInput

__all__ = [
    "DynamicMasking", "EpochOrder", "ShardLoader", "MixedShardLoader", "MixChangedError", "Source", "EvalLoader",
    "build_loader", "build_eval_loader",
    "STATE_FORMAT", "IGNORE_INDEX", "BATCH_KEYS", "LoaderWorkerError", "raise_if_worker_died",
]

STATE_FORMAT = "bert_ds.loader/1"


# -------------------------------------------------------------------------------------------------------- datasets
class _MicroBatches(Dataset):
    """Map-style: item ``m`` is this rank's ``m``-th training micro batch (``m`` counts across epochs)."""

    def __init__(self, order: EpochOrder, collate: Collator, *, global_batch_size: int, micro_batch_size: int,
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
    def __init__(self, num_samples: int, collate: Collator, *, micro_batch_size: int, rank: int, world_size: int):
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


# --------------------------------------------------------------------------------------------------------- loaders
class _TrainLoader:
    """What the single-set and the mixed training loaders share: delivery counting, iteration, the resume position."""

    def __init__(self, dataset, *, num_workers: int, prefetch_factor: int, fingerprint: dict):
        self._dataset = dataset
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self._fingerprint = fingerprint
        self._delivered = 0
        self.wait_s = 0.0
        """Seconds the consumer waited on this loader for its batches (the step's data wait; TensorBoard
        ``data/phase<N>/loader_wait_s``)."""
        self.prefetchers: list[Prefetcher] = []
        """One per shard set read from a URL (:mod:`bert_ds.data.prefetch`), advanced before every batch."""
        self.mix_change: str | None = None
        """What differed from the checkpoint's mix when ``continue_with_new_mix`` let it through (for the log); only
        a mix can change."""

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._dataset.accumulation

    @property
    def consumed_global_batches(self) -> int:
        return self._delivered // self._dataset.accumulation

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        batches = iterate(self._dataset, _CountFrom(self._delivered), self.num_workers, self.prefetch_factor,
                          self._dataset.collate.seed)
        while True:
            for prefetcher in self.prefetchers:  # which shards come next depends only on the position
                prefetcher.advance(self.consumed_global_batches)
            start = time.perf_counter()
            batch = next(batches, None)
            self.wait_s += time.perf_counter() - start
            if batch is None:
                return
            self._delivered += 1
            yield batch

    def data_scalars(self, phase: int) -> dict[str, float]:
        """TensorBoard scalars of this loader so far: seconds waited for batches, and per shard set read from a URL
        the bytes downloaded and the seconds this rank's processes waited for a shard to arrive."""
        out = {f"data/phase{phase}/loader_wait_s": self.wait_s}
        for k, cache in enumerate(self.caches):
            name = f"data/phase{phase}/store{k}" if len(self.caches) > 1 else f"data/phase{phase}/store"
            out[f"{name}/downloaded_bytes"] = float(cache.stats[0])
            out[f"{name}/fetch_wait_s"] = float(cache.stats[2])
        return out

    @property
    def caches(self) -> list[ShardCache]:
        """The node-local caches of the shard sets this loader reads from URLs (their ``stats``: bytes
        downloaded, downloads, seconds waited for a shard)."""
        return [p.cache for p in self.prefetchers]

    def describe(self, steps: int) -> list[str]:
        """Lines saying what each source of a mix gives over ``steps`` global batches; none for one shard set."""
        return []

    def _position(self) -> dict:
        consumed, into = divmod(self._delivered, self._dataset.accumulation)
        return {"consumed_global_batches": consumed, "micro_steps_into_global_batch": into,
                "world_size": self._dataset.world_size, "micro_batch_size": self._dataset.micro_batch_size}

    def _check_state(self, state: dict, skip: tuple[str, ...]) -> tuple[int, int]:
        """Refuse another format, a fingerprint field (but ``skip``) that differs, or a mid-global-batch state saved
        with another world size or micro batch size; returns (consumed global batches, micro steps into the next)."""
        if state.get("format") != STATE_FORMAT:
            raise BadInput(f"loader state: field 'format' is {state.get('format')!r}, expected {STATE_FORMAT!r}")
        for name, want in self._fingerprint.items():
            if name in skip:
                continue
            if state.get(name) != want:
                raise BadInput(f"loader state: field '{name}' is {state.get(name)!r} but this loader has "
                               f"{want!r}; resuming would not continue the same sample stream")
        consumed = int(state["consumed_global_batches"])
        into = int(state["micro_steps_into_global_batch"])
        if into:
            same = (state.get("world_size") == self._dataset.world_size
                    and state.get("micro_batch_size") == self._dataset.micro_batch_size)
            if not same:
                raise BadInput(
                    f"loader state is {into} micro step(s) into global batch {consumed} (saved with "
                    f"world_size={state.get('world_size')}, micro_batch_size={state.get('micro_batch_size')}); "
                    f"with world_size={self._dataset.world_size}, micro_batch_size={self._dataset.micro_batch_size} "
                    "it can only resume on a global-batch boundary: save at the end of an optimizer step")
        return consumed, into


class ShardLoader(_TrainLoader):
    """Infinite training loader of one shard set; see the module docstring. Build it with :func:`build_loader`."""

    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch (the incomplete tail of each epoch is dropped)."""
        return self._dataset.batches_per_epoch

    @property
    def epoch(self) -> int:
        """Epoch of the next micro batch."""
        return self.consumed_global_batches // self._dataset.batches_per_epoch

    def sample_ids(self, m: int) -> np.ndarray:
        """Global sample ids of this rank's micro batch ``m`` (counted from the start of training)."""
        return self._dataset.sample_ids(m)[1]

    def state_dict(self) -> dict:
        """JSON-serialisable position: micro batches delivered to the consumer, as global batches + remainder."""
        position = self._position()
        return {
            "format": STATE_FORMAT,
            **self._fingerprint,
            "consumed_global_batches": position["consumed_global_batches"],
            "micro_steps_into_global_batch": position["micro_steps_into_global_batch"],
            "world_size": position["world_size"],
            "micro_batch_size": position["micro_batch_size"],
            "epoch": position["consumed_global_batches"] // self._dataset.batches_per_epoch,
        }

    def load_state_dict(self, state: dict, *, continue_with_new_mix: bool = False) -> None:
        """Resume from :meth:`state_dict` (call before iterating). Refuses a state from another data stream (a mixed
        run's included, whatever ``continue_with_new_mix`` says), and a mid-global-batch state when the world size
        or micro batch size changed."""
        if "mix" in state:
            names = [entry.get("source") for entry in state["mix"]]
            raise BadInput(f"loader state: field 'mix' lists {names}: the checkpoint read a weighted mix, this run "
                           "one unweighted shard set; give --data the mix, or use a new --output")
        # changing the masking recipe on resume is allowed; it does not move the sample stream
        consumed, into = self._check_state(state, skip=("dynamic_masking",))
        self._delivered = consumed * self._dataset.accumulation + into


class MixedShardLoader(_TrainLoader):
    """Infinite training loader of a weighted mix (:mod:`bert_ds.data.mix`). Build it with :func:`build_loader`."""

    def __init__(self, dataset: MixedMicroBatches, sources: list[Source], sizes: list[int], seq_len: int, **kwargs):
        super().__init__(dataset, **kwargs)
        self.sources = sources
        self.sizes = sizes
        self.seq_len = seq_len

    def sample_refs(self, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source index, source epoch, sample id within the source) of each row of this rank's micro batch ``m``."""
        return self._dataset.sample_refs(m)

    def source_samples(self, global_batch: int) -> np.ndarray:
        """Samples of each source drawn by global batches ``[0, global_batch)``."""
        return self._dataset.schedule.counts_before(global_batch)

    def describe(self, steps: int) -> list[str]:
        """One line per source: weight, samples and epochs over ``steps`` global batches, tokens (padded)."""
        return mix_summary(self.sources, self.sizes, self.source_samples(steps), self.seq_len, steps)

    def state_dict(self) -> dict:
        """The position (as :class:`ShardLoader`'s) plus each source's samples drawn before the next global batch."""
        position = self._position()
        samples = self.source_samples(position["consumed_global_batches"])
        return {"format": STATE_FORMAT, **self._fingerprint, **position, "source_samples": samples.tolist()}

    def load_state_dict(self, state: dict, *, continue_with_new_mix: bool = False) -> None:
        """Resume from :meth:`state_dict` (call before iterating). A state whose mix (sources, weights, order)
        differs is refused (:class:`MixChangedError`) unless ``continue_with_new_mix``: then the new mix starts at
        the saved global batch, each source kept goes on where it was, a new one from its start."""
        if not isinstance(state.get("mix"), list):
            raise BadInput("loader state: field 'mix' is missing: the checkpoint read one unweighted shard set, "
                           "this run a weighted mix; an unweighted run cannot become a mix on resume: use the "
                           "original --data or a new --output")
        consumed, into = self._check_state(state, skip=("dynamic_masking", "mix", "mix_rule"))
        changes = mix_changes(state["mix"], self._fingerprint["mix"]) + rule_changes(state.get("mix_rule"))
        saved = check_source_samples(state, len(state["mix"]), consumed * self._dataset.global_batch_size)
        if changes and not continue_with_new_mix:
            raise MixChangedError(f"loader state: the data mix differs from the checkpoint's: {'; '.join(changes)}")
        if changes:
            if into:
                raise BadInput(f"loader state is {into} micro step(s) into global batch {consumed}: a new mix can "
                               "only start on a global-batch boundary")
            by_sha = {e["shard_set_sha256"]: n for e, n in zip(state["mix"], saved, strict=True)}
            saved = [by_sha.get(e["shard_set_sha256"], 0) for e in self._fingerprint["mix"]]
            self.mix_change = "; ".join(changes)
        self._dataset.schedule.set_base(consumed, np.asarray(saved, dtype=np.int64))
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
        return iterate(self._dataset, iter(range(len(self._dataset))), self.num_workers, self.prefetch_factor,
                        self._dataset.collate.seed)


# -------------------------------------------------------------------------------------------------------- builders
def _open_checked(data_dir: str | Path, *, expected_seq_len: int | None, expected_vocab_sha256: str | None,
                  dynamic_masking: DynamicMasking | None, max_predictions: int | None,
                  verify: str, max_open_shards: int = 32) -> tuple[ShardReader, int]:
    """Load + check index.json and shard sizes; return the reader and the prediction slots per row."""
    cache = open_cache(str(data_dir)) if is_url(data_dir) else None
    index = cache.index if cache is not None else ShardIndex.load(data_dir)
    where = str(data_dir)
    index.check_compatible(seq_len=expected_seq_len, vocab_sha256=expected_vocab_sha256, where=where)
    if dynamic_masking is not None:
        index.check_compatible(vocab_size=dynamic_masking.vocab_size, where=where)
    reader = ShardReader(cache.dir if cache is not None else data_dir, verify=verify, index=index,
                         max_open_shards=max_open_shards, fetch=cache.ensure if cache is not None else None)
    if reader.num_samples == 0:
        raise BadInput(f"{where}/index.json lists no samples")
    for shard in range(reader.num_shards if cache is None else 0):  # one stat per shard (a URL's: fetched later)
        reader.check_size(shard)
    if dynamic_masking is not None:
        needed = dynamic_masking.resolved_max_predictions(index.seq_len)
    else:
        needed = index.masking.get("max_predictions")
        if needed is None:
            raise BadInput(f"{where}/index.json: field 'masking.max_predictions' missing; pass max_predictions=")
    if max_predictions is None:
        max_predictions = int(needed)
    elif max_predictions < needed:
        raise BadInput(f"max_predictions={max_predictions} is below the {needed} predictions per sample "
                       f"{'dynamic masking makes' if dynamic_masking else 'index.json allows'}")
    return reader, max_predictions


def _check_rank(rank: int, world_size: int, micro_batch_size: int, num_workers: int) -> None:
    if world_size <= 0 or not 0 <= rank < world_size:
        raise BadInput(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
    if micro_batch_size <= 0:
        raise BadInput(f"micro_batch_size={micro_batch_size}: must be positive")
    if num_workers < 0:
        raise BadInput(f"num_workers={num_workers}: must be >= 0")


def build_loader(data_dir: str | Path | Sequence[Source], *, global_batch_size: int, micro_batch_size: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0, num_workers: int = 2,
                 expected_seq_len: int | None = None, expected_vocab_sha256: str | None = None,
                 max_predictions: int | None = None, dynamic_masking: DynamicMasking | None = None,
                 shuffle: bool = True, verify: str = "sha256", shuffle_window_shards: int = 8,
                 prefetch_factor: int = 2) -> ShardLoader | MixedShardLoader:
    """The infinite training loader for this rank; ``gradient_accumulation_steps = G // (M * W)`` must be exact.

    ``data_dir`` is one shard directory, or a list of :class:`~bert_ds.data.mix.Source`: one unweighted source is
    the same single-set loader, anything else a weighted mix (:class:`MixedShardLoader`)."""
    _check_rank(rank, world_size, micro_batch_size, num_workers)
    per_step = micro_batch_size * world_size
    if global_batch_size <= 0 or global_batch_size % per_step:
        raise BadInput(f"global_batch_size={global_batch_size} is not a multiple of micro_batch_size * "
                       f"world_size = {micro_batch_size} * {world_size} = {per_step}")
    options = dict(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, rank=rank,
                   world_size=world_size, seed=seed, num_workers=num_workers, expected_seq_len=expected_seq_len,
                   expected_vocab_sha256=expected_vocab_sha256, max_predictions=max_predictions,
                   dynamic_masking=dynamic_masking, shuffle=shuffle, verify=verify,
                   shuffle_window_shards=shuffle_window_shards, prefetch_factor=prefetch_factor)
    if isinstance(data_dir, str | Path):
        return _single_loader(data_dir, **options)
    if not is_mix(data_dir):
        return _single_loader(data_dir[0].path, **options)
    return _mixed_loader(list(data_dir), **options)


def _single_loader(data_dir: str | Path, *, global_batch_size: int, micro_batch_size: int, rank: int,
                   world_size: int, seed: int, num_workers: int, expected_seq_len: int | None,
                   expected_vocab_sha256: str | None, max_predictions: int | None,
                   dynamic_masking: DynamicMasking | None, shuffle: bool, verify: str, shuffle_window_shards: int,
                   prefetch_factor: int) -> ShardLoader:
    # A batch touches at most two windows; keep both mapped so no shard is rescanned mid-window.
    reader, p = _open_checked(data_dir, expected_seq_len=expected_seq_len,
                              expected_vocab_sha256=expected_vocab_sha256, dynamic_masking=dynamic_masking,
                              max_predictions=max_predictions, verify=verify,
                              max_open_shards=max(32, 2 * shuffle_window_shards + 2))
    if reader.num_samples < global_batch_size:
        raise BadInput(f"{data_dir}: {reader.num_samples} samples is less than one global batch "
                       f"({global_batch_size})")
    index = reader.index
    order = EpochOrder([s.samples for s in index.shards], seed=seed, shuffle=shuffle,
                       window_shards=shuffle_window_shards)
    collate = Collator(reader, seq_len=index.seq_len, max_predictions=p, dynamic_masking=dynamic_masking,
                        seed=seed)
    dataset = _MicroBatches(order, collate, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                            rank=rank, world_size=world_size)
    per_epoch = dataset.batches_per_epoch  # an epoch's dropped tail: batch b starts at epoch b // per_epoch
    prefetchers = _prefetchers([reader], [order], global_batch_size,
                               lambda k, b: (b // per_epoch) * order.num_samples + (b % per_epoch) * global_batch_size)
    fingerprint = {
        "seed": seed, "global_batch_size": global_batch_size, "shuffle": shuffle,
        "shuffle_window_shards": shuffle_window_shards, "num_samples": reader.num_samples,
        "shard_set_sha256": _shard_set_sha256(index),
        "dynamic_masking": dynamic_masking.describe() if dynamic_masking is not None else None,
    }
    loader = ShardLoader(dataset, num_workers=num_workers, prefetch_factor=prefetch_factor, fingerprint=fingerprint)
    loader.prefetchers = prefetchers
    return loader


def _prefetchers(readers: list[ShardReader], orders: list[EpochOrder], global_batch_size: int, drawn) -> list:
    """A :class:`Prefetcher` per reader of a URL's shard set; ``drawn(k, b)`` is the samples source ``k`` gave
    global batches ``[0, b)`` (its position in its own order, counted across epochs). The window: the shuffle
    windows read by global batches ``b - 1`` and ``b``, and ``ahead_windows`` more; a ``--cache-limit`` below its
    largest possible size is refused here, before any compute."""
    out = []
    for k, (reader, order) in enumerate(zip(readers, orders, strict=True)):
        cache = getattr(reader.fetch, "__self__", None)
        if not isinstance(cache, ShardCache):
            continue
        ahead = cache.options.ahead_windows
        smallest = int(order.counts.min()) * order.window_shards
        spanned = -(-2 * global_batch_size // smallest) + 1 if smallest > 0 else len(order.counts)
        cache.check_limit((spanned + ahead) * order.window_shards)

        def window(b: int, k=k, order=order, ahead=ahead) -> list[int]:
            return order.shards_for(drawn(k, max(b - 1, 0)), drawn(k, b + 1), ahead)

        out.append(Prefetcher(cache, window, concurrency=cache.options.concurrency))
    return out


def _shard_set_sha256(index: ShardIndex) -> str:
    """A shard set's identity: its shards' names, sample counts and checksums."""
    shard_list = json.dumps([[s.name, s.samples, s.sha256] for s in index.shards])
    return hashlib.sha256(shard_list.encode()).hexdigest()


def _open_sources(sources: list[Source], *, expected_seq_len: int | None, expected_vocab_sha256: str | None,
                  dynamic_masking: DynamicMasking | None, max_predictions: int | None, verify: str,
                  shuffle_window_shards: int) -> tuple[list[ShardReader], int]:
    """Every source opened and checked like a single set, all with one seq_len and vocabulary; each error names the
    source. Returns the readers and the prediction slots per row (the most any source needs)."""
    readers, slots = [], []
    for source in sources:
        try:
            reader, p = _open_checked(source.path, expected_seq_len=expected_seq_len,
                                      expected_vocab_sha256=expected_vocab_sha256, dynamic_masking=dynamic_masking,
                                      max_predictions=max_predictions, verify=verify,
                                      max_open_shards=max(32, 2 * shuffle_window_shards + 2))
        except (ValueError, FileNotFoundError) as exc:
            raise type(exc)(f"mix source {source.name!r}: {exc}") from None
        readers.append(reader)
        slots.append(p)
        first, this = readers[0].index, reader.index
        for name in ("seq_len", "vocab_sha256"):
            if getattr(this, name) != getattr(first, name):
                raise BadInput(f"mix source {source.name!r}: {source.path}/index.json field '{name}' is "
                               f"{getattr(this, name)!r} but source {sources[0].name!r} has {getattr(first, name)!r}")
    return readers, max(slots)


def _mixed_loader(sources: list[Source], *, global_batch_size: int, micro_batch_size: int, rank: int,
                  world_size: int, seed: int, num_workers: int, expected_seq_len: int | None,
                  expected_vocab_sha256: str | None, max_predictions: int | None,
                  dynamic_masking: DynamicMasking | None, shuffle: bool, verify: str, shuffle_window_shards: int,
                  prefetch_factor: int) -> MixedShardLoader:
    readers, p = _open_sources(sources, expected_seq_len=expected_seq_len, expected_vocab_sha256=expected_vocab_sha256,
                               dynamic_masking=dynamic_masking, max_predictions=max_predictions, verify=verify,
                               shuffle_window_shards=shuffle_window_shards)
    hashes = [_shard_set_sha256(r.index) for r in readers]
    for i, sha in enumerate(hashes):
        if hashes.index(sha) != i:
            raise BadInput(f"mix sources {sources[hashes.index(sha)].name!r} and {sources[i].name!r} hold the same "
                           "shard set; list it once with the sum of the weights")
    seeds = [source_seed(seed, sha) for sha in hashes]
    orders = [EpochOrder([s.samples for s in r.index.shards], seed=k, shuffle=shuffle,
                         window_shards=shuffle_window_shards) for r, k in zip(readers, seeds, strict=True)]
    seq_len = readers[0].index.seq_len
    collators = [Collator(r, seq_len=seq_len, max_predictions=p, dynamic_masking=dynamic_masking, seed=k)
                 for r, k in zip(readers, seeds, strict=True)]
    schedule = MixSchedule([s.weight for s in sources], global_batch_size, seed)
    dataset = MixedMicroBatches(schedule, orders, collators, global_batch_size=global_batch_size,
                                micro_batch_size=micro_batch_size, rank=rank, world_size=world_size, seed=seed)
    fingerprint = {
        "seed": seed, "global_batch_size": global_batch_size, "shuffle": shuffle,
        "shuffle_window_shards": shuffle_window_shards,
        "mix": [{"source": s.path, "shard_set_sha256": sha, "num_samples": r.num_samples, "weight": s.weight}
                for s, sha, r in zip(sources, hashes, readers, strict=True)],
        "mix_rule": MIX_RULE,
        "dynamic_masking": dynamic_masking.describe() if dynamic_masking is not None else None,
    }
    loader = MixedShardLoader(dataset, sources, [r.num_samples for r in readers], seq_len, num_workers=num_workers,
                              prefetch_factor=prefetch_factor, fingerprint=fingerprint)
    loader.prefetchers = _prefetchers(readers, orders, global_batch_size,
                                      lambda k, b: int(schedule.counts_before(max(b, schedule.base_batch))[k]))
    return loader


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
    collate = Collator(reader, seq_len=reader.index.seq_len, max_predictions=p, dynamic_masking=dynamic_masking,
                        seed=seed)
    dataset = _EvalBatches(reader.num_samples, collate, micro_batch_size=micro_batch_size, rank=rank,
                           world_size=world_size)
    return EvalLoader(dataset, num_workers=num_workers, prefetch_factor=prefetch_factor)
