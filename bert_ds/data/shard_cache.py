"""The node-local cache of a shard set at a URL: each shard downloaded once per node, verified, then read by the
unchanged mmap reader (:class:`bert_ds.data.reader.ShardReader`); ``docs/data.md`` "Shards at a URL".

Layout, under the cache root (``--cache-dir``)::

    <root>/<set name>-<digest>/index.json            the store's index.json, byte for byte (read first: it decides
                                                     which shards exist, their sizes and sha256)
    <root>/<set name>-<digest>/shard-00000.tar       a shard, present only once verified (size, then sha256)
    <root>/<set name>-<digest>/.locks/<shard>.lock   flock held while one process of the node downloads that shard
    <root>/<set name>-<digest>/.<shard>.<host>.<pid>.part   a download in progress (never a shard's name)

``<digest>`` hashes the URL and the index's bytes: a shard set re-uploaded with other contents gets a new directory,
so a cached file is never checked against another index. A download goes to its ``.part`` name, is verified and only
then renamed to the shard's name (atomic on one file system), so a file under a shard's name is a verified shard; a
killed download leaves a ``.part`` file, removed by the next process that takes that shard's lock (the kernel drops
a dead holder's ``flock``, as for the extension build lock, :mod:`bert_ds.runtime.caches`). A size or sha256
mismatch is downloaded once more; a second mismatch is a :class:`~bert_ds.data.remote.RemoteError` naming the URL and
the shard. A disk that cannot hold the shard is :class:`~bert_ds.errors.StorageError` (exit 74).

``--cache-limit`` bounds the bytes of a set's verified shards: :meth:`ShardCache.evict` removes, least recently used
first, shards outside the loader's look-ahead window (:mod:`bert_ds.data.prefetch`); a limit below the window is
refused at start-up (:meth:`ShardCache.check_limit`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from bert_ds.data.index import INDEX_NAME, ShardIndex, ShardInfo
from bert_ds.data.remote import RemoteError, Store, is_url, with_retries
from bert_ds.errors import STORAGE_ERRNOS, BadInput, StorageError

__all__ = ["CacheOptions", "ShardCache", "check_upload_target", "default_options", "format_size", "load_index",
           "open_cache", "parse_size", "set_default_options", "upload_shard_set", "verify_remote_set"]

log = logging.getLogger(__name__)

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, flag: str = "--cache-limit") -> int:
    """``200G``, ``512M``, ``1.5T``, ``4096`` -> bytes (binary units; a trailing ``B``/``iB`` allowed)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if match is None:
        raise BadInput(f"{flag} {text!r}: give a size such as 200G, 512M or a number of bytes")
    value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise BadInput(f"{flag} {text!r}: must be positive")
    return value


def format_size(n: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.1f}{unit}"
    return f"{n}B"


@dataclass(frozen=True)
class CacheOptions:
    """Where and how a process caches shard sets read from URLs (set once per run: :func:`set_default_options`)."""

    root: str
    """The node-local cache root (``--cache-dir``)."""
    limit_bytes: int | None = None
    """``--cache-limit`` per shard set; None: unbounded."""
    concurrency: int = 4
    """Shards downloaded at once per rank by the prefetcher."""
    ahead_windows: int = 1
    """Shuffle windows fetched beyond the one being read (:meth:`bert_ds.data.epoch_order.EpochOrder.shards_for`)."""


_DEFAULT: list[CacheOptions] = []


def set_default_options(options: CacheOptions) -> None:
    """The options every URL opened by this process uses (pre-flight sets them from ``--cache-dir/--cache-limit``)."""
    _DEFAULT[:] = [options]


def default_options() -> CacheOptions:
    return _DEFAULT[0] if _DEFAULT else CacheOptions(root=os.path.join(os.environ.get("TMPDIR") or "/tmp",
                                                                       "bert_ds-shards"))


def _set_dir_name(url: str, raw_index: bytes) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1])[:64] or "set"
    digest = hashlib.sha256(url.rstrip("/").encode() + b"\0" + raw_index).hexdigest()[:16]
    return f"{name}-{digest}"


class ShardCache:
    """One shard set at ``url``, cached under ``options.root``. Built in a rank's main process (reads index.json
    from the store); a forked DataLoader worker uses the same object (:meth:`ensure`); ``stats`` (shared memory):
    bytes downloaded, downloads, seconds spent waiting for a shard to arrive, over every process of this rank."""

    def __init__(self, url: str, options: CacheOptions):
        self.url = url.rstrip("/")
        self.options = options
        self.store = Store(url)
        raw = self.store.read(INDEX_NAME, "reading")
        self.dir = Path(options.root) / _set_dir_name(url, raw)
        self._mkdirs()
        index_path = self.dir / INDEX_NAME
        if not index_path.is_file() or index_path.read_bytes() != raw:
            self._write_atomic(index_path, raw)
        try:
            self.index = ShardIndex.load(self.dir)
        except (BadInput, FileNotFoundError) as exc:
            raise RemoteError(f"{self.url}/{INDEX_NAME}: {exc}") from None
        self.stats = torch.zeros(3, dtype=torch.float64).share_memory_()
        self.sweep()

    def _mkdirs(self) -> None:
        try:
            (self.dir / ".locks").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            _raise_storage(exc, f"cache directory {self.dir}")

    def _write_atomic(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.part")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            _raise_storage(exc, str(path))

    # ------------------------------------------------------------------------------------------------ one shard
    def path(self, shard: int) -> Path:
        return self.dir / self.index.shards[shard].name

    def object_url(self, shard: int) -> str:
        return self.store.object_url(self.index.shards[shard].name)

    def is_cached(self, shard: int) -> bool:
        """A file under the shard's name (a verified download: nothing else is ever renamed there) of its size."""
        try:
            return self.path(shard).stat().st_size == self.index.shards[shard].bytes
        except FileNotFoundError:
            return False

    def ensure(self, shard: int, *, make_room: bool = True) -> None:
        """Make shard ``shard`` present and verified in the cache (download it under its lock unless another
        process of the node did); marks it used (LRU). A download first makes room under ``--cache-limit``
        (:meth:`evict`, least recently used first) unless the caller did (``make_room=False``: the prefetcher,
        which keeps its window): a reader that needs a shard before its prefetch started stays within the limit."""
        if self.is_cached(shard):
            _touch(self.path(shard))
            return
        start = time.perf_counter()
        with self._shard_lock(self.index.shards[shard].name):
            if not self.is_cached(shard):
                if make_room:
                    self.evict({shard}, incoming=self.index.shards[shard].bytes)
                self._download(shard)
        self.stats[2] += time.perf_counter() - start

    @contextlib.contextmanager
    def _shard_lock(self, name: str, blocking: bool = True) -> Iterator[bool]:
        """The shard's lock: a POSIX record lock on ``.locks/<shard>.lock`` between processes (the kernel drops it
        when its holder dies, and a forked DataLoader worker does not inherit it, unlike an ``flock``, whose open file
        a fork would share), and a thread lock between the prefetch threads of one process. Stale ``.part`` files of
        the shard are removed once held."""
        thread_lock = _THREAD_LOCKS.setdefault(str(self.dir / name), threading.Lock())
        if not thread_lock.acquire(blocking):
            yield False
            return
        try:
            fd = os.open(self.dir / ".locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                if not _lock_record(fd, blocking):
                    yield False
                    return
                for stale in self.dir.glob(f".{name}.*.part"):  # left by a killed download: its holder is gone
                    stale.unlink(missing_ok=True)
                yield True
            finally:
                os.close(fd)  # drops the record lock
        finally:
            thread_lock.release()

    def sweep(self) -> None:
        """Remove the ``.part`` files of downloads whose process died (their shard's lock is free)."""
        for part in self.dir.glob(".*.part"):
            name = part.name[1:].split(".tar.", 1)[0] + ".tar"
            if (self.dir / ".locks" / f"{name}.lock").exists():
                with self._shard_lock(name, blocking=False):
                    pass

    def _download(self, shard: int) -> None:
        info = self.index.shards[shard]
        url = self.object_url(shard)
        self._check_room(info)
        tmp = self.dir / f".{info.name}.{socket.gethostname()}.{os.getpid()}.part"
        for attempt in (1, 2):
            try:
                size, digest = with_retries("downloading", url, self.store.store, lambda: self._fetch_to(tmp, info))
                if size == info.bytes and digest == info.sha256:
                    # counted before the shard is published: a reader that waits for it may read the stats at once
                    self.stats[0] += size
                    self.stats[1] += 1
                    os.replace(tmp, self.path(shard))
                    return
            finally:
                tmp.unlink(missing_ok=True)  # after the rename it is gone; else a failed or mismatched download
            what = (f"byte size mismatch (index.json says {info.bytes}, the store served {size})"
                    if size != info.bytes else
                    f"sha256 mismatch (index.json says {info.sha256}, the store served {digest})")
            if attempt == 1:
                log.warning("%s: %s; downloading shard %s once more", url, what, info.name)
        raise RemoteError(f"{url}: {what}, also after one re-download: shard {info.name} of {self.url} does not "
                          f"match its index.json; re-upload the shard set")

    def _fetch_to(self, tmp: Path, info: ShardInfo) -> tuple[int, str]:
        """One download pass into ``tmp``: (bytes, sha256). Stops early past the expected size."""
        digest = hashlib.sha256()
        size = 0
        with open(tmp, "wb") as out:
            for block in self.store.stream(info.name):
                size += len(block)
                digest.update(block)
                if size > info.bytes:
                    break
                try:
                    out.write(block)
                except OSError as exc:
                    _raise_storage(exc, f"cache {self.dir} (downloading shard {info.name})")
            try:
                out.flush()
                os.fsync(out.fileno())
            except OSError as exc:
                _raise_storage(exc, f"cache {self.dir} (downloading shard {info.name})")
        return size, digest.hexdigest()

    def _check_room(self, info: ShardInfo) -> None:
        free = shutil.disk_usage(self.dir).free
        if free < info.bytes:
            raise StorageError(f"cache {self.dir}: {format_size(free)} free on its file system, shard {info.name} "
                               f"({self.url}) needs {format_size(info.bytes)}: free space, lower --cache-limit or "
                               f"point --cache-dir at a larger node-local disk")

    # ------------------------------------------------------------------------------------------------ the limit
    def window_bytes(self, shards: int) -> int:
        """Bytes of the ``shards`` largest shards: the most a look-ahead window of that many shards can hold."""
        return sum(sorted((s.bytes for s in self.index.shards), reverse=True)[:shards])

    def check_limit(self, window_shards: int) -> None:
        """Refuse a ``--cache-limit`` below the look-ahead window, naming both numbers."""
        limit = self.options.limit_bytes
        need = self.window_bytes(window_shards)
        if limit is not None and limit < need:
            raise BadInput(f"--cache-limit {format_size(limit)} ({limit} bytes) is below the look-ahead window of "
                           f"{self.url}: {min(window_shards, len(self.index.shards))} shards, up to "
                           f"{format_size(need)} ({need} bytes); raise --cache-limit to at least that")

    def evict(self, keep: set[int], incoming: int = 0) -> list[str]:
        """Over ``--cache-limit`` (counting ``incoming`` bytes about to be downloaded): remove cached shards not in
        ``keep``, least recently used first; returns their names."""
        limit = self.options.limit_bytes
        if limit is None:
            return []
        keep_names = {self.index.shards[s].name for s in keep}
        present = []
        for info in self.index.shards:
            try:
                st = (self.dir / info.name).stat()
            except FileNotFoundError:
                continue
            present.append((st.st_mtime, info.name, st.st_size))
        total = sum(size for _, _, size in present) + incoming
        removed = []
        for _, name, size in sorted(present):
            if total <= limit:
                break
            if name in keep_names:
                continue
            (self.dir / name).unlink(missing_ok=True)
            total -= size
            removed.append(name)
        if removed:
            log.info("%s: evicted %d shard(s) outside the look-ahead window (--cache-limit %s)", self.dir,
                     len(removed), format_size(limit))
        return removed


def _lock_record(fd: int, blocking: bool, poll_s: float = 0.05) -> bool:
    """Take the POSIX record lock on ``fd``, polling (non-blocking tries): a blocking wait would be refused with
    EDEADLK when two ranks' prefetch threads each hold one shard and wait for the other's, which the kernel takes
    for a deadlock between the two processes although different threads hold and wait."""
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except (BlockingIOError, PermissionError):
            if not blocking:
                return False
            time.sleep(poll_s)


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def _raise_storage(exc: OSError, where: str):
    if exc.errno in STORAGE_ERRNOS:
        raise StorageError(f"{where}: {exc.strerror or exc} (errno {exc.errno}): free space on the node-local disk, "
                           f"lower --cache-limit or point --cache-dir elsewhere") from None
    raise BadInput(f"{where}: {exc}") from None


_THREAD_LOCKS: dict[str, threading.Lock] = {}
"""One lock per cached shard path, between the threads of one process (see :meth:`ShardCache._shard_lock`)."""
os.register_at_fork(after_in_child=_THREAD_LOCKS.clear)  # a lock held by a prefetch thread is not the child's

_OPEN: dict[tuple[str, CacheOptions], ShardCache] = {}


def open_cache(url: str, options: CacheOptions | None = None) -> ShardCache:
    """The process's :class:`ShardCache` of ``url`` (built once: index.json is read from the store the first time)."""
    options = options or default_options()
    key = (url.rstrip("/"), options)
    if key not in _OPEN:
        _OPEN[key] = ShardCache(url, options)
    return _OPEN[key]


def load_index(path: str | Path) -> ShardIndex:
    """``index.json`` of a directory, or of a URL (read from the store)."""
    if is_url(path):
        return open_cache(str(path)).index
    return ShardIndex.load(path)


def verify_remote_set(url: str, level: str) -> tuple[Path, list[str]]:
    """A shard set at a URL against its index.json: ``size`` compares the store's object sizes (nothing
    downloaded); ``headers``/``sha256`` download every missing shard into the cache (verified on the way). Returns
    the cache directory (for the local checks of those levels) and one error line per bad shard."""
    cache = open_cache(url)
    sizes = cache.store.sizes([s.name for s in cache.index.shards])
    errors = []
    for shard, info in enumerate(cache.index.shards):
        where = f"{cache.object_url(shard)}"
        if info.name not in sizes:
            errors.append(f"{where}: missing on the store (shard {info.name}, listed in {cache.url}/{INDEX_NAME})")
        elif sizes[info.name] != info.bytes:
            errors.append(f"{where}: byte size mismatch on the store (index.json says {info.bytes}, the object has "
                          f"{sizes[info.name]}; shard {info.name})")
        elif level != "size":
            try:
                cache.ensure(shard)
            except RemoteError as exc:
                errors.append(str(exc))
    return cache.dir, errors


def check_upload_target(url: str, overwrite: bool) -> Store:
    """Refuse to upload over a set already at ``url`` (its index.json exists) unless ``overwrite``; checks the
    credentials too, before any work."""
    store = Store(url)
    try:
        store.size(INDEX_NAME)
    except RemoteError as exc:
        if "missing on the store" not in str(exc):
            raise
        return store
    if not overwrite:
        raise BadInput(f"{store.object_url(INDEX_NAME)} already exists; pass --overwrite to replace the shard set")
    return store


def upload_shard_set(local_dir: str | Path, url: str, *, overwrite: bool) -> None:
    """Upload a shard set written in ``local_dir`` to ``url``: every shard first, ``index.json`` last, so a reader
    never sees an index whose shards are not all there. A set already at ``url`` is kept unless ``overwrite``."""
    store = check_upload_target(url, overwrite)
    index = ShardIndex.load(local_dir)
    for info in index.shards:
        store.upload(str(Path(local_dir) / info.name), info.name)
        log.info("uploaded %s", store.object_url(info.name))
    store.upload(str(Path(local_dir) / INDEX_NAME), INDEX_NAME)

