"""Reading raw text corpora into documents, and sentence splitting.

Input formats (:data:`INPUT_FORMATS`; ``--input-format``, default ``auto``, decided per file):

* ``bert``: one sentence per line, a blank line between documents, as Google's ``create_pretraining_data.py`` reads.
  A file's end also ends its document.
* ``jsonl``: JSON lines, one document per line, its text in the ``text`` field. The text is split into sentences by a
  real sentence splitter (blingfire when installed, else pysbd; the one used is recorded in ``index.json``); a blank
  line inside it always ends a sentence, a single line break does not (it may be a wrapped line).
* ``wikiextractor``: the output of WikiExtractor (``pip install wikiextractor``), both its default form, blocks of
  ``<doc id=".." url=".." title="..">`` / the article's lines / ``</doc>``, and its ``--json`` form, one
  ``{"id", "url", "title", "text"}`` object per line. Every line of an article is a paragraph (a heading, which
  WikiExtractor ends with a period, is one too), split into sentences by the same splitter. The first line of a
  ``<doc>`` body is the article's title, and it is dropped: it is a name, not a sentence, and the ``--json`` form
  leaves it out of ``text``, so both forms give the same documents (NVIDIA's BERT recipe drops it as well). The
  ``&``, ``<`` and ``>`` that WikiExtractor escapes by default (``--html-safe``, which is what keeps a literal
  ``</doc>`` in an article from ending it) are unescaped.
* ``parquet``: Parquet files with a string ``text`` column, how Hugging Face hub corpora ship; read like JSON lines,
  a row a document, and streamed a batch of rows at a time (needs ``pip install 'bert_ds[parquet]'``).

``auto`` decides per file: a ``.parquet`` suffix (or Parquet's ``PAR1`` magic) is Parquet; otherwise the first
non-blank line decides, the suffix only breaking a tie: a WikiExtractor ``<doc id="...">`` header is WikiExtractor, a
line that starts as WikiExtractor's ``--json`` records do (``{"id": "..", ["revid": "..",] "url": ..``) is
WikiExtractor JSON, a line that parses as a JSON object is JSON lines, as is every ``.jsonl``/``.ndjson``/``.json``
file; anything else is BERT layout. So WikiExtractor's ``AA/wiki_00`` files need no flag, and a BERT-layout file whose
first sentence merely starts with ``{`` or ``<doc`` (``{braces} are ...``) stays BERT layout whatever its suffix,
because that line is neither a JSON object nor a ``<doc id=..>`` header. A ``.txt`` file whose first line is a whole
JSON object is taken as JSON lines; pass ``--input-format bert`` for the (odd) BERT-layout file that starts so. An
explicit format reads every file as that format (``wikiextractor`` still tells its two forms apart by the first line).
Compressed files (bzip2, e.g. WikiExtractor's ``-c``; gzip) are refused by name: decompress them first.

Inputs may be files or directories; directories are walked recursively and files taken in sorted path order, so the
document order, and with it every shard, is a function of the inputs alone. Text must be UTF-8: an invalid byte is an
error that names the file, the line and the byte offset (silently replacing bytes would hide a wrong encoding).
Malformed input is one ``BadInput`` naming the file and line: a bad JSON line, a ``<doc>`` never closed (the file
ends, or the next ``<doc>`` starts, first), text outside a ``<doc>`` block, a Parquet file without a ``text`` column
(naming the columns it has) or not readable as Parquet.

Hostile text (:class:`TextLimits`). One line of hundreds of megabytes (a dump without newlines, a base64 blob) would
otherwise be held whole and tokenized whole, at tens of bytes per character. So no document holds more than
``max_document_bytes``: a longer line (a BERT-layout sentence, a WikiExtractor paragraph or a whole JSON-lines
document) is read in pieces of at most that size and skipped, never held, a longer Parquet ``text`` value is skipped
before Python copies it (Arrow has to decode the value, the format allows no less), and a longer BERT-layout or
WikiExtractor ``<doc>`` document (megabytes without a document break) is cut at a line boundary. A sentence longer
than ``max_sentence_chars`` (a BERT-layout line, or a sentence the splitter found in a text) is skipped. All are
counted in a :class:`SkipCounts`. Skipping a sentence, not cutting it: a cut would invent a sentence boundary, and a
pair keeps at most ``seq_len - 3`` tokens of a sentence anyway. The defaults are far above real prose (the longest
segment at seq_len 512 is ~2,200 characters; a long book is a few MB).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from bert_ds.cli_args import option
from bert_ds.errors import BadInput

__all__ = ["JSONL_SUFFIXES", "INPUT_FORMATS", "DEFAULT_MAX_DOCUMENT_BYTES", "DEFAULT_MAX_SENTENCE_CHARS",
           "TextLimits", "SkipCounts", "input_files", "detect_format", "input_bytes", "describe_inputs",
           "RawDocument", "iter_documents", "iter_training_texts", "split_sentences", "drop_long_sentences",
           "sentence_splitter_name", "InputArgs"]

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
INPUT_FORMATS = ("auto", "bert", "jsonl", "wikiextractor", "parquet")
"""What ``--input-format`` accepts; :func:`detect_format` also answers ``wikiextractor-json`` (WikiExtractor's
``--json`` form)."""
DEFAULT_MAX_DOCUMENT_BYTES = 16 * 2**20
DEFAULT_MAX_SENTENCE_CHARS = 100_000
_DRAIN_BYTES = 2**20  # the rest of an over-long line is read and dropped this many bytes at a time
_SNIFF_BYTES = 2**20  # detect_format reads at most this much of a file
# A Parquet batch holds this many rows' text (Arrow memory, then Python strings): a few MB of typical documents, so
# memory stays bounded however large the file. The file is read in 1 MiB pieces, without pre-buffering (pyarrow's
# default, pre_buffer=True, reads the column of every row group ahead: a 160 MB text column held 11 MB of Arrow
# memory, and more the less it compresses; now 2.5 MB for any size).
_PARQUET_BATCH_ROWS = 256
_PARQUET_BUFFER_BYTES = 2**20
_COMPRESSED = ((re.compile(rb"BZh[1-9]"), "bzip2 (e.g. WikiExtractor -c)"), (re.compile(rb"\x1f\x8b"), "gzip"))
# WikiExtractor (3.x, extract.py Extractor.extract): '<doc id="%s" url="%s" title="%s">' opens an article, and
# json.dumps({"id", ["revid",] "url", "title", "text"}) is a --json record, "text" last.
_WIKI_HEADER = re.compile(r'<doc id="[^"\n]*"[^\n]*>')
_JSON_STR = r'"(?:[^"\\]|\\.)*"'
_WIKI_JSON = re.compile(rf'\{{"id": {_JSON_STR}, (?:"revid": {_JSON_STR}, )?"url": {_JSON_STR}, "title": {_JSON_STR}, '
                        rf'"text": "')


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
                raise BadInput(f"{name}={value!r} must be a positive integer")


def describe_inputs(files: Sequence[Path], limit: int = 10, input_format: str = "auto") -> str:
    """One line per input file (up to ``limit``) with its size and format, for a CLI to print before it starts (a
    file whose format cannot be read fails here, before any work)."""
    total = sum(f.stat().st_size for f in files)
    lines = [f"reading {len(files)} input file(s), {total / 2**20:,.1f} MiB:"]
    lines += [f"  {f} ({f.stat().st_size / 2**20:,.2f} MiB, {detect_format(f, input_format)})" for f in files[:limit]]
    if len(files) > limit:
        lines.append(f"  ... and {len(files) - limit} more")
    return "\n".join(lines)


@dataclass(kw_only=True)
class InputArgs:
    """The options both data-prep CLIs share (bert-ds-train-tokenizer, bert-ds-create-shards; :mod:`bert_ds.cli_args`
    generates them): what to read, and the limits applied while reading."""

    input: list[str] = option(nargs="+", metavar="FILE|DIR", help="text files or directories, read recursively in "
                              "sorted order (hidden files skipped); the files read are listed, with their format, "
                              "before any work")
    input_pattern: str | None = option(None, metavar="GLOB", help="read only the files below an --input directory "
                                       "whose name matches GLOB, e.g. '*.txt' (default: every file)")
    input_format: str = option("auto", choices=INPUT_FORMATS, help="bert: one sentence per line, blank line "
                               "between documents; jsonl: one JSON object per line with a 'text' field; "
                               "wikiextractor: WikiExtractor output, <doc> blocks or --json; parquet: a 'text' column. "
                               "auto (default): .parquet is Parquet, else the first non-blank line decides (<doc "
                               "id=..> header, JSON object, else BERT layout; .jsonl/.json are always JSON lines)")
    max_document_bytes: int = option(DEFAULT_MAX_DOCUMENT_BYTES, metavar="N", help="skip (and count) a line longer "
                                     "than N bytes without holding it (a BERT-layout sentence or a JSON-lines "
                                     "document); cut a BERT-layout document at N bytes")
    max_sentence_chars: int = option(DEFAULT_MAX_SENTENCE_CHARS, metavar="N", help="skip (and count) a sentence "
                                     "longer than N characters (default %(default)s; at seq_len 512 a whole segment "
                                     "is ~2,200)")


@dataclass
class SkipCounts:
    """What the limits dropped, counted as it is read."""

    long_lines: int = 0
    """Lines (or Parquet ``text`` values) longer than ``max_document_bytes``, skipped."""
    long_sentences: int = 0
    """Sentences longer than ``max_sentence_chars``, skipped."""
    document_cuts: int = 0
    """Cuts made in BERT-layout or WikiExtractor ``<doc>`` documents longer than ``max_document_bytes`` (nothing is
    lost)."""


RawDocument = list[str] | str
"""A document as read: its sentences (BERT layout) or its whole text, still to be split (every other format; a
WikiExtractor article's lines are joined by blank lines, so that each is a paragraph to :func:`split_sentences`)."""


def input_files(inputs: Sequence[str | Path] | str | Path, pattern: str | None = None) -> list[Path]:
    """Expand files and directories (recursively, sorted; hidden files skipped) into a list of files. ``pattern``
    (a shell pattern such as ``*.txt``) keeps only the files below a directory whose name matches; files named
    explicitly are always read."""
    if isinstance(inputs, str | Path):
        inputs = [inputs]
    if not inputs:
        raise BadInput("no inputs given")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob(pattern or "*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise BadInput(f"input directory {path} holds no files" +
                               (f" matching --input-pattern {pattern!r}" if pattern else ""))
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"input {path} does not exist")
    return files


def _sniff(path: Path) -> tuple[bytes, str, bool]:
    """The file's first 4 bytes, its first non-blank line (stripped, a UTF-8 BOM dropped; at most ``_SNIFF_BYTES``
    of it) and whether that line is whole."""
    with open(path, "rb") as f:
        magic = f.read(4)
        f.seek(0)
        seen = 0
        while seen < _SNIFF_BYTES and (raw := f.readline(_SNIFF_BYTES)):
            seen += len(raw)
            if raw.strip():
                whole = raw.endswith(b"\n") or not f.read(1)
                return magic, raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8", "replace").strip(), whole
    return magic, "", True


def _is_json_object(line: str, whole: bool) -> bool:
    if not line.startswith("{"):
        return False
    if not whole:  # a first line over _SNIFF_BYTES: no sentence is that long, a JSON document may be
        return line.startswith('{"')
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):
        return False


def detect_format(path: str | Path, input_format: str = "auto") -> str:
    """How :func:`iter_documents` reads ``path``: ``bert``, ``jsonl``, ``wikiextractor`` (``<doc>`` blocks),
    ``wikiextractor-json`` or ``parquet``. ``auto`` sniffs the file (rule in the module docstring); an explicit
    format is taken as given, except that ``wikiextractor`` picks its form from the first line."""
    if input_format not in INPUT_FORMATS:
        raise BadInput(f"input_format={input_format!r} must be one of {', '.join(INPUT_FORMATS)}")
    path = Path(path)
    if input_format in ("bert", "jsonl", "parquet"):
        return input_format
    if input_format == "auto" and path.suffix.lower() == ".parquet":
        return "parquet"
    magic, line, whole = _sniff(path)
    if input_format == "auto" and magic == b"PAR1":
        return "parquet"
    for pattern, kind in _COMPRESSED:
        if pattern.match(magic):
            raise BadInput(f"{path}: {kind}-compressed; decompress it first (bunzip2 -k / gunzip -k), bert_ds reads "
                           f"plain UTF-8 text, JSON lines and Parquet")
    if _WIKI_HEADER.fullmatch(line):
        return "wikiextractor"
    if _WIKI_JSON.match(line) or (input_format == "wikiextractor" and line.startswith("{")):
        return "wikiextractor-json"
    if input_format == "wikiextractor":
        raise BadInput(f"{path}: not WikiExtractor output (--input-format wikiextractor): its first line is neither "
                       f"a <doc id=...> header nor a JSON object: {line[:60]!r}")
    if path.suffix.lower() in JSONL_SUFFIXES or _is_json_object(line, whole):
        return "jsonl"
    return "bert"


def input_bytes(path: str | Path, input_format: str = "auto") -> int:
    """About the bytes :func:`iter_documents` counts for ``path``, for a progress bar's total: the file's size, or
    for Parquet (compressed; its documents count their UTF-8 text) the uncompressed size of its ``text`` column,
    from the file's metadata alone."""
    path = Path(path)
    if detect_format(path, input_format) != "parquet":
        return path.stat().st_size
    pq = _parquet_module(path)
    try:
        with pq.ParquetFile(path) as pf:
            meta = pf.metadata
    except (OSError, ValueError):  # an unreadable file fails, naming itself, when it is read
        return path.stat().st_size
    total = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        total += sum(group.column(c).total_uncompressed_size for c in range(group.num_columns)
                     if group.column(c).path_in_schema == "text")
    return total


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
                raise BadInput(f"{path}:{lineno}: invalid UTF-8 byte 0x{raw[exc.start]:02x} at byte offset "
                               f"{offset + exc.start}; convert the file to UTF-8 (e.g. iconv)") from None
            offset += nbytes
            yield lineno, line.rstrip("\r\n"), nbytes


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
            raise BadInput(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise BadInput(f"{path}:{lineno}: expected a JSON object with a string field 'text'")
        yield text, nbytes


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


def _wiki_text(paragraphs: list[str]) -> str:
    """An article's lines as one text whose every line is a paragraph to :func:`split_sentences`, with the ``&``,
    ``<``, ``>`` WikiExtractor escapes (``html.escape(text, quote=False)``) unescaped: the exact inverse."""
    text = "\n\n".join(paragraphs)
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&") if "&" in text else text


def _iter_wikiextractor_json(path: Path, limits: TextLimits, skipped: SkipCounts) -> Iterator[tuple[str, int]]:
    """WikiExtractor ``--json``: JSON lines whose ``text`` holds the article's lines (the title is not in it)."""
    for text, nbytes in _iter_jsonl(path, limits, skipped):
        yield _wiki_text([p for p in (line.strip() for line in text.split("\n")) if p]), nbytes


def _iter_wikiextractor(path: Path, limits: TextLimits, skipped: SkipCounts) -> Iterator[tuple[str, int]]:
    """WikiExtractor's ``<doc>`` blocks. The first body line (the title) is dropped (module docstring); the bytes of
    the tags and of blank lines count towards the document they belong to, so a file's documents sum to its size.
    An article over ``max_document_bytes`` is cut at a line, as a BERT-layout document is."""
    opened = 0  # the line number of the <doc> being read; 0 between documents
    title = False  # the next line is the title
    paras: list[str] = []
    size = held = 0  # bytes read for the document, and bytes of its paragraphs
    lineno = 0
    for lineno, line, nbytes in _decoded_lines(path, limits.max_document_bytes, skipped):
        text = "" if line is None else line.strip()
        if opened and text == "</doc>":
            yield _wiki_text(paras), size + nbytes
            opened, title, paras, size, held = 0, False, [], 0, 0
            continue
        if _WIKI_HEADER.fullmatch(text):
            if opened:
                raise BadInput(f"{path}:{opened}: unterminated <doc>: a new <doc> starts at line {lineno} before "
                               f"its </doc>; is this WikiExtractor output that was cut short?")
            opened, title = lineno, True
        elif not opened and text:
            raise BadInput(f"{path}:{lineno}: text outside a <doc ...> ... </doc> block: {text[:60]!r}; pass "
                           f"--input-format bert or jsonl if this file is not WikiExtractor output")
        elif title:
            title = False
        elif text:
            if held + nbytes > limits.max_document_bytes:
                skipped.document_cuts += 1
                yield _wiki_text(paras), size
                paras, size, held = [], 0, 0
            paras.append(text)
            held += nbytes
        size += nbytes
    if opened:
        raise BadInput(f"{path}:{opened}: unterminated <doc>: the file ends at line {lineno} before its </doc>; "
                       f"is this WikiExtractor output that was cut short?")
    if size:
        yield "", size


def _parquet_module(path: Path):
    """``pyarrow.parquet``, an optional dependency: without it, one error naming the file and the extra to install."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadInput(f"{path}: reading Parquet needs pyarrow, an optional dependency: "
                       f"pip install 'bert_ds[parquet]'") from None
    return pq


def _iter_parquet(path: Path, limits: TextLimits, skipped: SkipCounts) -> Iterator[tuple[str, int]]:
    """A Parquet file's ``text`` column, streamed ``_PARQUET_BATCH_ROWS`` rows at a time (``iter_batches``), never
    the whole table; a row's bytes are its UTF-8 text plus one, as a JSON line's newline (the chunk cut sizes shards
    by text, and Parquet is compressed)."""
    pq = _parquet_module(path)
    import pyarrow as pa

    try:
        with pq.ParquetFile(path, buffer_size=_PARQUET_BUFFER_BYTES, pre_buffer=False) as pf:
            schema = pf.schema_arrow
            if "text" not in schema.names:
                raise BadInput(f"{path}: no 'text' column; its columns are: {', '.join(schema.names) or 'none'}")
            kind = schema.field("text").type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise BadInput(f"{path}: column 'text' holds {kind}, not strings")
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=["text"]):
                yield from _parquet_texts(batch.column(0), limits, skipped)
    except pa.ArrowException as exc:
        raise BadInput(f"{path}: not readable as Parquet: {exc}") from None


def _parquet_texts(column, limits: TextLimits, skipped: SkipCounts) -> Iterator[tuple[str, int]]:
    """One batch's documents; a null is an empty one, a value over ``max_document_bytes`` is skipped and counted
    before Python copies it (Arrow holds it already: a value cannot be read in pieces)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    sizes = pc.add(pc.binary_length(column).fill_null(0), 1)
    over = pc.greater(sizes, limits.max_document_bytes)
    if pc.any(over).as_py():
        column = pc.if_else(over, pa.scalar(None, column.type), column)
    for text, nbytes in zip(column.to_pylist(), sizes.to_pylist(), strict=True):
        if nbytes > limits.max_document_bytes:
            skipped.long_lines += 1
            text = ""
        yield text or "", nbytes


def iter_documents(files: Iterable[Path], limits: TextLimits | None = None, skipped: SkipCounts | None = None,
                   input_format: str = "auto") -> Iterator[tuple[RawDocument, int]]:
    """Yield ``(document, bytes read)`` for every document (blank ones included, as empty) in file order, each file
    read as :func:`detect_format` says.

    Lines, Parquet values and BERT-layout sentences over ``limits`` are left out and counted in ``skipped``; a text
    (any format but BERT layout) is returned whole, its sentences are checked once split (see
    :func:`drop_long_sentences`)."""
    limits = limits or TextLimits()
    skipped = skipped if skipped is not None else SkipCounts()
    for path in files:
        yield from _READERS[detect_format(path, input_format)](path, limits, skipped)


_READERS = {"bert": _iter_bert_layout, "jsonl": _iter_jsonl, "wikiextractor": _iter_wikiextractor,
            "wikiextractor-json": _iter_wikiextractor_json, "parquet": _iter_parquet}


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
                        skipped: SkipCounts | None = None, input_format: str = "auto") -> Iterator[str]:
    """Texts to train a vocabulary on: each line of a BERT-layout file, each document of any other format (in
    pieces of at most ``limits.max_sentence_chars`` characters, see :func:`_pieces`); formats and limits as
    :func:`iter_documents`."""
    limits = limits or TextLimits()
    skipped = skipped if skipped is not None else SkipCounts()
    for doc, _ in iter_documents(files, limits, skipped, input_format):
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
