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

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "MEMBER_SUFFIX", "Sample", "id_dtype_for_vocab", "encode_sample",
    "encode_samples", "decode_sample",
]

FORMAT_NAME = "bert_ds.pairs"
FORMAT_VERSION = 1
MEMBER_SUFFIX = "pair"
_HEADER = struct.Struct("<HHHBB")


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
    raise ValueError(f"bad sample {i}: length={length} segment_a_length={segment_a_length} predictions={predictions} "
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
    """Parse one ``.pair`` member. ``where`` names the shard/member in the error raised on a malformed record."""
    if len(data) < _HEADER.size:
        raise ValueError(f"{where}: truncated record ({len(data)} bytes)")
    n, seg_a, p, nsp, _ = _HEADER.unpack_from(data, 0)
    width = id_dtype.itemsize
    expected = _HEADER.size + n * width + p * 2 + p * width
    if len(data) != expected:
        raise ValueError(f"{where}: record is {len(data)} bytes, header says {expected} (length={n}, predictions={p})")
    off = _HEADER.size
    input_ids = np.frombuffer(data, dtype=id_dtype, count=n, offset=off)
    off += n * width
    positions = np.frombuffer(data, dtype="<u2", count=p, offset=off)
    off += p * 2
    masked_ids = np.frombuffer(data, dtype=id_dtype, count=p, offset=off)
    return Sample(input_ids, seg_a, positions, masked_ids, nsp)
