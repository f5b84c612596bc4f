"""Reading raw text corpora into documents, and sentence splitting.

Two input layouts, chosen per file by its suffix:

* BERT layout (any suffix but the JSON-lines ones): one sentence per line, a blank line between documents, as
  Google's ``create_pretraining_data.py`` reads. A file's end also ends its document.
* JSON lines (``.jsonl``, ``.ndjson``, ``.json``): one document per line, its text in the ``text`` field; documents
  are split into sentences by a real sentence splitter (blingfire when installed, else pysbd; the one used is
  recorded in ``index.json``).

Inputs may be files or directories; directories are walked recursively and files taken in sorted path order, so the
document order, and with it every shard, is a function of the inputs alone. Text must be UTF-8: an invalid byte is an
error that names the file, the line and the byte offset (silently replacing bytes would hide a wrong encoding).

Hostile text (:class:`TextLimits`). One line of hundreds of megabytes (a dump without newlines, a base64 blob) would
otherwise be held whole and tokenized whole, at tens of bytes per character. So no document holds more than
``max_document_bytes``: a longer line (a BERT-layout sentence or a whole JSON-lines document) is read in pieces of at
most that size and skipped, never held, and a longer BERT-layout document (no blank line for megabytes) is cut at a
sentence boundary. A sentence longer than ``max_sentence_chars`` (a BERT-layout line, or a sentence the splitter found
in a JSON-lines text) is skipped. All three are counted in a :class:`SkipCounts`. Skipping a sentence, not cutting it:
a cut would invent a sentence boundary, and a pair keeps at most ``seq_len - 3`` tokens of a sentence anyway. The
defaults are far above real prose (the longest segment at seq_len 512 is ~2,200 characters; a long book is a few MB).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

__all__ = ["JSONL_SUFFIXES", "DEFAULT_MAX_DOCUMENT_BYTES", "DEFAULT_MAX_SENTENCE_CHARS", "TextLimits", "SkipCounts",
           "input_files", "RawDocument", "iter_documents", "iter_training_texts", "split_sentences",
           "drop_long_sentences", "sentence_splitter_name", "add_limit_args"]

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
DEFAULT_MAX_DOCUMENT_BYTES = 16 * 2**20
DEFAULT_MAX_SENTENCE_CHARS = 100_000
_DRAIN_BYTES = 2**20  # the rest of an over-long line is read and dropped this many bytes at a time


@dataclass(frozen=True)
class TextLimits:
    """Caps that bound the memory a reader or a tokenizer spends on one line or sentence (module docstring)."""

    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES
    """A line (its ending included) longer than this is skipped without being held whole (a BERT-layout sentence or a
    JSON-lines document); a BERT-layout document is cut before a line that would take it past this size."""
    max_sentence_chars: int = DEFAULT_MAX_SENTENCE_CHARS
    """A sentence longer than this many characters (after stripping) is skipped; in training, a JSON-lines text is
    fed to the trainer in pieces of at most this size."""

    def __post_init__(self) -> None:
        for name in ("max_document_bytes", "max_sentence_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")


def add_input_args(parser: argparse.ArgumentParser) -> None:
    """``--input`` / ``--input-pattern``, shared by both data-prep CLIs."""
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE|DIR",
                        help="text files (BERT layout: one sentence per line, blank line between documents; or JSON "
                             "lines with a 'text' field, by the .jsonl/.json suffix) or directories, read recursively "
                             "in sorted order (hidden files skipped); the files read are listed before any work")
    parser.add_argument("--input-pattern", metavar="GLOB", default=None,
                        help="read only the files below an --input directory whose name matches GLOB, e.g. "
                             "'*.txt' (default: every file)")


def describe_inputs(files: Sequence[Path], limit: int = 10) -> str:
    """One line per input file (up to ``limit``) with its size, for a CLI to print before it starts."""
    total = sum(f.stat().st_size for f in files)
    lines = [f"reading {len(files)} input file(s), {total / 2**20:,.1f} MiB:"]
    lines += [f"  {f} ({f.stat().st_size / 2**20:,.2f} MiB)" for f in files[:limit]]
    if len(files) > limit:
        lines.append(f"  ... and {len(files) - limit} more")
    return "\n".join(lines)


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """The ``--max-document-bytes`` / ``--max-sentence-chars`` options both data-prep CLIs share."""
    parser.add_argument("--max-document-bytes", type=int, default=DEFAULT_MAX_DOCUMENT_BYTES, metavar="N",
                        help="skip (and count) a line longer than N bytes without holding it (a BERT-layout sentence "
                             "or a JSON-lines document); cut a BERT-layout document at N bytes (default %(default)s)")
    parser.add_argument("--max-sentence-chars", type=int, default=DEFAULT_MAX_SENTENCE_CHARS, metavar="N",
                        help="skip (and count) a sentence longer than N characters (default %(default)s; at seq_len "
                             "512 a whole segment is ~2,200)")


@dataclass
class SkipCounts:
    """What the limits dropped, counted as it is read."""

    long_lines: int = 0
    """Lines longer than ``max_document_bytes``, skipped."""
    long_sentences: int = 0
    """Sentences longer than ``max_sentence_chars``, skipped."""
    document_cuts: int = 0
    """Cuts made in BERT-layout documents longer than ``max_document_bytes`` (nothing is lost)."""


RawDocument = list[str] | str
"""A document as read: its sentences (BERT layout) or its whole text, still to be split (JSON lines)."""


def input_files(inputs: Sequence[str | Path] | str | Path, pattern: str | None = None) -> list[Path]:
    """Expand files and directories (recursively, sorted; hidden files skipped) into a list of files. ``pattern``
    (a shell pattern such as ``*.txt``) keeps only the files below a directory whose name matches; files named
    explicitly are always read."""
    if isinstance(inputs, str | Path):
        inputs = [inputs]
    if not inputs:
        raise ValueError("no inputs given")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob(pattern or "*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise ValueError(f"input directory {path} holds no files" +
                                 (f" matching --input-pattern {pattern!r}" if pattern else ""))
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {path} does not exist")
    return files


def _raw_lines(f, max_bytes: int) -> Iterator[tuple[bytes | None, int]]:
    """(line with its ending, or None for one longer than ``max_bytes``; bytes it took), never reading more than
    ``max_bytes + 1`` bytes of a line at once."""
    while raw := f.readline(max_bytes + 1):
        if len(raw) <= max_bytes:
            yield raw, len(raw)
            continue
        nbytes, ended = len(raw), raw.endswith(b"\n")
        del raw  # free it before draining the rest
        while not ended and (piece := f.readline(_DRAIN_BYTES)):
            nbytes += len(piece)
            ended = piece.endswith(b"\n")
        yield None, nbytes


def _decoded_lines(path: Path, max_bytes: int, skipped: SkipCounts
                   ) -> Iterator[tuple[int, str | None, int]]:
    """(line number, text without the line ending or None for a skipped over-long line, bytes), failing on invalid
    UTF-8 naming file, line and offset."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, (raw, nbytes) in enumerate(_raw_lines(f, max_bytes), start=1):
            if raw is None:
                skipped.long_lines += 1
                offset += nbytes
                yield lineno, None, nbytes
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid UTF-8 byte 0x{raw[exc.start]:02x} at byte offset "
                                 f"{offset + exc.start}; convert the file to UTF-8 (e.g. iconv)") from None
            offset += nbytes
            yield lineno, line.rstrip("\r\n"), nbytes


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in JSONL_SUFFIXES


def _iter_jsonl(path: Path, limits: TextLimits, skipped: SkipCounts) -> Iterator[tuple[str, int]]:
    for lineno, line, nbytes in _decoded_lines(path, limits.max_document_bytes, skipped):
        if line is None:
            yield "", nbytes  # an empty document: its bytes still count towards the chunk cut and the progress
            continue
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{path}:{lineno}: expected a JSON object with a string field 'text'")
        yield text, nbytes


def iter_documents(files: Iterable[Path], limits: TextLimits | None = None, skipped: SkipCounts | None = None
                   ) -> Iterator[tuple[RawDocument, int]]:
    """Yield ``(document, bytes read)`` for every document (blank ones included, as empty) in file order.

    Lines and BERT-layout sentences over ``limits`` are left out and counted in ``skipped``; a JSON-lines text is
    returned whole (its sentences are checked once split, see :func:`drop_long_sentences`)."""
    limits = limits or TextLimits()
    skipped = skipped if skipped is not None else SkipCounts()
    for path in files:
        if _is_jsonl(path):
            yield from _iter_jsonl(path, limits, skipped)
            continue
        yield from _iter_bert_layout(path, limits, skipped)


def _iter_bert_layout(path: Path, limits: TextLimits, skipped: SkipCounts) -> Iterator[tuple[list[str], int]]:
    doc: list[str] = []
    size = held = 0  # bytes read for the document, and bytes of its sentences
    for _, line, nbytes in _decoded_lines(path, limits.max_document_bytes, skipped):
        if line is not None:
            line = line.strip()
            if len(line) > limits.max_sentence_chars:
                skipped.long_sentences += 1
                line = None
        if line and held + nbytes > limits.max_document_bytes:
            skipped.document_cuts += 1
            yield doc, size
            doc, size, held = [], 0, 0
        size += nbytes
        if line is None:
            continue  # a skipped line is neither a sentence nor a document break
        if line:
            doc.append(line)
            held += nbytes
        elif doc:
            yield doc, size
            doc, size, held = [], 0, 0
    if doc or size:
        yield doc, size


def _pieces(text: str, size: int, skipped: SkipCounts) -> Iterator[str]:
    """``text`` in pieces of at most ``size`` characters, cut at a space or newline: the BERT pre-tokenizer splits
    words there anyway, so a trainer counts the same words as in the whole text. A run of more than ``size``
    characters without one is skipped and counted as a long sentence: no sentence holding it is short enough for
    shard creation either (and training on a multi-megabyte "word" takes minutes and GBs to learn noise)."""
    start = 0
    while len(text) - start > size:
        end = start + size
        cut = max(text.rfind(" ", start, end + 1), text.rfind("\n", start, end + 1))
        if cut >= start:
            yield text[start:cut]
            start = cut + 1
            continue
        skipped.long_sentences += 1
        ends = [i for i in (text.find(" ", end), text.find("\n", end)) if i >= 0]
        start = min(ends) + 1 if ends else len(text)
    yield text[start:]


def iter_training_texts(files: Iterable[Path], limits: TextLimits | None = None,
                        skipped: SkipCounts | None = None) -> Iterator[str]:
    """Texts to train a vocabulary on: each line of a BERT-layout file, each document of a JSON-lines file (in
    pieces of at most ``limits.max_sentence_chars`` characters, see :func:`_pieces`); limits as
    :func:`iter_documents`."""
    limits = limits or TextLimits()
    skipped = skipped if skipped is not None else SkipCounts()
    for doc, _ in iter_documents(files, limits, skipped):
        if isinstance(doc, str):
            yield from _pieces(doc, limits.max_sentence_chars, skipped)
        else:
            yield from doc


@lru_cache(maxsize=1)
def _splitter():
    try:
        import blingfire

        def split(text: str) -> list[str]:
            return blingfire.text_to_sentences(text).split("\n")

        return "blingfire", split
    except ImportError:
        import pysbd

        segmenter = pysbd.Segmenter(language="en", clean=False)
        return "pysbd", segmenter.segment


def sentence_splitter_name() -> str:
    return _splitter()[0]


_PARAGRAPH = re.compile(r"\n\s*\n")


def split_sentences(text: str) -> list[str]:
    """Split a document's text into sentences (paragraph breaks always end a sentence); blank ones dropped."""
    split = _splitter()[1]
    out: list[str] = []
    for para in _PARAGRAPH.split(text):
        para = " ".join(para.split())
        if para:
            out.extend(s for s in (s.strip() for s in split(para)) if s)
    return out


def drop_long_sentences(sentences: list[str], max_chars: int, skipped: SkipCounts) -> list[str]:
    """``sentences`` without those longer than ``max_chars`` characters, counted in ``skipped.long_sentences``."""
    kept = [s for s in sentences if len(s) <= max_chars]
    skipped.long_sentences += len(sentences) - len(kept)
    return kept
