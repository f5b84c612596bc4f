"""Shard creation: raw text -> tokenized documents -> NSP pairs -> static masking -> tar shards + ``index.json``.

Determinism and memory. The input is read as a stream of documents and cut into *chunks* of consecutive documents
(about one shard's worth of input bytes, at document boundaries; the cut depends only on the inputs, ``seq_len`` and
``samples_per_shard``). A chunk is the unit of work: it is tokenized once, then paired ``dupe_factor`` times (random B
documents come from the same chunk) with RNGs seeded from ``(seed, chunk, dupe)``, and each duplicate is masked,
shuffled and written as *its own* shard, number ``chunk * dupe_factor + dupe`` (``shard-NNNNNN.tar``), whose sample
keys are ``<shard:06d><sample:06d>`` (unique in the set). One shard per duplicate because the loader permutes samples
only within a window of a few shards after shuffling the shard order each epoch: copies of a text kept in one shard
would all land in one window, and with large batches in one step; in separate shards the shard-order shuffle spreads
them apart. Workers (``multiprocessing``) and MPI ranks (``mpi4py`` under ``mpirun``; chunk c goes to rank c mod size;
every rank reads the input stream, only to find the cuts) only decide *who* processes a chunk, so every shard's bytes
and ``index.json`` are the same for any number of workers or ranks, and a process holds a few chunks at a time, never
the corpus, nor a huge document: no document reaches a chunk holding more than ``max_document_bytes`` and no sentence
more than ``max_sentence_chars`` characters (``text.TextLimits``: longer lines and sentences are skipped and counted,
longer BERT-layout documents cut), so a chunk exceeds its size by at most one such document. Rank 0 gathers the
``ShardInfo`` and writes ``index.json`` last and atomically; a failed run removes its shards and leaves no index.

Bad input (each a ``BadInput``/``FileNotFoundError``/``FileExistsError`` naming what is wrong): no documents in the
inputs; no chunk with two usable documents; invalid UTF-8 (file, line, byte offset); a JSON line without a string
``text``; malformed WikiExtractor or Parquet input (``text``'s module docstring; a file that fits no format is refused
before any work); a tokenizer directory without ``vocab.txt``; a ``seq_len`` below 5 (``[CLS] A [SEP] B [SEP]`` with one
token each) or above 65535; an output directory that already holds a shard set, the same or a different one (pass
``overwrite=True`` / ``--overwrite``; leftovers of an unfinished run, shards without an index, are simply replaced).
Counted skips, in ``index.json`` ``extra.skipped``: documents with fewer than two sentences (see ``pairs``),
sentences that tokenize to nothing, and chunks left with fewer than two such documents, which cannot draw a NotNext B
from another document (``unpaired_chunks``, and their lone usable documents ``unpaired_documents``; JSON-lines texts
are split into sentences only in the worker, so the cut may count a one-sentence text as usable), lines and
sentences over the ``text.TextLimits`` (``long_lines``, ``long_sentences``) and the cuts of over-long BERT-layout
documents (``document_cuts``, nothing lost). Only inputs from which no chunk can pair are an error.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import multiprocessing
import os
import random
import sys
import tempfile
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, defaults_of, option
from bert_ds.data.format import MEMBER_SUFFIX, Sample, encode_sample, encode_samples, id_dtype_for_vocab
from bert_ds.data.index import INDEX_NAME, ShardIndex, ShardInfo, ShardWriter, shard_name
from bert_ds.data.masking import (
    KEEP_PROB,
    MASK_PROB,
    RANDOM_PROB,
    default_max_predictions,
    mask_packed_pairs,
    mask_tokens,
    word_ids_from_pieces,
)
from bert_ds.data.pairs import Pair, create_pairs, pair_input_ids, tokenize_documents
from bert_ds.data.remote import is_url
from bert_ds.data.text import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    DEFAULT_MAX_SENTENCE_CHARS,
    InputArgs,
    RawDocument,
    SkipCounts,
    TextLimits,
    describe_inputs,
    detect_format,
    drop_long_sentences,
    input_bytes,
    input_files,
    iter_documents,
    sentence_splitter_name,
    split_sentences,
)
from bert_ds.data.tokenizer import WordPieceTokenizer, load_tokenizer
from bert_ds.errors import BadInput

__all__ = ["CreateParams", "ChunkResult", "create_shards", "iter_chunks", "process_chunk", "shard_index", "main"]

# Rough English WordPiece density and fill rate, used only to size chunks so that a shard holds about
# samples_per_shard samples (30k uncased vocab: ~4.3 bytes of text per token; pairs fill ~80% of seq_len on average).
_BYTES_PER_TOKEN = 4.3
_TOKENS_PER_SAMPLE_FILL = 0.8
_MIN_CHUNK_DOCUMENTS = 2  # random B needs another document in the chunk
_MAX_KEY = 10**6  # sample keys are <shard:06d><sample:06d>
_PAIRING, _MASKING, _SHUFFLE = 0, 1, 2  # RNG stream ids


@dataclass(frozen=True)
class CreateParams:
    """Everything a worker needs to turn a chunk into a shard (picklable)."""

    tokenizer_dir: str
    out_dir: str
    seq_len: int
    max_predictions: int
    dupe_factor: int
    short_seq_prob: float
    masked_lm_prob: float
    whole_word_mask: bool
    seed: int
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES
    max_sentence_chars: int = DEFAULT_MAX_SENTENCE_CHARS
    input_format: str = "auto"
    """``text.INPUT_FORMATS``: how the reader reads the inputs (workers get documents, never files)."""

    @property
    def limits(self) -> TextLimits:
        return TextLimits(self.max_document_bytes, self.max_sentence_chars)


@dataclass
class ChunkResult:
    index: int
    shards: list[ShardInfo]
    """One per duplicate, in duplicate order; empty for a chunk that could not pair."""
    counts: dict = field(default_factory=dict)


def iter_chunks(files: Sequence[Path], chunk_bytes: int, limits: TextLimits | None = None,
                skipped: SkipCounts | None = None, input_format: str = "auto"
                ) -> Iterator[tuple[int, list[RawDocument], int]]:
    """Cut the document stream into ``(chunk index, documents, bytes)``; the cut depends on the text alone.

    A chunk closes once it holds ``chunk_bytes`` bytes of input and at least two documents that may pair; a tail with
    less than half of that, or without two such documents, joins the chunk before it. Empty documents are dropped;
    text over ``limits`` is left out or cut and counted in ``skipped``; each file is read in its ``input_format``
    (``text.iter_documents``)."""
    pending: tuple[list[RawDocument], int] | None = None
    docs: list[RawDocument] = []
    nbytes = usable = 0
    index = 0
    for doc, size in iter_documents(files, limits, skipped, input_format):
        nbytes += size
        if not doc:
            continue
        docs.append(doc)
        usable += isinstance(doc, str) or len(doc) >= 2
        if nbytes >= chunk_bytes and usable >= _MIN_CHUNK_DOCUMENTS:
            if pending is not None:
                yield index, pending[0], pending[1]
                index += 1
            pending, docs, nbytes, usable = (docs, nbytes), [], 0, 0
    if docs:
        # The tail becomes a chunk of its own only if it is worth a shard (half a chunk) and can pair by itself.
        if pending is None or (usable >= _MIN_CHUNK_DOCUMENTS and 2 * nbytes >= chunk_bytes):
            if pending is not None:
                yield index, pending[0], pending[1]
                index += 1
            pending = (docs, nbytes)
        else:
            pending = (pending[0] + docs, pending[1] + nbytes)
    if pending is not None:
        yield index, pending[0], pending[1]


def _rng_seed(seed: int, chunk: int, dupe: int, stream: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, chunk, dupe, stream])


_TOKENIZERS: dict[str, WordPieceTokenizer] = {}


def _tokenizer(directory: str) -> WordPieceTokenizer:
    if directory not in _TOKENIZERS:
        _TOKENIZERS[directory] = load_tokenizer(directory)
    return _TOKENIZERS[directory]


def _encode_batch(ids: np.ndarray, pairs: list[Pair], rng: np.random.Generator, params: CreateParams, *, cls_id: int,
                  sep_id: int, mask_id: int, vocab_size: int) -> list[bytes]:
    """Assemble, mask (per token, ``mask_packed_pairs``) and encode (``encode_samples``) many pairs with whole-array
    operations, without the per-sample overhead of ``pair_input_ids`` + ``mask_tokens`` + ``encode_sample``."""
    n = len(pairs)
    if n == 0:
        return []
    table = np.array(pairs, dtype=np.int64).reshape(n, len(Pair._fields))
    a0, a1, b0, b1, labels = (table[:, i] for i in range(5))
    la, lb = a1 - a0, b1 - b0
    length = la + lb + 3
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(length, out=starts[1:])
    # Gather [CLS] A [SEP] B [SEP] for every pair in one indexing: ext = ids + [CLS, SEP] at its end.
    t = ids.shape[0]
    ext = np.concatenate([ids, np.array([cls_id, sep_id], dtype=ids.dtype)])
    ones = np.ones(n, dtype=np.int64)
    seg_start = np.stack([ones * t, a0, ones * (t + 1), b0, ones * (t + 1)], axis=1).ravel()
    seg_len = np.stack([ones, la, ones, lb, ones], axis=1).ravel()
    seg_off = np.zeros(seg_len.shape[0], dtype=np.int64)
    np.cumsum(seg_len[:-1], out=seg_off[1:])
    flat = ext[np.repeat(seg_start - seg_off, seg_len) + np.arange(int(starts[-1]))]

    masked, num, positions, original = mask_packed_pairs(
        flat, starts[:-1], la, lb, rng, max_predictions=params.max_predictions, vocab_size=vocab_size,
        mask_id=mask_id, masked_lm_prob=params.masked_lm_prob)
    pstart = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(num, out=pstart[1:])
    return encode_samples(masked, starts, la + 2, positions, pstart, original, labels, ids.dtype)


def shard_index(chunk: int, dupe: int, dupe_factor: int) -> int:
    """The shard holding duplicate ``dupe`` of chunk ``chunk``: each copy in its own shard (module docstring)."""
    return chunk * dupe_factor + dupe


def process_chunk(index: int, documents: list[RawDocument], params: CreateParams) -> ChunkResult:
    """Tokenize a chunk, then pair, mask, shuffle and write each of its ``dupe_factor`` copies as its own shard,
    ``shard_name(shard_index(index, dupe, dupe_factor))``. A chunk with fewer than two usable documents cannot draw a
    NotNext B from another document: it writes nothing and is counted (``unpaired_chunks``/``_documents``)."""
    tok = _tokenizer(params.tokenizer_dir)
    long = SkipCounts()  # JSON-lines sentences over the limit; BERT-layout ones never reach a chunk
    sentences = [drop_long_sentences(split_sentences(d), params.max_sentence_chars, long) if isinstance(d, str)
                 else d for d in documents]
    docs = tokenize_documents(sentences, tok)
    counts = {"documents": docs.num_documents, "sentences": int(docs.sentence_offsets.shape[0] - 1),
              "tokens": int(docs.ids.shape[0]), "skipped_short_documents": docs.skipped_short_documents,
              "skipped_empty_sentences": docs.skipped_empty_sentences, "skipped_unpaired_chunks": 0,
              "skipped_unpaired_documents": 0, "skipped_long_sentences": long.long_sentences, "samples": 0,
              "not_next": 0}
    if docs.num_documents < 2:
        # iter_chunks counts a JSON-lines text as usable before it is split, so a chunk can end up here with one
        # multi-sentence document (or none); losing it beats failing a long run over it.
        counts.update(documents=0, sentences=0, tokens=0, skipped_unpaired_chunks=int(docs.num_documents > 0),
                      skipped_unpaired_documents=docs.num_documents)
        return ChunkResult(index, [], counts)
    dtype = id_dtype_for_vocab(tok.vocab_size)
    ids = docs.ids.astype(dtype)
    cls_id, sep_id, mask_id, vocab_size = tok.cls_id, tok.sep_id, tok.mask_id, tok.vocab_size
    continuation = tok.continuation_table() if params.whole_word_mask else None
    shards: list[ShardInfo] = []
    for dupe in range(params.dupe_factor):
        shard = shard_index(index, dupe, params.dupe_factor)
        if shard >= _MAX_KEY:
            raise BadInput(f"chunk {index}, duplicate {dupe} needs shard {shard}, more than sample keys allow "
                           f"({_MAX_KEY} shards); raise samples_per_shard")
        py_rng = random.Random(int.from_bytes(_rng_seed(params.seed, index, dupe, _PAIRING).generate_state(4)
                                              .tobytes(), "little"))
        np_rng = np.random.default_rng(_rng_seed(params.seed, index, dupe, _MASKING))
        pairs = create_pairs(docs, py_rng, seq_len=params.seq_len, short_seq_prob=params.short_seq_prob)
        counts["not_next"] += sum(p.nsp_label for p in pairs)
        if continuation is None:
            payloads = _encode_batch(ids, pairs, np_rng, params, cls_id=cls_id, sep_id=sep_id, mask_id=mask_id,
                                     vocab_size=vocab_size)
        else:
            payloads = []
            for pair in pairs:  # whole-word masking: one sample at a time through mask_tokens
                input_ids, seg_a = pair_input_ids(ids, pair, cls_id=cls_id, sep_id=sep_id, dtype=dtype)
                candidates = np.ones(input_ids.shape[0], dtype=bool)
                candidates[[0, seg_a - 1, -1]] = False
                word_ids = word_ids_from_pieces(input_ids, continuation)
                masked, positions, original = mask_tokens(
                    input_ids, np_rng, candidates=candidates, max_predictions=params.max_predictions,
                    vocab_size=vocab_size, mask_id=mask_id, masked_lm_prob=params.masked_lm_prob, word_ids=word_ids)
                payloads.append(encode_sample(Sample(masked, seg_a, positions, original, pair.nsp_label), dtype))
        if len(payloads) >= _MAX_KEY:
            raise BadInput(f"chunk {index} produced {len(payloads)} samples in one copy, more than sample keys "
                           f"allow ({_MAX_KEY}); lower samples_per_shard")
        order = np.random.default_rng(_rng_seed(params.seed, index, dupe, _SHUFFLE)).permutation(len(payloads))
        counts["samples"] += len(payloads)
        with ShardWriter(Path(params.out_dir) / shard_name(shard)) as writer:
            for local, k in enumerate(order.tolist()):
                writer.write(f"{shard:06d}{local:06d}.{MEMBER_SUFFIX}", payloads[k])
            shards.append(writer.close())
    return ChunkResult(index, shards, counts)


def _init_worker() -> None:
    # One process per core already: keep the fast tokenizer from starting a thread per core in every worker.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("RAYON_NUM_THREADS", "1")


def _mpi_comm():
    """The MPI world communicator when launched by mpirun/srun with more than one rank, else None."""
    sizes = [int(os.environ.get(var, "1")) for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE",
                                                         "MV2_COMM_WORLD_SIZE")]
    # `srun --mpi=pmix` sets PMIX_RANK but no size variable: the job step's task count is the world size.
    if "PMIX_RANK" in os.environ:
        sizes.append(int(os.environ.get("SLURM_STEP_NUM_TASKS", "1")))
    if max(sizes) > 1:
        from mpi4py import MPI

        return MPI.COMM_WORLD
    return None


LOCK_NAME = ".create_shards.lock"
"""Held (``flock``) from before ``--out`` is touched until ``index.json`` is written: a second ``create_shards`` on the
same directory is refused at once instead of deleting the first one's shards under it."""


class OutDirLock:
    """An exclusive, non-blocking ``flock`` on ``<out>/.create_shards.lock``; the kernel drops it if the holder dies."""

    def __init__(self, out: Path):
        self.path = out / LOCK_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise FileExistsError(f"output directory {out} is being written by another create_shards (pid {holder}, "
                                  f"lock {self.path}); wait for it to finish or choose another --out") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self, remove: bool = False) -> None:
        if self._fd < 0:
            return
        if remove:  # only when the directory itself goes away with a failed run
            self.path.unlink(missing_ok=True)
        os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = -1


def _prepare_out_dir(out: Path, overwrite: bool) -> tuple[list[Path], OutDirLock]:
    """Lock ``out`` and make it ready for a new set; returns the directories this made (``out`` and missing parents),
    outermost first, so that a failed run can remove them again, and the lock, held until the index is written."""
    made = [d for d in reversed([out, *out.parents]) if not d.exists()]
    out.mkdir(parents=True, exist_ok=True)
    lock = OutDirLock(out)
    try:
        _clear_out_dir(out, overwrite)
    except BaseException:
        lock.release()
        raise
    return made, lock


def _clear_out_dir(out: Path, overwrite: bool) -> None:
    index = out / INDEX_NAME
    if index.exists():
        if not overwrite:
            try:
                old = ShardIndex.load(out)
                what = f"a shard set ({old.total_samples} samples, seq_len {old.seq_len}, seed {old.seed})"
            except ValueError as exc:
                what = f"an unreadable {INDEX_NAME} ({exc})"
            raise FileExistsError(f"output directory {out} already holds {what}; pass --overwrite (overwrite=True) "
                                  f"to replace it, or choose another directory")
        index.unlink()  # first, so that a crash while rebuilding never leaves an index naming missing shards
    for stale in list(out.glob("shard-*.tar")) + list(out.glob("shard-*.tar.tmp")) + list(out.glob("*.json.tmp")):
        stale.unlink()  # an overwritten set, or the leftovers of an unfinished run (no index: never complete)


def _check_written(out: Path, index: ShardIndex) -> None:
    """``index.json`` is written only over shards that exist with the size this run wrote (their checksums were taken
    as each was closed; readers verify them)."""
    for info in index.shards:
        path = out / info.name
        size = path.stat().st_size if path.is_file() else None
        if size != info.bytes:
            state = "is missing" if size is None else f"has {size} bytes, this run wrote {info.bytes}"
            raise OSError(f"{path} {state}: something else changed {out} during shard creation; "
                               f"no {INDEX_NAME} written")


def _run_chunks(files: list[Path], params: CreateParams, chunk_bytes: int, workers: int, rank: int, size: int,
                written: list[Path], progress, read_skipped: SkipCounts) -> list[ChunkResult]:
    results: list[ChunkResult] = []
    samples = 0

    def done(res: ChunkResult) -> None:
        nonlocal samples
        results.append(res)
        samples += res.counts["samples"]
        progress.set_postfix({"samples" if size == 1 else "rank 0 samples": samples}, refresh=False)

    if workers == 1:
        for index, docs, nbytes in iter_chunks(files, chunk_bytes, params.limits, read_skipped, params.input_format):
            if index % size == rank:
                written.extend(Path(params.out_dir) / shard_name(shard_index(index, d, params.dupe_factor))
                               for d in range(params.dupe_factor))
                done(process_chunk(index, docs, params))
            progress.update(nbytes)
        return results
    ctx = multiprocessing.get_context("spawn")  # no fork: the tokenizer's threads and MPI do not survive a fork
    with ctx.Pool(workers, initializer=_init_worker) as pool:
        in_flight: deque = deque()
        for index, docs, nbytes in iter_chunks(files, chunk_bytes, params.limits, read_skipped, params.input_format):
            if index % size == rank:
                written.extend(Path(params.out_dir) / shard_name(shard_index(index, d, params.dupe_factor))
                               for d in range(params.dupe_factor))
                in_flight.append((pool.apply_async(process_chunk, (index, docs, params)), nbytes))
            else:
                progress.update(nbytes)
            while len(in_flight) > 2 * workers:  # bounded: a few chunks in memory, never the corpus
                res, c = in_flight.popleft()
                done(res.get())
                progress.update(c)
        while in_flight:
            res, c = in_flight.popleft()
            done(res.get())
            progress.update(c)
    return results


def _check_create_args(seq_len: int, max_predictions: int, dupe_factor: int, short_seq_prob: float,
                       masked_lm_prob: float, seed: int, workers: int, samples_per_shard: int) -> None:
    if not isinstance(seq_len, int) or seq_len < 5:
        raise BadInput(f"seq_len={seq_len!r} is too small for [CLS] A [SEP] B [SEP] (needs at least 5)")
    if seq_len > 65535:
        raise BadInput(f"seq_len={seq_len} exceeds the shard format's 16-bit lengths (max 65535)")
    if not 1 <= max_predictions <= seq_len - 3:
        raise BadInput(f"max_predictions={max_predictions} must be in [1, seq_len - 3 = {seq_len - 3}]")
    if not 0.0 < masked_lm_prob < 1.0:
        raise BadInput(f"masked_lm_prob={masked_lm_prob} must be in (0, 1)")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise BadInput(f"short_seq_prob={short_seq_prob} must be in [0, 1]")
    for name, value, hi in (("dupe_factor", dupe_factor, 1000), ("workers", workers, 4096),
                            ("samples_per_shard", samples_per_shard, _MAX_KEY // 2)):
        if not isinstance(value, int) or not 1 <= value <= hi:
            raise BadInput(f"{name}={value!r} must be an integer in [1, {hi}]")
    if not isinstance(seed, int) or seed < 0:
        raise BadInput(f"seed={seed!r} must be a non-negative integer")


def _prepare_out_dir_on_rank0(out: Path, overwrite: bool, comm, rank: int) -> tuple[list[Path], OutDirLock | None]:
    """Rank 0 locks and prepares the output directory (returning the directories it made and the lock); under MPI
    every rank raises the same error if it could not."""
    error: str | None = None
    made: list[Path] = []
    lock = None
    if rank == 0:
        try:
            made, lock = _prepare_out_dir(out, overwrite)
        except Exception as exc:
            error = str(exc)
            if comm is None:
                raise
    if comm is not None:
        error = comm.bcast(error, root=0)
        if error is not None:
            raise FileExistsError(error)
    return made, lock


def _create_all_chunks(files: list[Path], params: CreateParams, chunk_bytes: int, workers: int, comm, rank: int,
                       size: int, progress: bool | None) -> tuple[list[ChunkResult], SkipCounts]:
    """Every rank's chunk results, in chunk order, and what reading the inputs skipped (every rank reads them all, so
    each counts the same); on a failure anywhere, this rank's shards are removed and the error raised on every rank."""
    from tqdm import tqdm

    total_bytes = sum(input_bytes(f, params.input_format) for f in files)
    written: list[Path] = []
    results: list[ChunkResult] = []
    read_skipped = SkipCounts()
    failure: BaseException | None = None
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="create_shards",
              disable=True if rank != 0 else (None if progress is None else not progress)) as bar:
        try:
            results = _run_chunks(files, params, chunk_bytes, workers, rank, size, written, bar, read_skipped)
        except BaseException as exc:  # noqa: B036 - clean up our shards on any failure, then re-raise
            failure = exc
    outcomes = [(results, None if failure is None else f"{type(failure).__name__}: {failure}")]
    if comm is not None:
        outcomes = comm.allgather(outcomes[0])
    failed = [(r, msg) for r, (_, msg) in enumerate(outcomes) if msg is not None]
    if failed:
        for path in written:
            path.unlink(missing_ok=True)
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)
        if failure is not None:
            raise failure
        raise RuntimeError(f"shard creation failed on MPI rank {failed[0][0]}: {failed[0][1]}")
    return sorted((r for res, _ in outcomes for r in res), key=lambda r: r.index), read_skipped


def _skip_note(long_lines: int, long_sentences: int, params: CreateParams) -> str:
    """What the text limits left out, for an error about too little usable text ('' when nothing)."""
    parts = [f"{n} {what} skipped" for n, what in (
        (long_lines, f"line(s) longer than max_document_bytes={params.max_document_bytes}"),
        (long_sentences, f"sentence(s) longer than max_sentence_chars={params.max_sentence_chars}")) if n]
    return f" ({'; '.join(parts)})" if parts else ""


def _shard_index(all_results: list[ChunkResult], read_skipped: SkipCounts, files: list[Path], tok,
                 params: CreateParams, tokenizer_dir: str | Path, chunk_bytes: int) -> ShardIndex:
    """The set's ``index.json`` from every chunk's shards and counts; refuses a set with no samples, saying why."""
    long_sentences = read_skipped.long_sentences + sum(r.counts["skipped_long_sentences"] for r in all_results)
    note = _skip_note(read_skipped.long_lines, long_sentences, params)
    if not all_results:
        raise BadInput(f"no documents in the inputs ({', '.join(str(f) for f in files[:5])}"
                       f"{', ...' if len(files) > 5 else ''}): empty or blank files{note}")
    counts = {k: sum(r.counts[k] for r in all_results) for k in all_results[0].counts}
    shards = [s for r in all_results for s in r.shards]
    if not shards:
        if counts["skipped_unpaired_documents"]:
            n = counts["skipped_unpaired_documents"]
            raise BadInput(f"no NotNext pair can be drawn: every chunk of the inputs holds at most one document with "
                           f"two or more sentences ({n} such document(s) in all), and a random B must come from "
                           f"another document; the inputs need more multi-sentence documents{note}")
        raise BadInput(f"no usable documents in the inputs: all {counts['skipped_short_documents']} documents have "
                       f"fewer than two sentences (BERT layout: one sentence per line, blank line between "
                       f"documents){note}")
    seq_len = params.seq_len
    return ShardIndex(
        seq_len=seq_len, vocab_size=tok.vocab_size, vocab_sha256=tok.vocab_sha256,
        id_dtype=id_dtype_for_vocab(tok.vocab_size).str, lowercase=tok.lowercase,
        masking={"static": True, "masked_lm_prob": params.masked_lm_prob, "max_predictions": params.max_predictions,
                 "whole_word_mask": params.whole_word_mask, "mask_prob": MASK_PROB, "random_prob": RANDOM_PROB,
                 "keep_prob": KEEP_PROB},
        pairing={"nsp": True, "short_seq_prob": params.short_seq_prob, "dupe_factor": params.dupe_factor,
                 "target_length": seq_len - 3, "nsp_labels": {"is_next": 0, "not_next": 1}},
        seed=params.seed, shards=shards, total_samples=sum(s.samples for s in shards),
        extra={"inputs": [str(f) for f in files], "tokenizer_dir": str(tokenizer_dir),
               "sentence_splitter": sentence_splitter_name(), "chunk_bytes": chunk_bytes,
               "limits": {"max_document_bytes": params.max_document_bytes,
                          "max_sentence_chars": params.max_sentence_chars},
               "counts": {k: counts[k] for k in ("documents", "sentences", "tokens", "samples", "not_next")},
               "skipped": {"short_documents": counts["skipped_short_documents"],
                           "empty_sentences": counts["skipped_empty_sentences"],
                           "unpaired_chunks": counts["skipped_unpaired_chunks"],
                           "unpaired_documents": counts["skipped_unpaired_documents"],
                           "long_lines": read_skipped.long_lines, "long_sentences": long_sentences,
                           "document_cuts": read_skipped.document_cuts}},
    )


def create_shards(inputs: Sequence[str | Path] | str | Path, tokenizer_dir: str | Path, out_dir: str | Path, *,
                  seq_len: int, max_predictions: int | None = None, dupe_factor: int = 1, short_seq_prob: float = 0.1,
                  masked_lm_prob: float = 0.15, whole_word_mask: bool = False, seed: int = 12345, workers: int = 1,
                  samples_per_shard: int = 10000, overwrite: bool = False, progress: bool | None = None,
                  max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
                  max_sentence_chars: int = DEFAULT_MAX_SENTENCE_CHARS, input_format: str = "auto") -> ShardIndex:
    """Create a statically masked NSP shard set from raw text (see the module docstring); returns its index.

    ``progress``: a tqdm bar on rank 0 (None: only when stderr is a terminal). ``max_document_bytes`` and
    ``max_sentence_chars``: longer lines and sentences are skipped and counted, longer BERT-layout documents cut
    (``text.TextLimits``). ``input_format``: ``text.INPUT_FORMATS``, ``auto`` detecting each file's; the formats
    read are counted in ``index.json`` ``extra.input_formats``. ``out_dir`` may be a URL: staged, then uploaded."""
    if is_url(str(out_dir)):
        options = dict(seq_len=seq_len, max_predictions=max_predictions, dupe_factor=dupe_factor,
                       short_seq_prob=short_seq_prob, masked_lm_prob=masked_lm_prob, whole_word_mask=whole_word_mask,
                       seed=seed, workers=workers, samples_per_shard=samples_per_shard, progress=progress,
                       max_document_bytes=max_document_bytes, max_sentence_chars=max_sentence_chars,
                       input_format=input_format)
        return _create_at_url(inputs, tokenizer_dir, str(out_dir), overwrite, options)
    if max_predictions is None and isinstance(seq_len, int) and seq_len >= 5:
        max_predictions = default_max_predictions(seq_len)
    _check_create_args(seq_len, max_predictions, dupe_factor, short_seq_prob, masked_lm_prob, seed, workers,
                       samples_per_shard)
    TextLimits(max_document_bytes, max_sentence_chars)  # refuses a bad limit, naming it, before any work
    tok = load_tokenizer(tokenizer_dir)  # fails early, naming the directory, when vocab.txt is missing
    files = input_files(inputs)
    formats = Counter(detect_format(f, input_format) for f in files)  # a file no format fits fails before any work
    out = Path(out_dir)
    params = CreateParams(str(Path(tokenizer_dir)), str(out), seq_len, max_predictions, dupe_factor, short_seq_prob,
                          masked_lm_prob, whole_word_mask, seed, max_document_bytes, max_sentence_chars, input_format)
    # A chunk makes dupe_factor shards, each one pass over the chunk: size it for one shard's samples.
    chunk_bytes = max(1, round(samples_per_shard * _TOKENS_PER_SAMPLE_FILL * seq_len * _BYTES_PER_TOKEN))

    comm = _mpi_comm()
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    made, lock = _prepare_out_dir_on_rank0(out, overwrite, comm, rank)
    try:
        all_results, read_skipped = _create_all_chunks(files, params, chunk_bytes, workers, comm, rank, size,
                                                       progress)
        index = _shard_index(all_results, read_skipped, files, tok, params, tokenizer_dir, chunk_bytes)
        index.extra.update(input_format=input_format, input_formats=dict(sorted(formats.items())))
    except BaseException:
        if lock is not None:
            lock.release(remove=out in made)
        for directory in reversed(made):  # the failed run's shards are gone: leave no empty --out behind either
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    try:
        if comm is not None:
            comm.Barrier()  # every rank's shards are closed
        if rank == 0:
            _check_written(out, index)
            index.write(out)
    finally:
        if lock is not None:
            lock.release()
    if comm is not None:
        comm.Barrier()
    return index


def _create_at_url(inputs, tokenizer_dir, url: str, overwrite: bool, options: dict) -> ShardIndex:
    """:func:`create_shards` to a store: staged in a temporary directory, uploaded by
    :func:`bert_ds.data.shard_cache.upload_shard_set` (index.json last, so no reader sees a partial set)."""
    comm = _mpi_comm()
    if comm is not None and comm.Get_size() > 1:
        raise BadInput(f"--out {url}: a URL is staged by one process; under mpirun give --out a shared directory and "
                       "copy the set to the store afterwards, index.json last")
    from bert_ds.data.shard_cache import check_upload_target, upload_shard_set

    check_upload_target(url, overwrite)  # refuse an existing set before any work
    with tempfile.TemporaryDirectory(prefix="bert_ds-create-") as staging:
        index = create_shards(inputs, tokenizer_dir, Path(staging) / "set", **options)
        upload_shard_set(Path(staging) / "set", url, overwrite=overwrite)
    return index


_CREATE_DEFAULTS = defaults_of(create_shards)


@dataclass(kw_only=True)
class CreateShardsArgs(InputArgs):
    """``bert-ds-create-shards``' options (:mod:`bert_ds.cli_args`); defaults are :func:`create_shards`'."""

    tokenizer: str = option(metavar="DIR", help="tokenizer directory holding vocab.txt (tools/train_tokenizer.py's "
                            "--out, or Google's)")
    seq_len: int
    """Tokens per sample: 128 (phase 1) or 512 (phase 2)."""
    out: str = option(metavar="DIR", help="output directory: shards + index.json; or an object-store URL (s3://, "
                      "gs://): staged locally, then uploaded with index.json last")
    max_predictions: int | None = _CREATE_DEFAULTS["max_predictions"]
    """Masked positions per sample (default: 20 at seq 128, 80 at 512, as Google/NVIDIA)."""
    dupe_factor: int = option(_CREATE_DEFAULTS["dupe_factor"], help="copies of the corpus, each with other pairs and "
                              "masks (default %(default)s; NVIDIA's recipe uses 5, Google's 10)")
    short_seq_prob: float = option(_CREATE_DEFAULTS["short_seq_prob"], help="probability of a shorter random target "
                                   "length (default %(default)s, Google's)")
    masked_lm_prob: float = option(_CREATE_DEFAULTS["masked_lm_prob"], help="fraction of tokens masked (default "
                                   "%(default)s, BERT paper §3.1)")
    whole_word_mask: bool = _CREATE_DEFAULTS["whole_word_mask"]
    """Mask all pieces of a word together."""
    seed: int = _CREATE_DEFAULTS["seed"]
    """The output depends only on the inputs and this."""
    workers: int = _CREATE_DEFAULTS["workers"]
    """Processes per rank (under mpirun: per MPI rank)."""
    samples_per_shard: int = _CREATE_DEFAULTS["samples_per_shard"]
    overwrite: bool = _CREATE_DEFAULTS["overwrite"]
    """Replace a shard set already in --out."""


def cli_parser() -> argparse.ArgumentParser:
    return build_parser(CreateShardsArgs, "bert-ds-create-shards", __doc__.splitlines()[0])


main = alias("create-shards")


def _run(args: CreateShardsArgs) -> None:
    files = input_files(args.input, args.input_pattern)
    if _mpi_comm() is None or _mpi_comm().Get_rank() == 0:
        print(describe_inputs(files, input_format=args.input_format), flush=True)
    index = create_shards(files, args.tokenizer, args.out, seq_len=args.seq_len,
                          max_predictions=args.max_predictions, dupe_factor=args.dupe_factor,
                          short_seq_prob=args.short_seq_prob, masked_lm_prob=args.masked_lm_prob,
                          whole_word_mask=args.whole_word_mask, seed=args.seed, workers=args.workers,
                          samples_per_shard=args.samples_per_shard, overwrite=args.overwrite,
                          max_document_bytes=args.max_document_bytes, max_sentence_chars=args.max_sentence_chars,
                          input_format=args.input_format)
    if _mpi_comm() is None or _mpi_comm().Get_rank() == 0:
        skipped = index.extra["skipped"]
        print(f"wrote {len(index.shards)} shards, {index.total_samples} samples to {args.out}/{INDEX_NAME}; "
              f"skipped {skipped['long_lines']} line(s) over --max-document-bytes and {skipped['long_sentences']} "
              f"sentence(s) over --max-sentence-chars; cut {skipped['document_cuts']} document(s)")


if __name__ == "__main__":
    sys.exit(main())
