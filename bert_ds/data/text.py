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
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path

__all__ = ["JSONL_SUFFIXES", "input_files", "RawDocument", "iter_documents", "iter_training_texts", "split_sentences",
           "sentence_splitter_name"]

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")

RawDocument = list[str] | str
"""A document as read: its sentences (BERT layout) or its whole text, still to be split (JSON lines)."""


def input_files(inputs: Sequence[str | Path] | str | Path) -> list[Path]:
    """Expand files and directories (recursively, sorted; hidden files skipped) into a list of files."""
    if isinstance(inputs, str | Path):
        inputs = [inputs]
    if not inputs:
        raise ValueError("no inputs given")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise ValueError(f"input directory {path} holds no files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {path} does not exist")
    return files


def _decoded_lines(path: Path) -> Iterator[tuple[int, str, int]]:
    """(line number, text without the line ending, bytes), failing on invalid UTF-8 naming file, line and offset."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid UTF-8 byte 0x{raw[exc.start]:02x} at byte offset "
                                 f"{offset + exc.start}; convert the file to UTF-8 (e.g. iconv)") from None
            offset += len(raw)
            yield lineno, line.rstrip("\r\n"), len(raw)


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in JSONL_SUFFIXES


def _iter_jsonl(path: Path) -> Iterator[tuple[str, int]]:
    for lineno, line, nbytes in _decoded_lines(path):
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


def iter_documents(files: Iterable[Path]) -> Iterator[tuple[RawDocument, int]]:
    """Yield ``(document, bytes read)`` for every document (blank ones included, as empty) in file order."""
    for path in files:
        if _is_jsonl(path):
            yield from _iter_jsonl(path)
            continue
        doc: list[str] = []
        size = 0
        for _, line, nbytes in _decoded_lines(path):
            size += nbytes
            line = line.strip()
            if line:
                doc.append(line)
            elif doc:
                yield doc, size
                doc, size = [], 0
        if doc or size:
            yield doc, size


def iter_training_texts(files: Iterable[Path]) -> Iterator[str]:
    """Texts to train a vocabulary on: each line of a BERT-layout file, each document of a JSON-lines file."""
    for doc, _ in iter_documents(files):
        if isinstance(doc, str):
            yield doc
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
