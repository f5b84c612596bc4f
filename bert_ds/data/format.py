"""The on-disk sample layout inside the WebDataset tar shards, and the ``index.json`` schema version.

Each sample is one tar member named ``<key>.pair`` (``key`` = 12 decimal digits, unique within the shard set:
shard creation uses ``<chunk:06d><sample-in-chunk:06d>``) holding a fixed little-endian binary layout; nothing is
pickled:

    offset  size        field
    0       2  uint16   length L            tokens in ``[CLS] A [SEP] B [SEP]`` (no padding stored)
    2       2  uint16   segment_a_length    tokens with segment id 0 (``[CLS] A [SEP]``); the rest up to L are 1
    4       2  uint16   num_predictions P   masked positions
    6       1  uint8    nsp_label           0 = IsNext (B follows A), 1 = NotNext (random B), as Google/HF
    7       1  uint8    reserved (0)
    8       L  * id     input_ids           after masking; ``id`` is uint16 (vocab <= 65536) or uint32 (index.json)
    ...     P  * 2      masked_positions    uint16, ascending
    ...     P  * id     masked_ids          the original token ids at those positions

Segment ids are stored as their boundary (``segment_a_length``): that is the whole of the information they carry.
The original (unmasked) sequence is ``input_ids`` with ``masked_ids`` written back at ``masked_positions``, which is
what dynamic masking at load time starts from.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from bert_ds.errors import BadInput

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "MEMBER_SUFFIX", "HEADER_SIZE", "ShardError", "Sample", "id_dtype_for_vocab",
    "encode_sample", "encode_samples", "decode_sample", "check_record_headers",
]

FORMAT_NAME = "bert_ds.pairs"
FORMAT_VERSION = 1
MEMBER_SUFFIX = "pair"
_HEADER = struct.Struct("<HHHBB")
HEADER_SIZE = _HEADER.size


class ShardError(BadInput):
    """A shard or record that does not match ``index.json`` or this layout. The message is one line naming the shard,
    the member where known, and the field: newlines are escaped, so the line a training job prints is the whole
    story (member names come from the file itself and could hold anything)."""

    def __init__(self, message: str):
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


def id_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The compact token-id dtype for a vocabulary: uint16 up to 65,536 entries, else uint32."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


@dataclass
class Sample:
    input_ids: np.ndarray  # (L,) id dtype, masked
    segment_a_length: int
    masked_positions: np.ndarray  # (P,) uint16
    masked_ids: np.ndarray  # (P,) id dtype, original ids at masked_positions
    nsp_label: int

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    def segment_ids(self) -> np.ndarray:
        seg = np.zeros(self.length, dtype=np.uint8)
        seg[self.segment_a_length:] = 1
        return seg

    def original_ids(self) -> np.ndarray:
        ids = self.input_ids.copy()
        ids[self.masked_positions.astype(np.int64)] = self.masked_ids
        return ids


def _record(length: int, segment_a_length: int, predictions: int, nsp_label: int, input_ids: bytes,
            masked_positions: bytes, masked_ids: bytes) -> bytes:
    """The layout of the module docstring: the header, then the three arrays' bytes."""
    return b"".join((_HEADER.pack(length, segment_a_length, predictions, nsp_label, 0), input_ids, masked_positions,
                     masked_ids))


def _refuse(i: int, length: int, segment_a_length: int, predictions: int) -> None:
    raise BadInput(f"bad sample {i}: length={length} segment_a_length={segment_a_length} predictions={predictions} "
                   f"(need 0 < segment_a_length < length <= 65535, predictions <= 65535)")


def encode_sample(sample: Sample, id_dtype: np.dtype) -> bytes:
    """One ``.pair`` record (many at once: :func:`encode_samples`)."""
    n, p = sample.length, int(sample.masked_positions.shape[0])
    if not 0 < sample.segment_a_length < n <= 65535 or p > 65535:
        _refuse(0, n, sample.segment_a_length, p)
    return _record(n, sample.segment_a_length, p, int(sample.nsp_label),
                   np.ascontiguousarray(sample.input_ids, dtype=id_dtype).tobytes(),
                   np.ascontiguousarray(sample.masked_positions, dtype="<u2").tobytes(),
                   np.ascontiguousarray(sample.masked_ids, dtype=id_dtype).tobytes())


def encode_samples(input_ids: np.ndarray, offsets: np.ndarray, segment_a_lengths: np.ndarray,
                   masked_positions: np.ndarray, masked_offsets: np.ndarray, masked_ids: np.ndarray,
                   nsp_labels: np.ndarray, id_dtype: np.dtype) -> list[bytes]:
    """The ``.pair`` records of many samples given end to end in flat arrays, as shard creation builds them.

    Sample i is ``input_ids[offsets[i]:offsets[i + 1]]`` (masked), ``segment_a_lengths[i]``, its prediction slots
    ``masked_positions`` / ``masked_ids`` ``[masked_offsets[i]:masked_offsets[i + 1]]`` and ``nsp_labels[i]``. The
    arrays are converted to bytes once and sliced per record: per-sample ``tobytes`` calls would cost more than the
    masking that produced them."""
    lengths, counts = np.diff(offsets), np.diff(masked_offsets)
    seg_a = np.asarray(segment_a_lengths, dtype=np.int64)
    bad = np.flatnonzero((seg_a <= 0) | (seg_a >= lengths) | (lengths > 65535) | (counts > 65535))
    if bad.shape[0]:
        i = int(bad[0])
        _refuse(i, int(lengths[i]), int(seg_a[i]), int(counts[i]))
    w = id_dtype.itemsize
    ids_bytes = np.ascontiguousarray(input_ids, dtype=id_dtype).tobytes()
    pos_bytes = np.ascontiguousarray(masked_positions, dtype="<u2").tobytes()
    orig_bytes = np.ascontiguousarray(masked_ids, dtype=id_dtype).tobytes()
    s, p = np.asarray(offsets).tolist(), np.asarray(masked_offsets).tolist()
    return [_record(s[i + 1] - s[i], a, p[i + 1] - p[i], label, ids_bytes[s[i] * w:s[i + 1] * w],
                    pos_bytes[p[i] * 2:p[i + 1] * 2], orig_bytes[p[i] * w:p[i + 1] * w])
            for i, (a, label) in enumerate(zip(seg_a.tolist(), np.asarray(nsp_labels).tolist(), strict=True))]


def decode_sample(data: bytes | memoryview, id_dtype: np.dtype, *, where: str = "sample") -> Sample:
    """Parse one ``.pair`` member. ``where`` names the shard/member in the :class:`ShardError` raised on a malformed
    record: a size that disagrees with the header's length fields, or a segment boundary outside the pair."""
    if len(data) < _HEADER.size:
        raise ShardError(f"{where}: truncated record ({len(data)} bytes, the header alone is {_HEADER.size})")
    n, seg_a, p, nsp, _ = _HEADER.unpack_from(data, 0)
    width = id_dtype.itemsize
    expected = _HEADER.size + n * width + p * 2 + p * width
    if len(data) != expected:
        raise ShardError(f"{where}: field 'length' or 'num_predictions' disagrees with the record size "
                         f"({len(data)} bytes; length={n}, num_predictions={p} need {expected})")
    if not 0 < seg_a < n:
        raise ShardError(f"{where}: field 'segment_a_length' is {seg_a}, need 0 < segment_a_length < length={n}")
    if nsp > 1:
        raise ShardError(f"{where}: field 'nsp_label' is {nsp}, need 0 or 1")
    off = _HEADER.size
    input_ids = np.frombuffer(data, dtype=id_dtype, count=n, offset=off)
    off += n * width
    positions = np.frombuffer(data, dtype="<u2", count=p, offset=off)
    off += p * 2
    masked_ids = np.frombuffer(data, dtype=id_dtype, count=p, offset=off)
    return Sample(input_ids, seg_a, positions, masked_ids, nsp)


def check_record_headers(headers: np.ndarray, sizes: np.ndarray, id_dtype: np.dtype, *, seq_len: int,
                         max_predictions: int | None) -> tuple[int, str] | None:
    """Check the 8-byte headers of many records at once, without touching their token arrays.

    ``headers`` is (n, 8) uint8 (each record's first bytes), ``sizes`` the records' byte sizes. Returns
    ``(record index, "field ...: reason")`` for the first bad record, or None. A record shorter than its header must
    be refused by the caller before gathering (its 8 bytes would belong to the next member)."""
    if headers.shape[0] == 0:
        return None
    words = np.ascontiguousarray(headers[:, :6]).view("<u2").astype(np.int64)  # (n, 3): length, seg_a, predictions
    n, seg_a, p = words[:, 0], words[:, 1], words[:, 2]
    nsp, reserved = headers[:, 6], headers[:, 7]
    width = id_dtype.itemsize
    checks = (
        (_HEADER.size + n * width + p * (2 + width) != sizes,
         lambda i: f"field 'length' or 'num_predictions' disagrees with the record size ({int(sizes[i])} bytes; "
                   f"length={int(n[i])}, num_predictions={int(p[i])})"),
        (n > seq_len, lambda i: f"field 'length' is {int(n[i])}, above index.json seq_len={seq_len}"),
        ((seg_a <= 0) | (seg_a >= n),
         lambda i: f"field 'segment_a_length' is {int(seg_a[i])}, need 0 < segment_a_length < length={int(n[i])}"),
        (p > (max_predictions if max_predictions is not None else n),
         lambda i: f"field 'num_predictions' is {int(p[i])}, above index.json masking.max_predictions="
                   f"{max_predictions}"),
        (nsp > 1, lambda i: f"field 'nsp_label' is {int(nsp[i])}, need 0 or 1"),
        (reserved != 0, lambda i: f"field 'reserved' (byte 7) is {int(reserved[i])}, need 0"),
    )
    first: tuple[int, str] | None = None
    for bad, describe in checks:
        hits = np.flatnonzero(bad)
        if hits.shape[0] and (first is None or hits[0] < first[0]):
            first = (int(hits[0]), describe(int(hits[0])))
    return first
