"""Weighted mixes of shard sets: which source each position of a global batch reads, the same on every rank.

A phase reads one shard set, or several, each with a weight (``--data wiki128/:3,books128/:1``). The rule:

* Global batch ``b`` takes ``counts_b = multinomial(G, weights / sum(weights))`` samples from the sources and places
  them in a random order, both pure functions of ``(seed, b)`` with no generator seeded per batch: ``counts_b`` is row
  ``b % 256`` of the 256 multinomial draws a Philox stream keyed by the seed makes from counter ``b // 256``; the order
  is the counts laid out source by source and permuted by the stable argsort of ``G`` SplitMix64 uniforms keyed by
  ``(seed, b)`` (:func:`bert_ds.data.masking.counter_uniforms`). :data:`MIX_RULE` names this rule in the loader state.
  Nothing depends on the rank count, micro batch size or worker count, so every rank count sees the same sequence.
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
from bert_ds.data.masking import counter_hash, counter_uniforms
from bert_ds.data.reader import ShardReader
from bert_ds.errors import BadInput

__all__ = ["Source", "parse_sources", "is_mix", "source_seed", "MixSchedule", "MixedMicroBatches", "MixReaders",
           "MixChangedError", "mix_changes", "rule_changes", "check_source_samples", "mix_summary", "MIX_RULE"]

MIX_RULE = 2
"""The rule that draws each global batch's sources, saved in the loader state (``mix_rule``). 1 (no field): a
``default_rng([seed, batch, tag])`` per global batch drew its counts and shuffled them; 2: the module docstring's."""
_TAG_COUNTS, _TAG_ORDER = 0x4D495843, 0x4D49584F  # the counts' Philox key (seed, tag); the order's SplitMix64 key word
_COUNT_BLOCK = 256  # global batches whose counts one Philox counter draws
_READ_AHEAD = 4096  # stream positions of a source looked up at once (two int64 arrays of this length per source)
_REFS_AHEAD = 4096  # positions of consecutive global batches whose refs are built at once (at least one batch)


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
            raise BadInput(f"{flag} {spec!r}: an empty element; separate shard directories by single commas")
        path, sep, weight_text = element.rpartition(":")
        if "/" in weight_text or "://" not in path and "://" in element:  # a URL's scheme or port, not a weight
            sep = ""
        if not sep:
            sources.append(Source(element))
            continue
        if not weighted:
            raise BadInput(f"{flag} {element!r}: eval data takes no weight; list the directories as dir,dir")
        try:
            weight = float(weight_text)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0) or not path:
            raise BadInput(f"{flag} {element!r}: weight {weight_text!r} is not a positive number (give dir:weight)")
        sources.append(Source(path, weight))
    if weighted and len(sources) > 1 and any(s.weight is None for s in sources):
        bare = next(s.path for s in sources if s.weight is None)
        raise BadInput(f"{flag} {spec!r}: {bare!r} has no weight; give every set of a mix one (dir:weight)")
    for attr in ("path", "name"):
        seen = [(s.path.rstrip("/") if "://" in s.path else str(Path(s.path).resolve())) if attr == "path"
                else s.name for s in sources]
        dup = next((x for x in seen if seen.count(x) > 1), None)
        if dup is not None:
            raise BadInput(f"{flag} {spec!r}: {'directory' if attr == 'path' else 'name'} {dup!r} is listed twice; "
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


class MixChangedError(BadInput):
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


def rule_changes(saved_rule) -> list[str]:
    """A loader state's ``mix_rule`` (None: saved before the field existed, rule 1) against :data:`MIX_RULE`: one
    phrase when they differ (the same sources and weights would draw other global batches from here on)."""
    if (1 if saved_rule is None else saved_rule) == MIX_RULE:
        return []
    was = "missing (rule 1, an older bert_ds)" if saved_rule is None else repr(saved_rule)
    return [f"field 'mix_rule' is {was} but this bert_ds draws the mix by rule {MIX_RULE}: the sample order from "
            "the saved step on would differ"]


def check_source_samples(state: dict, n_sources: int, drawn: int) -> list[int]:
    """The state's ``source_samples``: one non-negative integer per saved source, summing to the samples drawn."""
    counts = state.get("source_samples")
    ok = (isinstance(counts, list) and len(counts) == n_sources
          and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts) and sum(counts) == drawn)
    if not ok:
        raise BadInput(f"loader state: field 'source_samples' is {counts!r:.120}, need {n_sources} non-negative "
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
        self._counts = _PhiloxStream(seed, _TAG_COUNTS)
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.set_base(0, np.zeros(len(w), dtype=np.int64))

    def set_base(self, batch: int, counts: np.ndarray) -> None:
        """Counts of every source drawn by batches ``[0, batch)``: the point the schedule computes forward from."""
        self.base_batch = batch
        # _starts[i]: counts before the later of base_batch and block (base_batch // _COUNT_BLOCK + i)'s first batch
        self._starts = [np.asarray(counts, dtype=np.int64)]

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(counts (K, S), their running sums (K + 1, S) from 0) of the ``_COUNT_BLOCK`` batches of ``block``."""
        if block not in self._blocks:
            draw = self._counts.at(block).multinomial(self.global_batch_size, self.probs, size=_COUNT_BLOCK)
            counts = draw.astype(np.int64)
            sums = np.concatenate([np.zeros((1, counts.shape[1]), dtype=np.int64), np.cumsum(counts, axis=0)])
            if len(self._blocks) >= 2:  # the block being read and the one before it
                self._blocks.pop(next(iter(self._blocks)))
            for array in (counts, sums):
                array.flags.writeable = False
            self._blocks[block] = (counts, sums)
        return self._blocks[block]

    def counts_of(self, first: int, n: int) -> np.ndarray:
        """(n, S) samples each of global batches ``[first, first + n)`` takes from each source (read-only)."""
        parts, b = [], first
        while b < first + n:
            block, row = divmod(b, _COUNT_BLOCK)
            take = min(first + n - b, _COUNT_BLOCK - row)
            parts.append(self._block(block)[0][row:row + take])
            b += take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def sources_of(self, first: int, n: int) -> np.ndarray:
        """(n, G) source index of each position of global batches ``[first, first + n)``: each batch's counts in
        source order, permuted by the stable argsort of its SplitMix64 uniforms (keyed by seed, tag and batch)."""
        counts = self.counts_of(first, n)
        grouped = np.repeat(np.tile(np.arange(len(self.probs)), n), counts.ravel()).reshape(n, self.global_batch_size)
        keys = counter_hash(self.seed, _TAG_ORDER, np.arange(first, first + n, dtype=np.uint64))
        order = np.argsort(counter_uniforms(keys, np.arange(self.global_batch_size)), axis=1, kind="stable")
        return np.take_along_axis(grouped, order, axis=1)

    def counts_before(self, batch: int) -> np.ndarray:
        """(S,) samples of each source drawn by the batches before ``batch`` (``batch`` >= the base)."""
        if batch < self.base_batch:
            raise IndexError(f"global batch {batch} precedes the schedule's base {self.base_batch}")
        first = self.base_batch // _COUNT_BLOCK
        block, row = divmod(batch, _COUNT_BLOCK)
        while len(self._starts) <= block - first:  # whole blocks forward, one multinomial call each
            done = first + len(self._starts) - 1
            sums = self._block(done)[1]
            self._starts.append(self._starts[-1] + sums[-1] - sums[self._row_from(done)])
        sums = self._block(block)[1]
        return self._starts[block - first] + sums[row] - sums[self._row_from(block)]

    def _row_from(self, block: int) -> int:
        """The first row of ``block`` the base counts do not hold (0 but in the base's own block)."""
        return self.base_batch % _COUNT_BLOCK if block == self.base_batch // _COUNT_BLOCK else 0


class _PhiloxStream:
    """A Philox generator keyed by ``(seed, tag)`` whose counter is set directly: :meth:`at` is the same stream
    position however often and in whatever order it is asked (no seeding per call)."""

    def __init__(self, seed: int, tag: int):
        self.key = np.array([seed % 2**64, tag], dtype=np.uint64)
        self.bits = np.random.Philox(key=self.key)
        self.generator = np.random.Generator(self.bits)

    def at(self, counter: int) -> np.random.Generator:
        """The generator at ``counter``, in the counter's top word: Philox steps the 256-bit counter from its bottom
        word, so ``counter`` and ``counter + 1`` start streams 2**192 blocks apart, never overlapping ones."""
        position = np.array([0, 0, 0, counter], np.uint64)
        self.bits.state = {"bit_generator": "Philox", "state": {"counter": position, "key": self.key},
                           "buffer": np.zeros(4, np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
        return self.generator


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


@dataclass(frozen=True)
class _Refs:
    """Where the positions of global batches ``first``, ``first + 1``, ... read: (batches, G) arrays of the source,
    the source epoch, the sample id within the source and the mix-wide sample id (:class:`MixReaders`)."""

    first: int
    sources: np.ndarray
    epochs: np.ndarray
    ids: np.ndarray
    mixwide: np.ndarray


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
        self._refs: _Refs | None = None
        self._ahead: list[tuple[int, np.ndarray, np.ndarray] | None] = [None] * len(self.orders)

    def global_refs(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source, source epoch, sample id within the source) of every position of global batch ``batch``
        (read-only views)."""
        refs, row = self._refs_of(batch)
        return refs.sources[row], refs.epochs[row], refs.ids[row]

    def _refs_of(self, batch: int) -> tuple[_Refs, int]:
        """The refs of the global batches from ``batch`` on (``_REFS_AHEAD`` positions, at least one batch), built
        once and sliced by each micro batch; and ``batch``'s row in them."""
        refs = self._refs
        if refs is None or not refs.first <= batch < refs.first + refs.sources.shape[0]:
            n = max(1, _REFS_AHEAD // self.global_batch_size)
            sources = self.schedule.sources_of(batch, n)
            before = self.schedule.counts_before(batch)
            flat = sources.ravel()
            epochs, ids = np.empty_like(flat), np.empty_like(flat)
            for s in range(len(self.orders)):
                rows = np.flatnonzero(flat == s)  # this source's positions, in batch order: consecutive in its stream
                if rows.shape[0]:
                    epochs[rows], ids[rows] = self._stream(s, int(before[s]), rows.shape[0])
            mixwide = self.collate.reader.sample_offsets[flat] + ids
            arrays = [sources] + [a.reshape(sources.shape) for a in (epochs, ids, mixwide)]
            for array in arrays:
                array.flags.writeable = False  # micro batches are views of the cache
            refs = self._refs = _Refs(batch, *arrays)
        return refs, batch - refs.first

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

    def _columns(self, m: int) -> tuple[_Refs, int, slice]:
        """Micro batch ``m``'s refs block, row (its global batch) and columns (its slice of that batch)."""
        batch, micro_step = divmod(m, self.accumulation)
        start = (micro_step * self.world_size + self.rank) * self.micro_batch_size
        refs, row = self._refs_of(batch)
        return refs, row, slice(start, start + self.micro_batch_size)

    def sample_refs(self, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source, source epoch, sample id within the source) of each row of micro batch ``m`` (read-only views)."""
        refs, row, cols = self._columns(m)
        return refs.sources[row, cols], refs.epochs[row, cols], refs.ids[row, cols]

    def __getitem__(self, m: int) -> np.ndarray:
        if self.collate.whole is not None:
            refs, row, cols = self._columns(m)
            return self.collate.whole(refs.mixwide[row, cols], 0)
        sources, epochs, ids = self.sample_refs(m)
        # dynamic masks are keyed by each source's seed and epoch: one collator call per (source, epoch)
        collators = self.collate.collators
        out = np.zeros(len(ids) * collators[0].row_width(), dtype=np.int32)
        for s, e in sorted({(int(s), int(e)) for s, e in zip(sources, epochs, strict=True)}):
            rows = np.flatnonzero((sources == s) & (epochs == e))
            collators[s].place(out, len(ids), rows, collators[s](ids[rows], e))
        return out
