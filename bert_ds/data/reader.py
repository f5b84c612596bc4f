"""Random access to the samples of a shard set by (shard, index), straight from the tar files.

Each tar is scanned once per process (its 512-byte headers only, through an ``mmap``) to find every member's data
offset; a sample is then a slice of the mapped file, decoded with :func:`bert_ds.data.format.decode_sample`. Nothing
is extracted or copied to disk, and a process only maps the shards it touches.

A shard is verified against ``index.json`` the first time a process opens it, at one of three cumulative levels
(``VERIFY_MODES``):

* ``size``: the file's byte size; the tar headers (checksums, member types and names, no truncation), which the scan
  reads anyway; the number of members.
* ``headers``: also every record's 8-byte header against its member size, ``seq_len`` and
  ``masking.max_predictions`` (one vectorised gather over the mapped file; token arrays are not read).
* ``sha256``: also the file's sha256, streamed in 4 MiB blocks (bounded memory), once per process per shard.

:func:`verify_shard_set` runs the same checks over a whole set ahead of time (``tools/verify_shards.py``). Each
failure is one single-line :class:`~bert_ds.data.format.ShardError` naming the shard, the member where there is one,
and the field.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, option
from bert_ds.data.format import HEADER_SIZE, MEMBER_SUFFIX, Sample, ShardError, check_record_headers, decode_sample
from bert_ds.data.index import INDEX_NAME, ShardIndex, file_sha256
from bert_ds.data.remote import is_url
from bert_ds.data.shard_cache import load_index, verify_remote_set
from bert_ds.errors import BadInput

__all__ = ["ShardError", "TarMembers", "scan_tar", "ShardReader", "VERIFY_MODES", "VerifyReport", "verify_shard_set",
           "main"]

VERIFY_MODES = ("size", "headers", "sha256")
"""Cumulative verification levels, cheapest first (see the module docstring)."""
_BLOCK = 512
_SUFFIX = b"." + MEMBER_SUFFIX.encode()


class TarMembers:
    """Member names, data offsets and sizes of one tar file, in archive order."""

    __slots__ = ("names", "offsets", "sizes")

    def __init__(self, names: list[str], offsets: np.ndarray, sizes: np.ndarray):
        self.names = names
        self.offsets = offsets
        self.sizes = sizes

    def __len__(self) -> int:
        return len(self.names)


def _octal(field: bytes, where: str) -> int:
    text = field.rstrip(b"\0 ").lstrip(b" ")
    if field[:1] == b"\x80":  # GNU base-256 extension for very large members
        return int.from_bytes(field[1:], "big")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise ShardError(f"{where}: corrupt tar header (size field {field!r})") from None


def scan_tar(buf: mmap.mmap | bytes | memoryview, *, where: str = "tar") -> TarMembers:
    """Walk the 512-byte headers of an uncompressed (ustar) tar held in ``buf``.

    Only regular-file members are allowed (``typeflag`` ``0`` or NUL), as :class:`~bert_ds.data.index.ShardWriter`
    writes them; pax/GNU extension headers or directories mean the file was not written by bert_ds and are refused.
    """
    # Released on every exit: an exception's traceback would otherwise keep the export alive and the caller's
    # mmap could not be closed.
    with memoryview(buf) as view:
        total = len(view)
        names: list[str] = []
        offsets: list[int] = []
        sizes: list[int] = []
        pos = 0
        while True:
            if pos + _BLOCK > total:
                raise ShardError(f"{where}: truncated tar (no end-of-archive marker after {len(names)} members)")
            header = bytes(view[pos:pos + _BLOCK])
            if header == b"\0" * _BLOCK:
                break
            stored = _octal(header[148:156], where)
            computed = sum(header) - sum(header[148:156]) + 8 * 32
            if stored != computed:
                raise ShardError(f"{where}: corrupt tar header at byte {pos} (checksum mismatch)")
            name = header[:100].split(b"\0", 1)[0]
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
            if prefix:
                name = prefix + b"/" + name
            size = _octal(header[124:136], where)
            typeflag = header[156:157]
            if typeflag not in (b"0", b"\0"):
                raise ShardError(f"{where}: member {name.decode(errors='replace')!r} has tar type {typeflag!r}; "
                                 f"shards hold only regular '<key>.{MEMBER_SUFFIX}' files")
            if not name.endswith(_SUFFIX) or not (name.isascii() and name.decode().isprintable()):
                raise ShardError(f"{where}: member {name.decode(errors='replace')!r} is not named "
                                 f"'<key>.{MEMBER_SUFFIX}' (printable ASCII)")
            data = pos + _BLOCK
            if data + size > total:
                raise ShardError(f"{where}: truncated tar (member {name.decode(errors='replace')!r} needs "
                                 f"{size} bytes at offset {data}, file has {total})")
            names.append(name.decode())
            offsets.append(data)
            sizes.append(size)
            pos = data + (size + _BLOCK - 1) // _BLOCK * _BLOCK
    return TarMembers(names, np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64))


def _gather_headers(map_: mmap.mmap, offsets: np.ndarray) -> np.ndarray:
    """(n, 8) copy of the first bytes of every member. The numpy view of the map dies with this frame, so the map
    can still be closed (an exported buffer would make ``mmap.close`` fail)."""
    data = np.frombuffer(map_, dtype=np.uint8)
    try:
        return data[offsets[:, None] + np.arange(HEADER_SIZE)]
    finally:
        del data


class _OpenShard:
    __slots__ = ("file", "map", "members", "where")

    def __init__(self, file, map_: mmap.mmap, members: TarMembers, where: str):
        self.file = file
        self.map = map_
        self.members = members
        self.where = where


def _unlinked(handle: _OpenShard) -> bool:
    """The shard's file is no longer in its directory (a cache evicted or replaced it) though it is still mapped."""
    try:
        return os.fstat(handle.file.fileno()).st_nlink == 0
    except OSError:
        return True


class ShardReader:
    """Samples of one shard set, addressed by (shard, index) or by global sample id.

    Global sample id ``g`` is the ``g``-th sample in ``index.json`` order (shards in listed order, members in
    archive order). Shards are opened and verified lazily and per process, so a reader can be built in the main
    process and used in forked DataLoader workers; pickling drops the open maps. At most ``max_open_shards`` stay
    mapped (least recently used are closed; a shard set can hold more shards than a process may open files); a
    reopened shard is rescanned and size-checked again but not re-hashed. With ``fetch`` (a set read through a
    cache), a mapped shard whose file the cache evicted is closed, and fetched again when it is read next.
    """

    def __init__(self, data_dir: str | Path, *, verify: str = "size", index: ShardIndex | None = None,
                 max_open_shards: int = 32, fetch=None):
        if verify not in VERIFY_MODES:
            raise BadInput(f"verify={verify!r}: expected one of {VERIFY_MODES}")
        if max_open_shards <= 0:
            raise BadInput(f"max_open_shards={max_open_shards}: must be positive")
        self.max_open_shards = max_open_shards
        self.data_dir = Path(data_dir)
        self.verify = verify
        self.index = index if index is not None else ShardIndex.load(self.data_dir)
        self.id_dtype = np.dtype(self.index.id_dtype)
        counts = np.asarray([s.samples for s in self.index.shards], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        """``shard_starts[i]`` is the global id of shard ``i``'s first sample; the last entry is the total."""
        self.num_samples = int(self.shard_starts[-1])
        self._open: OrderedDict[int, _OpenShard] = OrderedDict()
        self._hashed: set[int] = set()
        self.reading: np.ndarray | None = None
        """Optional (2,) int64 array (shared memory in a DataLoader worker): the (shard, index) being read now."""
        self.fetch = fetch
        """For a set read from a URL: ``fetch(shard)`` makes the shard present and verified in ``data_dir``, the
        node-local cache (:meth:`bert_ds.data.shard_cache.ShardCache.ensure`), before it is opened."""

    @property
    def num_shards(self) -> int:
        return len(self.index.shards)

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        state["reading"] = None
        return state

    def shard_path(self, shard: int) -> tuple[Path, str]:
        """(file path, name used in error messages) of shard ``shard``."""
        name = self.index.shards[shard].name
        return self.data_dir / name, f"{self.data_dir.name}/{name}"

    def open(self, shard: int) -> _OpenShard:
        """Map and verify shard ``shard`` (once per process); raises :class:`ShardError` on any mismatch."""
        handle = self._open.get(shard)
        if handle is not None:
            if self.fetch is None or not _unlinked(handle):
                self._open.move_to_end(shard)
                return handle
            self._close(shard)  # the cache evicted it (--cache-limit): fetched again below
        info = self.index.shards[shard]
        path, where = self.shard_path(shard)
        if self.fetch is not None:
            # A cached shard the cache has evicted still holds its disk space while it is mapped: let it go.
            for old in [s for s, h in self._open.items() if _unlinked(h)]:
                self._close(old)
            self.fetch(shard)
        self.check_size(shard)
        if self.verify == "sha256" and shard not in self._hashed:
            digest = file_sha256(path)
            if digest != info.sha256:
                raise ShardError(f"{where}: sha256 mismatch (index.json says {info.sha256}, file has {digest})")
            self._hashed.add(shard)
        if info.bytes == 0:  # mmap refuses an empty file; a tar always ends with two zero blocks
            raise ShardError(f"{where}: empty file (a tar shard holds at least its end-of-archive marker)")
        file = open(path, "rb")
        try:
            map_ = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except BaseException:
            file.close()
            raise
        try:
            members = scan_tar(map_, where=where)
            if len(members) != info.samples:
                raise ShardError(f"{where}: sample count mismatch (index.json says {info.samples}, "
                                 f"file has {len(members)})")
            if self.verify in ("headers", "sha256"):
                self._check_records(map_, members, where)
        except BaseException:
            map_.close()
            file.close()
            raise
        handle = _OpenShard(file, map_, members, where)
        self._open[shard] = handle
        while len(self._open) > self.max_open_shards:
            self._close(next(iter(self._open)))
        return handle

    def _close(self, shard: int) -> None:
        handle = self._open.pop(shard)
        handle.map.close()
        handle.file.close()

    def check_size(self, shard: int) -> None:
        """The cheapest check (one stat): shard ``shard`` exists with the byte size index.json records."""
        info = self.index.shards[shard]
        path, where = self.shard_path(shard)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ShardError(f"{where}: missing (listed in index.json)") from None
        if not path.is_file():
            raise ShardError(f"{where}: not a regular file (listed in index.json)")
        if size != info.bytes:
            raise ShardError(f"{where}: byte size mismatch (index.json says {info.bytes}, file has {size})")

    def _check_records(self, map_: mmap.mmap, members: TarMembers, where: str) -> None:
        """Every record's 8-byte header against its member size and index.json (``headers`` level)."""
        short = np.flatnonzero(members.sizes < HEADER_SIZE)
        if short.shape[0]:
            i = int(short[0])
            raise ShardError(f"{where}:{members.names[i]}: truncated record ({int(members.sizes[i])} bytes, the "
                             f"header alone is {HEADER_SIZE})")
        headers = _gather_headers(map_, members.offsets)
        bad = check_record_headers(headers, members.sizes, self.id_dtype, seq_len=self.index.seq_len,
                                   max_predictions=self.index.masking.get("max_predictions"))
        if bad is not None:
            raise ShardError(f"{where}:{members.names[bad[0]]}: {bad[1]}")

    def verify_all(self) -> None:
        """Verify every shard now rather than on first use (opens each in turn; at most ``max_open_shards`` stay)."""
        for shard in range(self.num_shards):
            self.open(shard)

    def member_name(self, shard: int, index: int) -> str:
        """``<shard set>/<shard>:<member>`` for error messages (opens the shard if it is not open)."""
        handle = self.open(shard)
        return f"{handle.where}:{handle.members.names[index]}"

    def locate(self, global_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sample ids -> (shard, index within shard) arrays."""
        global_ids = np.asarray(global_ids, dtype=np.int64)
        if global_ids.size and (global_ids.min() < 0 or global_ids.max() >= self.num_samples):
            raise IndexError(f"sample id out of range [0, {self.num_samples})")
        shards = np.searchsorted(self.shard_starts, global_ids, side="right") - 1
        return shards, global_ids - self.shard_starts[shards]

    def raw(self, shard: int, index: int) -> bytes:
        """The bytes of member ``index`` of shard ``shard``."""
        handle = self.open(shard)
        off = int(handle.members.offsets[index])
        return handle.map[off:off + int(handle.members.sizes[index])]

    def sample(self, shard: int, index: int) -> Sample:
        if self.reading is not None:  # where a crash of this process would have happened (see the loader)
            self.reading[0], self.reading[1] = shard, index
        handle = self.open(shard)
        off = int(handle.members.offsets[index])
        data = handle.map[off:off + int(handle.members.sizes[index])]
        return decode_sample(data, self.id_dtype, where=f"{handle.where}:{handle.members.names[index]}")

    def get(self, global_id: int) -> Sample:
        shards, indices = self.locate(np.asarray([global_id]))
        return self.sample(int(shards[0]), int(indices[0]))

    def close(self) -> None:
        for handle in self._open.values():
            handle.map.close()
            handle.file.close()
        self._open.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: module globals may already be gone
            pass


# ----------------------------------------------------------------------------------------------- whole-set checks
@dataclass
class VerifyReport:
    """What :func:`verify_shard_set` checked and found: ``errors`` holds one line per bad shard (or one for a bad
    ``index.json``), each naming the shard, the member where there is one, and the field."""

    directory: str
    level: str
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        rate = self.samples / self.seconds if self.seconds > 0 else float("inf")
        state = "ok" if self.ok else f"{len(self.errors)} bad shard(s)"
        return (f"{self.directory}: {state}: {self.shards} shards, {self.samples} samples, {self.bytes / 1e6:.1f} MB "
                f"checked at level '{self.level}' in {self.seconds:.2f} s ({rate:.0f} samples/s)")

    def raise_for_errors(self) -> None:
        """Raise the first error as one :class:`ShardError` line (for a pre-flight check)."""
        if self.errors:
            more = f" (and {len(self.errors) - 1} more bad shard(s): run tools/verify_shards.py)" if len(
                self.errors) > 1 else ""
            raise ShardError(self.errors[0] + more)


def verify_shard_set(directory: str | Path, level: str = "headers") -> VerifyReport:
    """Check every shard of a set at ``level`` (one of :data:`VERIFY_MODES`) without decoding any sample.

    ``size`` stats each file; ``headers`` also scans each tar and every record header (fast: only the 512-byte tar
    headers and 8 bytes per record are read); ``sha256`` also hashes each file. Every shard is checked even after
    one fails, so the report lists all bad shards; a missing or malformed ``index.json`` is the only error."""
    if level not in VERIFY_MODES:
        raise BadInput(f"level={level!r}: expected one of {VERIFY_MODES}")
    report = VerifyReport(str(directory), level)
    t0 = time.perf_counter()
    if is_url(directory):  # the store's objects first; headers/sha256 then read the verified cache copies
        cached, report.errors = verify_remote_set(str(directory), level)
        if report.errors or level == "size":
            index = load_index(str(directory))
            report.shards = len(index.shards) - len(report.errors)
            report.samples, report.bytes = index.total_samples, sum(s.bytes for s in index.shards)
            report.seconds = time.perf_counter() - t0
            return report
        directory = cached
    try:
        reader = ShardReader(directory, verify=level, max_open_shards=1)
    except (ValueError, FileNotFoundError) as exc:
        report.errors.append(str(exc) if INDEX_NAME in str(exc) else f"{directory}/{INDEX_NAME}: {exc}")
        return report
    try:
        for shard, info in enumerate(reader.index.shards):
            try:
                if level == "size":
                    reader.check_size(shard)
                else:
                    reader.open(shard)
            except ShardError as exc:
                report.errors.append(str(exc))
                continue
            report.shards += 1
            report.samples += info.samples
            report.bytes += info.bytes
    finally:
        reader.close()
    report.seconds = time.perf_counter() - t0
    return report


@dataclass
class VerifyArgs:
    """``bert-ds-verify-shards``' options (:mod:`bert_ds.cli_args`). Its level defaults to the thorough one, not
    :func:`verify_shard_set`'s: a command run by hand can afford to read everything."""

    dirs: list[str] = option(positional=True, metavar="DIR", help="shard set directories or URLs (s3://, gs://, "
                             "https://; each holds index.json)")
    level: str = option("sha256", choices=VERIFY_MODES, help="size: stat each file; headers: + tar headers, counts "
                        "and every record header (fast); sha256: + each file's checksum (reads everything)")


def cli_parser() -> argparse.ArgumentParser:
    return build_parser(VerifyArgs, "bert-ds-verify-shards", "Check shard sets against their index.json without "
                        "training.")


main = alias("verify-shards")


def _run(args: VerifyArgs) -> None:
    """``bert-ds-verify-shards DIR [DIR ...] [--level size|headers|sha256]``: every set's summary on stdout; exit 0
    when every set is clean, else one error line per bad shard (shard, member, field) of every set and exit 2."""
    errors = []
    for directory in args.dirs:
        report = verify_shard_set(directory, args.level)
        print(report.summary(), flush=True)
        errors += report.errors
    if errors:
        raise BadInput("\n".join(errors))  # each line already one ShardError's
