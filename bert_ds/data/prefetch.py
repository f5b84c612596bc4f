"""Fetch a remote shard set's next shards before the loader needs them (``docs/data.md`` "Shards at a URL").

The sample order is a pure function of ``index.json``, the seed and the epoch (:mod:`bert_ds.data.epoch_order`), so
a rank knows which shards it reads next. Before each global batch the loader calls :meth:`Prefetcher.advance`: the
look-ahead window (the shuffle windows read by the previous and the next global batch, and ``ahead_windows`` windows
after them: :meth:`~bert_ds.data.epoch_order.EpochOrder.shards_for`) is computed, shards outside it are evicted
when the cache is over ``--cache-limit`` (:meth:`~bert_ds.data.shard_cache.ShardCache.evict`), and the window's
missing shards are handed, in the order they are first read, to a pool of ``concurrency`` download threads. A
download error (a :class:`~bert_ds.data.remote.RemoteError`, a full disk) is raised in the training thread at the
next :meth:`advance`. The previous global batch stays in the window: a rank one step behind another on the node
still finds its shards. What this changes is when bytes arrive, never which batches the loader yields.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from bert_ds.data.shard_cache import ShardCache

__all__ = ["Prefetcher"]

log = logging.getLogger(__name__)


class Prefetcher:
    """Background downloads of one shard set's look-ahead window; ``window(global_batch)`` lists its shards in the
    order they are first read."""

    def __init__(self, cache: ShardCache, window: Callable[[int], list[int]], *, concurrency: int):
        self.cache = cache
        self.window = window
        self.concurrency = max(1, concurrency)
        self._queue: queue.Queue | None = None
        self._futures: dict[int, Future] = {}
        self._batch: int | None = None
        self._keep: set[int] = set()
        self._lock = threading.Lock()
        self._in_flight = 0
        """Bytes being downloaded by this prefetcher: counted against ``--cache-limit`` before another starts."""

    def advance(self, global_batch: int) -> None:
        """The loader is about to deliver (a micro batch of) ``global_batch``: evict, fetch ahead, and raise the first
        error a finished download met."""
        self._raise_failed()
        if global_batch == self._batch:
            return
        self._batch = global_batch
        shards = self.window(global_batch)
        with self._lock:
            self._keep = set(shards)
            self.cache.evict(self._keep, incoming=self._in_flight)
        for shard in shards:
            if shard in self._futures or self.cache.is_cached(shard):
                continue
            if self._queue is None:
                self._start()
            future: Future = Future()
            self._queue.put((future, shard))
            self._futures[shard] = future
        wanted = set(shards)
        for shard in [s for s, f in self._futures.items() if f.done() and s not in wanted]:
            del self._futures[shard]  # done and outside the window: a later window fetches it again if evicted

    def _start(self) -> None:
        """The download threads: daemons, so a process that ends (training done, an error) does not wait for
        downloads nobody needs; one killed mid-download leaves only its ``.part`` file."""
        self._queue = queue.Queue()
        for i in range(self.concurrency):
            threading.Thread(target=self._work, args=(self._queue,), name=f"bert_ds-prefetch-{i}", daemon=True).start()

    def _work(self, jobs: queue.Queue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            future, shard = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                self._fetch(shard)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread (advance)
                future.set_exception(exc)
            else:
                future.set_result(None)

    def _fetch(self, shard: int) -> None:
        """Make room (the window's shards stay), then download; the room is taken before the download starts."""
        incoming = self.cache.index.shards[shard].bytes
        with self._lock:
            self.cache.evict(self._keep, incoming=self._in_flight + incoming)
            self._in_flight += incoming
        try:
            self.cache.ensure(shard, make_room=False)
        finally:
            with self._lock:
                self._in_flight -= incoming

    def _raise_failed(self) -> None:
        for shard, future in list(self._futures.items()):
            if future.done() and future.exception() is not None:
                del self._futures[shard]
                raise future.exception()

    def close(self) -> None:
        """Cancel the downloads not started and stop the threads (a download in progress runs to its end)."""
        if self._queue is not None:
            for future in self._futures.values():
                future.cancel()
            for _ in range(self.concurrency):
                self._queue.put(None)
            self._queue = None
