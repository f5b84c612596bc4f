"""The sample order of an epoch, the same on every rank and worker: position in epoch -> global sample id.

Deterministic in ``(seed, epoch)`` and fresh each epoch: the shard order is permuted, the permuted list is cut into
windows of ``window_shards`` consecutive shards, and the samples of each window are permuted together. Memory is
O(number of shards + 2 windows of sample ids), not O(total samples). See :mod:`bert_ds.data.loader` for how global
batches are cut from it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from bert_ds.errors import BadInput

__all__ = ["EpochOrder"]

# Distinct tags keep the shard-order and window random streams independent for the same (seed, epoch).
_TAG_SHARDS, _TAG_WINDOW = 0x5A4D, 0x57494E


class EpochOrder:
    """Deterministic per-epoch sample order: position in epoch -> global sample id.

    See the module docstring for the shuffle; ``ids(epoch, start, stop)`` builds only the windows it touches and
    keeps the two most recent, so a worker walking forward through an epoch permutes each window once."""

    def __init__(self, shard_counts: Sequence[int], *, seed: int, shuffle: bool, window_shards: int):
        if window_shards <= 0:
            raise BadInput(f"shuffle_window_shards={window_shards}: must be positive")
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

    def shards_for(self, first: int, stop: int, ahead: int) -> list[int]:
        """Shards read at positions ``[first, stop)`` counted across epochs (position ``p`` of epoch ``e`` is
        ``e * num_samples + p``) and in the ``ahead`` shuffle windows after them, in the order they are first read:
        what a prefetcher fetches next (:mod:`bert_ds.data.prefetch`). Within a window every shard is read from its
        first batch on (the window's samples are permuted together), so whole windows are the unit."""
        n = len(self.counts)
        per = self.num_samples
        windows_per_epoch = -(-n // self.window_shards)

        def window_at(position: int) -> tuple[int, int]:
            epoch, pos = divmod(position, per)
            _, bounds = self._layout_of(epoch)
            return epoch, int(np.searchsorted(bounds, pos, side="right")) - 1

        epoch, w = window_at(first)
        last = window_at(max(first, stop - 1))
        out: list[int] = []
        while (epoch, w) <= last or ahead > 0:
            if (epoch, w) > last:
                ahead -= 1
            order, _ = self._layout_of(epoch)
            out += [int(s) for s in order[w * self.window_shards:(w + 1) * self.window_shards] if int(s) not in out]
            epoch, w = (epoch + 1, 0) if w + 1 >= windows_per_epoch else (epoch, w + 1)
        return out

    def _layout_of(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_epoch_layout` without touching its cache (a prefetcher looks ahead without moving a reader's)."""
        if self._layout is not None and self._layout[0] == epoch:
            return self._layout[1], self._layout[2]
        saved = self._layout
        try:
            return self._epoch_layout(epoch)
        finally:
            self._layout = saved
