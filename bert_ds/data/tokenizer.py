"""WordPiece tokenizer: training (``tokenizers``) and loading from a directory holding at least ``vocab.txt``.

A tokenizer directory holds ``vocab.txt`` (one token per line, the id is the line number, as Google's and Hugging
Face's BERT vocabularies), optionally ``tokenizer.json`` (for Hugging Face users) and ``tokenizer_meta.json``
(``{"lowercase": bool}``; training also records its ``text.TextLimits`` and what they skipped, provenance only).
bert_ds always rebuilds the pipeline from ``vocab.txt`` plus the lowercase flag, so a directory holding only Google's
``vocab.txt`` works everywhere a tokenizer directory is asked for. The pipeline is BERT's: ``BertNormalizer`` (clean
text, CJK spacing, lowercase + strip accents unless cased), ``BertPreTokenizer`` (whitespace and punctuation),
WordPiece with ``##`` continuations, which is what ``transformers.BertTokenizerFast`` builds from the same vocab.

This module is the one reader of a tokenizer directory: :func:`read_vocab` (the token list, see it for the line
rule), :func:`read_lowercase` (the lowercase flag) and :func:`vocab_sha256` (the hash ``index.json`` records); the
loader, the shard index and the exporter ask here instead of parsing the files themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.implementations import BertWordPieceTokenizer

from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, defaults_of, option
from bert_ds.data.text import (
    DEFAULT_MAX_DOCUMENT_BYTES,
    DEFAULT_MAX_SENTENCE_CHARS,
    InputArgs,
    SkipCounts,
    TextLimits,
    describe_inputs,
    detect_format,
    input_files,
    iter_training_texts,
)
from bert_ds.errors import BadInput

__all__ = [
    "SPECIAL_TOKENS", "VOCAB_NAME", "META_NAME", "WordPieceTokenizer", "read_vocab", "read_lowercase", "vocab_sha256",
    "tokens_sha256", "directory_vocabulary", "vocabulary_difference", "continuation_table", "train_tokenizer",
    "load_tokenizer", "main",
]

# [PAD] first so that its id is 0, as in Google's vocabularies and BertConfig.pad_token_id.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
VOCAB_NAME = "vocab.txt"
META_NAME = "tokenizer_meta.json"
_HF_CONFIG_NAME = "tokenizer_config.json"


def read_vocab(path: str | Path) -> list[str]:
    """The tokens of a ``vocab.txt`` (or of the one in tokenizer directory ``path``); a token's id is its line number.

    The line rule is the one of ``tokenizers``' ``WordPiece.from_file`` (0.23) and ``transformers``'
    ``BertTokenizer`` / ``load_vocab`` (5.x), checked against both: lines end at ``\\n`` (a ``\\r`` before it is
    dropped), a final newline ends the last line and adds no token, and every other line is a token, a blank one
    included (the empty token, at that line's id). So a file ending in a blank line has one token more than its
    non-blank lines, for bert_ds and for Hugging Face alike. A token on two lines is refused: Hugging Face keeps only
    its last id, so its vocabulary would be smaller than the line count and skip an id."""
    path = Path(path)
    if path.is_dir():
        path = path / VOCAB_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no WordPiece {VOCAB_NAME} (one token per line)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: not UTF-8 at byte {exc.start}") from exc
    if not text:
        raise BadInput(f"{path}: empty vocabulary")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line
    tokens = [line[:-1] if line.endswith("\r") else line for line in lines]
    first_line: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in first_line:
            raise BadInput(f"{path}: token {token!r} on line {first_line[token] + 1} and again on line {i + 1}; "
                           f"ids are line numbers, so every line must hold a different token")
        first_line[token] = i
    return tokens


def tokens_sha256(tokens: Sequence[str]) -> str:
    """Hash of a token list (one token per line, without the final newline): what ``index.json`` records."""
    return hashlib.sha256("\n".join(tokens).encode("utf-8")).hexdigest()


def vocab_sha256(vocab_file: str | Path) -> str:
    """Hash of the tokens of a ``vocab.txt`` (read by :func:`read_vocab`, so CRLF and LF files hash alike)."""
    return tokens_sha256(read_vocab(vocab_file))


def directory_vocabulary(directory: str | Path) -> tuple[list[str | None], Path] | None:
    """(token per id, the file read) of the vocabulary a model or tokenizer directory carries: ``vocab.txt``
    (:func:`read_vocab`), else a Hugging Face ``tokenizer.json``'s model vocabulary plus its added tokens (an id
    neither names is None); None when the directory has neither."""
    directory = Path(directory)
    if (directory / VOCAB_NAME).is_file():
        return list(read_vocab(directory / VOCAB_NAME)), directory / VOCAB_NAME
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        by_id = {int(i): t for t, i in ((spec.get("model") or {}).get("vocab") or {}).items()}
        by_id.update({int(a["id"]): a["content"] for a in spec.get("added_tokens") or []})
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise BadInput(f"{path}: not a tokenizer.json with a token -> id vocabulary ({exc})") from exc
    return [by_id.get(i) for i in range(max(by_id) + 1 if by_id else 0)], path


def vocabulary_difference(ours: Sequence[str | None], theirs: Sequence[str | None], ours_name: str,
                          theirs_name: str) -> str | None:
    """None when the two vocabularies are the same token for every id; else one phrase naming the first id that
    differs (``id 1997: 'the' in A but 'of' in B``) or, when one extends the other, the sizes."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return f"id {i}: {a!r} in {ours_name} but {b!r} in {theirs_name}"
    if len(ours) != len(theirs):
        return (f"{len(ours)} tokens in {ours_name} but {len(theirs)} in {theirs_name} (ids 0-"
                f"{min(len(ours), len(theirs)) - 1} agree)")
    return None


def continuation_table(tokens: Sequence[str]) -> np.ndarray:
    """(len(tokens),) bool: True for ``##`` word pieces, which belong to the word before them (whole-word masking)."""
    return np.fromiter((t.startswith("##") for t in tokens), dtype=bool, count=len(tokens))


def read_lowercase(directory: str | Path, default: bool | None = True) -> bool | None:
    """The lowercase flag of a tokenizer directory: ``tokenizer_meta.json`` ``lowercase``, else a Hugging Face
    ``tokenizer_config.json`` ``do_lower_case``, else ``default``: True (a bare ``vocab.txt``, e.g. Google's uncased
    release, as ``BertTokenizer``'s default), None for a caller that tells the casing another way. The one reader of
    a directory's recorded casing (training, the checkpoint copy, fine-tuning's model check)."""
    directory = Path(directory)
    for name, key in ((META_NAME, "lowercase"), (_HF_CONFIG_NAME, "do_lower_case")):
        path = directory / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise BadInput(f"{path}: not valid JSON: {exc}") from exc
        if key not in config and name == _HF_CONFIG_NAME:
            continue  # an HF config need not record it: the default below is HF's own
        value = config.get(key)
        if not isinstance(value, bool):
            raise BadInput(f"{path}: field '{key}' must be true or false, got {value!r}")
        return value
    return default


@dataclass
class WordPieceTokenizer:
    """A loaded BERT WordPiece tokenizer: the fast ``tokenizers`` pipeline plus the vocabulary facts bert_ds needs."""

    directory: Path
    vocab: list[str]
    lowercase: bool
    tokenizer: Tokenizer = field(repr=False)
    _plain: Tokenizer = field(init=False, repr=False)
    """``tokenizer`` without its normalizer, for ASCII texts normalized in Python (see :meth:`encode_batch`)."""
    _has_added: re.Pattern = field(init=False, repr=False)
    _unusual: re.Pattern = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._plain = Tokenizer.from_str(self.tokenizer.to_str())
        self._plain.normalizer = None
        # Added (special) tokens are matched in the raw text, before normalization; a text that may hold one (any
        # case, since normalization lowercases) always takes the full pipeline.
        firsts = {c for t in self.tokenizer.get_added_tokens_decoder().values() if t.content
                  for c in (t.content[0].lower(), t.content[0].upper())}
        chars = "".join(map(re.escape, sorted(firsts)))
        self._has_added = re.compile(f"[{chars}]" if chars else "(?!)")
        self._unusual = re.compile(f"[{chars}\\x00-\\x1f\\x7f]")  # one cheap scan for the common, clean case

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def vocab_file(self) -> Path:
        return self.directory / VOCAB_NAME

    @property
    def vocab_sha256(self) -> str:
        return tokens_sha256(self.vocab)

    def token_id(self, token: str) -> int:
        tid = self.tokenizer.token_to_id(token)
        if tid is None:
            raise BadInput(f"{self.vocab_file}: special token {token} is missing from the vocabulary")
        return tid

    @property
    def pad_id(self) -> int:
        return self.token_id("[PAD]")

    @property
    def cls_id(self) -> int:
        return self.token_id("[CLS]")

    @property
    def sep_id(self) -> int:
        return self.token_id("[SEP]")

    @property
    def mask_id(self) -> int:
        return self.token_id("[MASK]")

    @property
    def unk_id(self) -> int:
        return self.token_id("[UNK]")

    def continuation_table(self) -> np.ndarray:
        """(vocab_size,) bool: True for ``##`` word pieces, which belong to the word before them (whole-word mask)."""
        return continuation_table(self.vocab)

    def encode(self, text: str) -> list[int]:
        """Token ids of one text, without [CLS]/[SEP]."""
        return self._encode_ids([text])[0]

    def encode_batch(self, texts: Sequence[str], batch_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize many texts -> (flat ids int32, (len(texts)+1,) int64 offsets into the flat ids).

        Calls the fast tokenizer ``batch_size`` texts at a time: its ``Encoding`` objects cost far more memory than
        the ids, so they are turned into arrays and dropped batch by batch.

        ASCII fast path: ``BertNormalizer`` is about half of the fast tokenizer's time (it tracks an alignment per
        character, measured 0.85 of 1.8 s on the test corpus), but on ASCII text it only drops control characters,
        turns tab/newline/CR into spaces and (uncased) lowercases; NFD accent stripping and CJK spacing are no-ops.
        ASCII texts that cannot hold an added token are normalized so with ``str.translate``/``str.lower`` and
        tokenized by the same pipeline without its normalizer; all other texts take the full pipeline. The ids are
        identical (tests/data/test_tokenizer.py checks every ASCII character against the full pipeline)."""
        texts = list(texts)
        lengths, parts = [], []
        for i in range(0, len(texts), batch_size):
            ids = self._encode_ids(texts[i:i + batch_size])
            lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            lengths.append(lens)
            parts.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lens.sum())))
        offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        if texts:
            np.cumsum(np.concatenate(lengths), out=offsets[1:])
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        return flat, offsets

    def _encode_ids(self, texts: list[str]) -> list[list[int]]:
        plain_at, plain, full_at, full = [], [], [], []
        unusual, has_added, lowercase = self._unusual.search, self._has_added.search, self.lowercase
        for k, text in enumerate(texts):
            if text.isascii():
                if unusual(text) is not None:  # rare: control characters (translate is slow) or an added token
                    if has_added(text) is not None:
                        full_at.append(k)
                        full.append(text)
                        continue
                    text = text.translate(_ASCII_CLEAN)
                plain_at.append(k)
                plain.append(text.lower() if lowercase else text)
            else:
                full_at.append(k)
                full.append(text)
        if not full:
            return [e.ids for e in _encode_fast(self._plain, plain)]
        if not plain:
            return [e.ids for e in _encode_fast(self.tokenizer, full)]
        out: list[list[int]] = [[]] * len(texts)
        for at, tokenizer, group in ((plain_at, self._plain, plain), (full_at, self.tokenizer, full)):
            for k, e in zip(at, _encode_fast(tokenizer, group), strict=True):
                out[k] = e.ids
        return out


# BertNormalizer's clean_text on ASCII (tokenizers normalizers/bert.rs): control characters (Cc, except tab, newline
# and carriage return) are removed, and those three become spaces.
_ASCII_CLEAN = str.maketrans({**{chr(c): None for c in [*range(32), 127]}, "\t": " ", "\n": " ", "\r": " "})


def _encode_fast(tokenizer: Tokenizer, texts: list[str]) -> list:
    # encode_batch_fast (tokenizers >= 0.20) skips character offsets, which bert_ds never reads: ~25% faster.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    return encode(texts, add_special_tokens=False)


def _bert_pipeline(vocab: dict[str, int] | str | None, lowercase: bool) -> BertWordPieceTokenizer:
    # strip_accents=None follows lowercase, exactly as BertTokenizerFast(do_lower_case=...) does.
    return BertWordPieceTokenizer(vocab, unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]", pad_token="[PAD]",
                                  mask_token="[MASK]", clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                  lowercase=lowercase, wordpieces_prefix="##")


@dataclass
class _TrainingText:
    """The texts a training pass reads (``iter_training_texts`` over the files, blank ones dropped), counting how many
    it fed and, when asked, the characters the trainer sees (after its normaliser)."""

    files: list[Path]
    limits: TextLimits
    input_format: str
    lowercase: bool
    fed: int = 0

    def __post_init__(self) -> None:
        self._normalize = _bert_pipeline(None, lowercase=self.lowercase).normalizer.normalize_str

    def texts(self, counts: SkipCounts, characters: Counter[str] | None = None) -> Iterator[str]:
        self.fed = 0
        for text in iter_training_texts(self.files, self.limits, counts, self.input_format):
            if text.strip():
                self.fed += 1
                if characters is not None:
                    characters.update(self._normalize(text))
                yield text

    def train(self, seeds: list[str], size: int, counts: SkipCounts, *, min_frequency: int, limit: int,
              alphabet: list[str] | None = None, characters: Counter[str] | None = None) -> BertWordPieceTokenizer:
        """One pass of tokenizers' WordPiece trainer, ``seeds`` added right after the special tokens."""
        tok = _bert_pipeline(None, lowercase=self.lowercase)
        tok.train_from_iterator(self.texts(counts, characters), vocab_size=size, min_frequency=min_frequency,
                                limit_alphabet=limit, initial_alphabet=alphabet or [],
                                special_tokens=[*SPECIAL_TOKENS, *seeds], wordpieces_prefix="##", show_progress=False)
        return tok


def _seeds_and_alphabet(first: BertWordPieceTokenizer, characters: Counter[str],
                        limit_alphabet: int) -> tuple[list[str], list[str] | None, int]:
    """(continuation seeds, explicit alphabet or None, the alphabet limit for pass 2) from pass 1's vocabulary and the
    characters counted while it ran.

    Same text, same vocabulary, whatever the process. tokenizers' trainer leaves two choices to hash-map order: (a) the
    ids of the "##c" continuation tokens, by which it also breaks ties between merges (huggingface/tokenizers#1794),
    and (b) which characters it drops when the text has more than limit_alphabet of them and several share the cut-off
    count (BpeTrainer::compute_alphabet sorts by count alone). So pass 1 (no merges, no alphabet limit) finds the
    characters and continuation tokens; with too many characters the most frequent are kept, ties by code point, as an
    explicit alphabet, kept whole (limit = its size: no tie left to break), and only the "##c" of kept characters
    remain (the trainer makes "##c" for a kept c seen inside a word); pass 2 is seeded with them, sorted."""
    continuation = sorted(t for t in first.get_vocab() if t.startswith("##") and len(t) == 3)
    if sum(len(t) == 1 for t in first.get_vocab()) <= limit_alphabet:
        return continuation, None, limit_alphabet
    alphabet = sorted((c for c in characters if not c.isspace()), key=lambda c: (-characters[c], c))[:limit_alphabet]
    kept = set(alphabet)
    return [t for t in continuation if t[2:] in kept], alphabet, len(alphabet)


def _write_trained(stage: Path, out: Path, tok: BertWordPieceTokenizer, seeds: list[str], lowercase: bool,
                   limits: TextLimits, skipped: SkipCounts) -> None:
    """vocab.txt, tokenizer.json (the seeds taken out of its added tokens: they are ordinary WordPiece entries) and
    tokenizer_meta.json into ``stage``. Written by Python, not by tokenizers' Rust save (whose failures, a full disk
    among them, surface as a bare Exception): an OSError names the file and is reported as one line with exit 2."""
    by_id = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    _write_text(stage / VOCAB_NAME, "".join(f"{token}\n" for token, _ in by_id), out)
    _write_text(stage / "tokenizer.json", _without_added(tok.to_str(), seeds), out)
    meta = {"lowercase": lowercase,
            "limits": {"max_document_bytes": limits.max_document_bytes,
                       "max_sentence_chars": limits.max_sentence_chars},
            "skipped": {"long_lines": skipped.long_lines, "long_sentences": skipped.long_sentences}}
    _write_text(stage / META_NAME, json.dumps(meta) + "\n", out)


def train_tokenizer(inputs: Sequence[str | Path], out_dir: str | Path, vocab_size: int = 30522, cased: bool = False,
                    *, min_frequency: int = 2, limit_alphabet: int = 1000,
                    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES,
                    max_sentence_chars: int = DEFAULT_MAX_SENTENCE_CHARS, overwrite: bool = False,
                    input_format: str = "auto") -> Path:
    """Train a BERT WordPiece vocabulary on text files or directories, in any of ``text.INPUT_FORMATS`` (``auto``
    detects each file's: BERT layout, JSON lines, WikiExtractor output, Parquet), reproducibly
    (:func:`_seeds_and_alphabet`: two passes).

    Writes ``vocab.txt``, ``tokenizer.json`` and ``tokenizer_meta.json`` (the casing, the ``text.TextLimits`` and
    what they skipped) into ``out_dir`` and returns ``out_dir``. The files are written into a new directory beside
    ``out_dir`` and moved into place only once all are complete, so a failure leaves nothing behind. ``out_dir`` is
    created if missing and used if empty; one holding anything is refused unless ``overwrite``, and then only the
    three files are replaced (the directory itself and anything else in it are left alone)."""
    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise BadInput(f"vocab_size={vocab_size} is too small (needs room beyond {len(SPECIAL_TOKENS)} specials)")
    limits = TextLimits(max_document_bytes, max_sentence_chars)
    files = input_files(inputs)
    for path in files:  # a file no format fits fails here, not inside the trainer
        detect_format(path, input_format)
    out = Path(out_dir)
    _check_out_dir(out, overwrite)
    text = _TrainingText(files, limits, input_format, lowercase=not cased)
    skipped = SkipCounts()
    with _staging_dir(out) as stage:
        characters: Counter[str] = Counter()
        first = text.train([], len(SPECIAL_TOKENS) + 1, SkipCounts(), min_frequency=min_frequency, limit=2**32,
                           characters=characters)
        seeds, alphabet, limit = _seeds_and_alphabet(first, characters, limit_alphabet)
        tok = text.train(seeds, vocab_size, skipped, min_frequency=min_frequency, limit=limit, alphabet=alphabet)
        if text.fed == 0 or tok.get_vocab_size() <= len(SPECIAL_TOKENS):
            note = (f" ({skipped.long_lines} line(s) over max_document_bytes={max_document_bytes} and "
                    f"{skipped.long_sentences} over max_sentence_chars={max_sentence_chars} skipped)"
                    if skipped.long_lines or skipped.long_sentences else "")
            raise BadInput(f"no text to train a tokenizer on in {', '.join(str(f) for f in files[:5])}"
                           f"{', ...' if len(files) > 5 else ''}{note}")
        _write_trained(stage, out, tok, seeds, not cased, limits, skipped)
        _install(stage, out)
    return out


def _without_added(tokenizer_json: str, tokens: list[str]) -> str:
    """The tokenizer with ``tokens`` removed from its added (special) tokens; they stay in the WordPiece vocabulary."""
    data = json.loads(tokenizer_json)
    drop = set(tokens)
    data["added_tokens"] = [a for a in data["added_tokens"] if a["content"] not in drop]
    return json.dumps(data, ensure_ascii=False)


def _write_text(path: Path, text: str, out: Path) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:  # ENOSPC and friends carry no file name: add the one the user chose
        raise OSError(exc.errno, f"writing {path.name} for {out}: {exc.strerror}") from None


def _check_out_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {out} exists and is not a directory")
    if out.is_dir() and not overwrite:
        held = sorted(p.name for p in out.iterdir())
        if held:
            raise FileExistsError(f"output directory {out} is not empty (holds {', '.join(held[:5])}"
                                  f"{', ...' if len(held) > 5 else ''}); pass --overwrite (overwrite=True) to replace "
                                  f"its tokenizer files, or choose another directory")


@contextlib.contextmanager
def _staging_dir(out: Path) -> Iterator[Path]:
    """A new hidden directory beside ``out`` (whose missing parents are made); on any failure it is removed, with
    the parents this made, so nothing is left behind."""
    made: list[Path] = []
    for parent in reversed(out.absolute().parents):
        if not parent.exists():
            parent.mkdir()
            made.append(parent)
    stage = out.absolute().parent / f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        stage.mkdir()
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for parent in reversed(made):
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def _install(stage: Path, out: Path) -> None:
    """Move the complete files of ``stage`` into ``out``, durably: the files reach the disk before their names do."""
    for path in stage.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if out.is_dir() and any(out.iterdir()):  # overwrite=True: replace our files, keep the directory and the rest
        for path in sorted(stage.iterdir()):
            os.replace(path, out / path.name)
        stage.rmdir()
        _fsync_dir(out)
    else:
        os.replace(stage, out)  # rename(2) also replaces an empty directory
    _fsync_dir(out.absolute().parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_tokenizer(directory: str | Path) -> WordPieceTokenizer:
    """Load a tokenizer directory; only ``vocab.txt`` is required (lowercase flag: :func:`read_lowercase`)."""
    directory = Path(directory)
    vocab_file = directory / VOCAB_NAME
    if not vocab_file.is_file():
        what = "does not exist" if not directory.exists() else f"has no {VOCAB_NAME}"
        raise FileNotFoundError(f"tokenizer directory {directory} {what}; train one with bert-ds-train-tokenizer or "
                                f"point to a directory holding a BERT {VOCAB_NAME}")
    vocab = read_vocab(vocab_file)
    missing = [t for t in SPECIAL_TOKENS if t not in set(vocab)]
    if missing:
        raise BadInput(f"{vocab_file}: special token(s) {missing} missing from the vocabulary")
    lowercase = read_lowercase(directory)
    tok = _bert_pipeline({t: i for i, t in enumerate(vocab)}, lowercase)
    inner: Tokenizer = tok._tokenizer
    inner.no_truncation()
    inner.no_padding()
    return WordPieceTokenizer(directory, vocab, lowercase, inner)


_TRAIN_DEFAULTS = defaults_of(train_tokenizer)


@dataclass(kw_only=True)
class TrainTokenizerArgs(InputArgs):
    """``bert-ds-train-tokenizer``'s options (:mod:`bert_ds.cli_args`); defaults are :func:`train_tokenizer`'s."""

    vocab_size: int = option(_TRAIN_DEFAULTS["vocab_size"], help="WordPiece vocabulary size (default %(default)s, "
                             "Google's BERT vocabularies)")
    out: str
    """Output directory for vocab.txt, tokenizer.json and tokenizer_meta.json."""
    cased: bool = _TRAIN_DEFAULTS["cased"]
    """Keep case and accents (default: lowercase, strip)."""
    overwrite: bool = _TRAIN_DEFAULTS["overwrite"]
    """Replace the tokenizer files of a non-empty --out."""


def cli_parser() -> argparse.ArgumentParser:
    return build_parser(TrainTokenizerArgs, "bert-ds-train-tokenizer", __doc__.splitlines()[0])


main = alias("train-tokenizer")


def _run(args: TrainTokenizerArgs) -> None:
    files = input_files(args.input, args.input_pattern)
    print(describe_inputs(files, input_format=args.input_format), flush=True)
    out = train_tokenizer(files, args.out, vocab_size=args.vocab_size, cased=args.cased,
                          max_document_bytes=args.max_document_bytes, max_sentence_chars=args.max_sentence_chars,
                          overwrite=args.overwrite, input_format=args.input_format)
    skipped = json.loads((out / META_NAME).read_text(encoding="utf-8"))["skipped"]
    print(f"wrote {out / VOCAB_NAME} ({load_tokenizer(out).vocab_size} tokens); skipped {skipped['long_lines']} "
          f"line(s) over --max-document-bytes and {skipped['long_sentences']} sentence(s) over --max-sentence-chars")


if __name__ == "__main__":
    sys.exit(main())
