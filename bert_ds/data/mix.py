"""Weighted mixes of shard sets: which source each position of a global batch reads, the same on every rank.

A phase reads one shard set, or several, each with a weight (``--data wiki128/:3,books128/:1``). The rule:

* Global batch ``b`` takes ``counts_b = multinomial(G, weights / sum(weights))`` samples from the sources, drawn from
  a generator seeded by ``(seed, b)`` alone, and places them in an order permuted by the same generator. Nothing
  depends on the rank count, micro batch size or worker count, so every rank count sees the same global sequence.
* Source ``s`` is read in its own order (an :class:`~bert_ds.data.epoch_order.EpochOrder` seeded by the loader seed and
  the source's shard-set hash): its ``k``-th sample is position ``k % N_s`` of its epoch ``k // N_s``. A source that
  runs out starts its next epoch (upsampling); no epoch tail is dropped within a source.
* Where a global batch starts in each source is the sum of the earlier batches' counts: computed forward from a base
  (batch 0, or a resumed batch with the per-source counts saved in the loader state), so a resume costs nothing.

One unweighted set is not a mix: it keeps the single-set loader and its sample order (:mod:`bert_ds.data.loader`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert_ds.data.collate import Collator
from bert_ds.data.epoch_order import EpochOrder
from bert_ds.data.reader import ShardReader

__all__ = ["Source", "parse_sources", "is_mix", "source_seed", "MixSchedule", "MixedMicroBatches", "MixReaders",
           "MixChangedError", "mix_changes", "check_source_samples", "mix_summary"]

_TAG_MIX = 0x4D4958  # the per-global-batch source draw: default_rng([seed, batch, _TAG_MIX])
_READ_AHEAD = 4096  # stream positions of a source looked up at once (two int64 arrays of this length per source)


@dataclass(frozen=True)
class Source:
    """One shard set of a phase and its weight (None: the single unweighted set of today's loader)."""

    path: str
    weight: float | None = None

    @property
    def name(self) -> str:
        """What logs, eval JSON and TensorBoard call it: the directory's last component."""
        return Path(self.path).name or self.path


def parse_sources(spec: str, flag: str, *, weighted: bool = True) -> list[Source]:
    """``dir`` or ``dir:w,dir:w,...`` -> sources. With ``weighted=False`` (eval data) weights are refused. Errors name
    the flag and the element: a weight that is not a positive finite number, a mix with an unweighted element, a
    directory or a name listed twice."""
    sources = []
    for element in spec.split(","):
        if not element:
            raise ValueError(f"{flag} {spec!r}: an empty element; separate shard directories by single commas")
        path, sep, weight_text = element.rpartition(":")
        if not sep:
            sources.append(Source(element))
            continue
        if not weighted:
            raise ValueError(f"{flag} {element!r}: eval data takes no weight; list the directories as dir,dir")
        try:
            weight = float(weight_text)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0) or not path:
            raise ValueError(f"{flag} {element!r}: weight {weight_text!r} is not a positive number (give dir:weight)")
        sources.append(Source(path, weight))
    if weighted and len(sources) > 1 and any(s.weight is None for s in sources):
        bare = next(s.path for s in sources if s.weight is None)
        raise ValueError(f"{flag} {spec!r}: {bare!r} has no weight; give every set of a mix one (dir:weight)")
    for attr in ("path", "name"):
        seen = [str(Path(s.path).resolve()) if attr == "path" else s.name for s in sources]
        dup = next((x for x in seen if seen.count(x) > 1), None)
        if dup is not None:
            raise ValueError(f"{flag} {spec!r}: {'directory' if attr == 'path' else 'name'} {dup!r} is listed twice; "
                             "each source of a mix needs its own directory name")
    return sources


def is_mix(sources: Sequence[Source]) -> bool:
    """Whether ``sources`` go through the mixed loader (several sets, or one with a weight)."""
    return len(sources) > 1 or sources[0].weight is not None


def source_seed(seed: int, shard_set_sha256: str) -> int:
    """The seed of one source's own order and masks: the loader seed and the source's content, not its list position,
    so re-ordering or adding sources (``--continue-with-new-mix``) keeps each source's stream."""
    digest = hashlib.blake2b(f"bert_ds.mix/{seed}/{shard_set_sha256}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class MixChangedError(ValueError):
    """A resume whose mix (sources, weights or their order) is not the checkpoint's, asked for no new mix."""


def mix_changes(saved: list, current: list) -> list[str]:
    """What differs between two loader-state ``mix`` lists (sources matched by shard-set hash), one phrase each."""
    old = {e.get("shard_set_sha256"): e for e in saved if isinstance(e, dict)}
    new = {e["shard_set_sha256"]: e for e in current}
    changes = []
    for sha, e in new.items():
        if sha not in old:
            changes.append(f"source {e['source']!r} added (weight {e['weight']:g})")
        elif old[sha].get("weight") != e["weight"]:
            changes.append(f"source {e['source']!r} weight {old[sha].get('weight')!r} -> {e['weight']:g}")
    changes += [f"source {e.get('source')!r} (shard set {str(sha)[:12]}...) removed" for sha, e in old.items()
                if sha not in new]
    kept_old = [sha for sha in old if sha in new]
    kept_new = [sha for sha in new if sha in old]
    if not changes and kept_old != kept_new:
        changes.append(f"sources listed in another order ({[new[s]['source'] for s in kept_new]})")
    return changes


def check_source_samples(state: dict, n_sources: int, drawn: int) -> list[int]:
    """The state's ``source_samples``: one non-negative integer per saved source, summing to the samples drawn."""
    counts = state.get("source_samples")
    ok = (isinstance(counts, list) and len(counts) == n_sources
          and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts) and sum(counts) == drawn)
    if not ok:
        raise ValueError(f"loader state: field 'source_samples' is {counts!r:.120}, need {n_sources} non-negative "
                         f"integers summing to the {drawn} samples its global batches drew")
    return counts


def mix_summary(sources: Sequence[Source], sizes: Sequence[int], counts: np.ndarray, seq_len: int,
                steps: int) -> list[str]:
    """The start-of-phase lines: per source its weight and share, samples drawn over ``steps`` global batches, the
    epochs of the source they make, and their tokens padded to ``seq_len``."""
    total = sum(s.weight for s in sources)
    lines = [f"data mix over {steps} global batches ({int(counts.sum())} samples):"]
    for source, size, n in zip(sources, sizes, counts.tolist(), strict=True):
        lines.append(f"  {source.name}: weight {source.weight:g} ({100 * source.weight / total:.1f}%), {n} samples = "
                     f"{n / size:.2f} epochs of {size}, {n * seq_len} tokens (padded to seq_len {seq_len}) "
                     f"[{source.path}]")
    return lines


class MixSchedule:
    """Global batch -> source of each of its positions, and each source's samples drawn before it (from a base)."""

    def __init__(self, weights: Sequence[float], global_batch_size: int, seed: int):
        w = np.asarray(weights, dtype=np.float64)
        self.probs = w / w.sum()
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.set_base(0, np.zeros(len(w), dtype=np.int64))

    def set_base(self, batch: int, counts: np.ndarray) -> None:
        """Counts of every source drawn by batches ``[0, batch)``: the point the schedule computes forward from."""
        self.base_batch = batch
        self._cumulative = [np.asarray(counts, dtype=np.int64)]  # _cumulative[i]: counts before base_batch + i
        self._last: tuple[int, np.ndarray] | None = None

    def _draw(self, batch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, batch, _TAG_MIX])

    def batch_counts(self, batch: int) -> np.ndarray:
        if self._last is not None and self._last[0] == batch:  # the counts of the drawn positions: no second draw
            return np.bincount(self._last[1], minlength=len(self.probs)).astype(np.int64)
        return self._draw(batch).multinomial(self.global_batch_size, self.probs).astype(np.int64)

    def batch_sources(self, batch: int) -> np.ndarray:
        """(G,) source index of each position of global batch ``batch``."""
        if self._last is None or self._last[0] != batch:
            rng = self._draw(batch)
            counts = rng.multinomial(self.global_batch_size, self.probs)  # the same first draw as batch_counts
            sources = np.repeat(np.arange(len(counts)), counts)
            rng.shuffle(sources)
            self._last = (batch, sources)
        return self._last[1]

    def counts_before(self, batch: int) -> np.ndarray:
        """(S,) samples of each source drawn by the batches before ``batch`` (``batch`` >= the base)."""
        i = batch - self.base_batch
        if i < 0:
            raise IndexError(f"global batch {batch} precedes the schedule's base {self.base_batch}")
        while len(self._cumulative) <= i:
            done = self.base_batch + len(self._cumulative) - 1
            self._cumulative.append(self._cumulative[-1] + self.batch_counts(done))
        return self._cumulative[i]


class MixReaders:
    """The sources' readers seen as one :class:`~bert_ds.data.reader.ShardReader` by a collator and the worker
    machinery: shards and samples numbered source after source. ``reading`` reaches every reader (a shard number is
    offset by the shards of the sources before it); ``shard_path`` and ``member_name`` name a shard in its source."""

    def __init__(self, readers: Sequence[ShardReader]):
        self.readers = list(readers)
        self.index = self.readers[0].index  # vocab_size and seq_len: the loader checked every source has the same
        self.offsets = np.concatenate([[0], np.cumsum([r.num_shards for r in self.readers])]).astype(np.int64)
        self.sample_offsets = np.concatenate([[0], np.cumsum([r.num_samples for r in self.readers])]).astype(np.int64)
        self.shard_starts = np.concatenate([r.shard_starts[:-1] + o for r, o in
                                            zip(self.readers, self.sample_offsets, strict=False)] +
                                           [self.sample_offsets[-1:]]).astype(np.int64)
        # a list, not a search: looked up once per sample read
        self._by_shard = [(r, local) for r in self.readers for local in range(r.num_shards)]

    def locate(self, global_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mix-wide sample ids -> (mix-wide shard, index within the shard)."""
        global_ids = np.asarray(global_ids, dtype=np.int64)
        shards = np.searchsorted(self.shard_starts, global_ids, side="right") - 1
        return shards, global_ids - self.shard_starts[shards]

    def _source(self, shard: int) -> tuple[ShardReader, int]:
        return self._by_shard[shard]

    def sample(self, shard: int, index: int):
        reader, local = self._by_shard[shard]  # not through _source: one call less per sample read
        return reader.sample(local, index)

    def member_name(self, shard: int, index: int) -> str:
        reader, local = self._source(shard)
        return reader.member_name(local, index)

    @property
    def reading(self):
        return None

    @reading.setter
    def reading(self, view) -> None:
        for reader, offset in zip(self.readers, self.offsets, strict=False):
            reader.reading = None if view is None else _OffsetSlot(view, int(offset))

    def shard_path(self, shard: int) -> tuple[Path, str]:
        reader, local = self._source(shard)
        return reader.shard_path(local)


class _OffsetSlot:
    """A worker's (shard, index) slot as one source's reader writes it: its shard number offset into the mix's."""

    def __init__(self, view: np.ndarray, offset: int):
        self.view = view
        self.offset = offset

    def __setitem__(self, i: int, value: int) -> None:
        self.view[i] = value + (self.offset if i == 0 else 0)


class _WholeCollator(Collator):
    """A collator over :class:`MixReaders` that reads a row straight from its source's reader (one call per sample,
    as over a single set)."""

    def _sample(self, shard: int, index: int):
        reader, local = self.reader._by_shard[shard]
        sample = reader.sample(local, index)
        if sample.length > self.seq_len:
            return super()._sample(shard, index)  # refused there, the same message
        return sample


class _MixCollate:
    """What the loaders' worker machinery asks of a collator: ``reader``, ``seed`` and ``unpack``; with static masks
    one collator reads the whole micro batch through :class:`MixReaders` (``whole``)."""

    def __init__(self, collators: Sequence[Collator], seed: int):
        self.collators = list(collators)
        self.reader = MixReaders([c.reader for c in collators])
        self.seed = seed
        first = self.collators[0]
        self.whole = None
        if first.dynamic is None:  # static masks depend on no seed or epoch: one pass over every source's rows
            self.whole = _WholeCollator(self.reader, seq_len=first.seq_len, max_predictions=first.max_predictions,
                                        dynamic_masking=None, seed=seed)

    def unpack(self, flat: np.ndarray):
        return self.collators[0].unpack(flat)


class MixedMicroBatches:
    """Map-style: item ``m`` is this rank's ``m``-th training micro batch of a mix (``m`` counts across the phase)."""

    def __init__(self, schedule: MixSchedule, orders: Sequence[EpochOrder], collators: Sequence[Collator], *,
                 global_batch_size: int, micro_batch_size: int, rank: int, world_size: int, seed: int):
        self.schedule = schedule
        self.orders = list(orders)
        self.collate = _MixCollate(collators, seed)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.accumulation = global_batch_size // (micro_batch_size * world_size)
        self.sizes = np.asarray([o.num_samples for o in self.orders], dtype=np.int64)
        self._refs: tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        self._ahead: list[tuple[int, np.ndarray, np.ndarray] | None] = [None] * len(self.orders)

    def global_refs(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source, source epoch, sample id within the source) of every position of global batch ``batch``, built
        once per global batch (its micro batches are slices of it) and read-only."""
        if self._refs is not None and self._refs[0] == batch:
            return self._refs[1]
        before = self.schedule.counts_before(batch)  # first: its last step reuses the previous batch's draw
        src = self.schedule.batch_sources(batch)
        epochs = np.empty(len(src), dtype=np.int64)
        ids = np.empty(len(src), dtype=np.int64)
        for s in range(len(self.orders)):
            rows = np.flatnonzero(src == s)  # this source's positions, in batch order: consecutive in its stream
            if rows.shape[0]:
                epochs[rows], ids[rows] = self._stream(s, int(before[s]), rows.shape[0])
        refs = (src, epochs, ids)
        for array in refs:
            array.flags.writeable = False  # micro batches are views of the cache
        self._refs = (batch, refs)
        return refs

    def _stream(self, s: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, sample id) of source ``s``'s stream positions ``[k, k + n)``, from a read-ahead of at least
        ``_READ_AHEAD`` positions (one :meth:`EpochOrder.ids` call per epoch touched, not per global batch)."""
        start, epochs, ids = self._ahead[s] or (0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        if not start <= k <= k + n <= start + len(ids):
            size, want, e_parts, i_parts = int(self.sizes[s]), max(n, _READ_AHEAD), [], []
            done = 0
            while done < want:  # one run per source epoch touched (more than one where the source runs out)
                epoch, first = divmod(k + done, size)
                take = min(want - done, size - first)
                e_parts.append(np.full(take, epoch, dtype=np.int64))
                i_parts.append(self.orders[s].ids(epoch, first, first + take))
                done += take
            start, epochs, ids = k, np.concatenate(e_parts), np.concatenate(i_parts)
            self._ahead[s] = (start, epochs, ids)
        return epochs[k - start:k - start + n], ids[k - start:k - start + n]

    def sample_refs(self, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source, source epoch, sample id within the source) of each row of micro batch ``m`` (read-only views)."""
        batch, micro_step = divmod(m, self.accumulation)
        start = (micro_step * self.world_size + self.rank) * self.micro_batch_size
        return tuple(a[start:start + self.micro_batch_size] for a in self.global_refs(batch))

    def __getitem__(self, m: int) -> np.ndarray:
        sources, epochs, ids = self.sample_refs(m)
        if self.collate.whole is not None:
            return self.collate.whole(self.collate.reader.sample_offsets[sources] + ids, 0)
        # dynamic masks are keyed by each source's seed and epoch: one collator call per (source, epoch)
        collators = self.collate.collators
        out = np.zeros(len(ids) * collators[0].row_width(), dtype=np.int32)
        for s, e in sorted({(int(s), int(e)) for s, e in zip(sources, epochs, strict=True)}):
            rows = np.flatnonzero((sources == s) & (epochs == e))
            collators[s].place(out, len(ids), rows, collators[s](ids[rows], e))
        return out
