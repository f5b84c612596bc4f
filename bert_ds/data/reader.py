"""Random access to the samples of a shard set by (shard, index), straight from the tar files.

Each tar is scanned once per process (its 512-byte headers only, through an ``mmap``) to find every member's data
offset; a sample is then a slice of the mapped file, decoded with :func:`bert_ds.data.format.decode_sample`. Nothing
is extracted or copied to disk, and a process only maps the shards it touches.

A shard is verified against ``index.json`` the first time a process opens it: the file's byte size always, its
sha256 with ``verify="sha256"``, and after the scan the number of members. Every member must be a regular file
named ``<key>.pair``. Each failure is one ``ShardError`` naming the shard and the field.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from pathlib import Path

import numpy as np

from bert_ds.data.format import MEMBER_SUFFIX, Sample, decode_sample
from bert_ds.data.index import ShardIndex, file_sha256

__all__ = ["ShardError", "TarMembers", "scan_tar", "ShardReader", "VERIFY_MODES"]

VERIFY_MODES = ("size", "sha256")
_BLOCK = 512
_SUFFIX = b"." + MEMBER_SUFFIX.encode()


class ShardError(ValueError):
    """A shard file that does not match ``index.json`` or holds something other than ``.pair`` members."""


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
    view = memoryview(buf)
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
        if not name.endswith(_SUFFIX):
            raise ShardError(f"{where}: member {name.decode(errors='replace')!r} is not named '<key>.{MEMBER_SUFFIX}'")
        data = pos + _BLOCK
        if data + size > total:
            raise ShardError(f"{where}: truncated tar (member {name.decode(errors='replace')!r} needs "
                             f"{size} bytes at offset {data}, file has {total})")
        names.append(name.decode())
        offsets.append(data)
        sizes.append(size)
        pos = data + (size + _BLOCK - 1) // _BLOCK * _BLOCK
    return TarMembers(names, np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64))


class _OpenShard:
    __slots__ = ("file", "map", "members", "where")

    def __init__(self, file, map_: mmap.mmap, members: TarMembers, where: str):
        self.file = file
        self.map = map_
        self.members = members
        self.where = where


class ShardReader:
    """Samples of one shard set, addressed by (shard, index) or by global sample id.

    Global sample id ``g`` is the ``g``-th sample in ``index.json`` order (shards in listed order, members in
    archive order). Shards are opened and verified lazily and per process, so a reader can be built in the main
    process and used in forked DataLoader workers; pickling drops the open maps. At most ``max_open_shards`` stay
    mapped (least recently used are closed; a shard set can hold more shards than a process may open files); a
    reopened shard is rescanned and size-checked again but not re-hashed.
    """

    def __init__(self, data_dir: str | Path, *, verify: str = "size", index: ShardIndex | None = None,
                 max_open_shards: int = 32):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r}: expected one of {VERIFY_MODES}")
        if max_open_shards <= 0:
            raise ValueError(f"max_open_shards={max_open_shards}: must be positive")
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

    @property
    def num_shards(self) -> int:
        return len(self.index.shards)

    def __len__(self) -> int:
        return self.num_samples

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state

    def shard_path(self, shard: int) -> tuple[Path, str]:
        """(file path, name used in error messages) of shard ``shard``."""
        name = self.index.shards[shard].name
        return self.data_dir / name, f"{self.data_dir.name}/{name}"

    def open(self, shard: int) -> _OpenShard:
        """Map and verify shard ``shard`` (once per process); raises :class:`ShardError` on any mismatch."""
        handle = self._open.get(shard)
        if handle is not None:
            self._open.move_to_end(shard)
            return handle
        info = self.index.shards[shard]
        path, where = self.shard_path(shard)
        if not path.is_file():
            raise ShardError(f"{where}: missing (listed in index.json)")
        size = path.stat().st_size
        if size != info.bytes:
            raise ShardError(f"{where}: byte size mismatch (index.json says {info.bytes}, file has {size})")
        if self.verify == "sha256" and shard not in self._hashed:
            digest = file_sha256(path)
            if digest != info.sha256:
                raise ShardError(f"{where}: sha256 mismatch (index.json says {info.sha256}, file has {digest})")
            self._hashed.add(shard)
        file = open(path, "rb")
        try:
            map_ = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            members = scan_tar(map_, where=where)
        except BaseException:
            file.close()
            raise
        if len(members) != info.samples:
            map_.close()
            file.close()
            raise ShardError(f"{where}: sample count mismatch (index.json says {info.samples}, "
                             f"file has {len(members)})")
        handle = _OpenShard(file, map_, members, where)
        self._open[shard] = handle
        while len(self._open) > self.max_open_shards:
            _, old = self._open.popitem(last=False)
            old.map.close()
            old.file.close()
        return handle

    def verify_all(self) -> None:
        """Verify every shard now rather than on first use (opens each in turn; at most ``max_open_shards`` stay)."""
        for shard in range(self.num_shards):
            self.open(shard)

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
