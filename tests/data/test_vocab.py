"""One reader of a tokenizer directory: ``read_vocab``'s line rule against Hugging Face's readers, every vocab.txt
consumer agreeing on a file with a trailing blank line, the vocab hash, and ``read_lowercase``."""

from __future__ import annotations

import hashlib
import inspect
import json

import numpy as np
import pytest

from bert_ds.data.loader import DynamicMasking
from bert_ds.data.tokenizer import (
    SPECIAL_TOKENS,
    continuation_table,
    load_tokenizer,
    read_lowercase,
    read_vocab,
    vocab_sha256,
)

TOKENS = [*SPECIAL_TOKENS, "the", "cat", "sat", "##s", "##ing", "on", "mat"]
LAYOUTS = {
    "final newline": "\n".join(TOKENS) + "\n",
    "no final newline": "\n".join(TOKENS),
    "blank last line": "\n".join(TOKENS) + "\n\n",
    "CRLF": "\r\n".join(TOKENS) + "\r\n",
    "blank line inside": "\n".join(TOKENS[:7]) + "\n\n" + "\n".join(TOKENS[7:]) + "\n",
}


def _write(directory, text: str):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_bytes(text.encode("utf-8"))
    return directory


def _hf_vocabs(vocab_file) -> dict[str, dict[str, int]]:
    """token -> id as tokenizers' WordPiece.from_file and transformers' BertTokenizer read the file."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordPiece

    out = {"WordPiece.from_file": Tokenizer(WordPiece.from_file(str(vocab_file))).get_vocab(with_added_tokens=False)}
    transformers = pytest.importorskip("transformers")
    params = inspect.signature(transformers.BertTokenizer.__init__).parameters
    key = "vocab" if "vocab" in params else "vocab_file"  # transformers 5 / 4
    out["BertTokenizer"] = transformers.BertTokenizer(**{key: str(vocab_file)}).get_vocab()
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_read_vocab_gives_the_ids_hugging_face_gives(layout, tmp_path):
    directory = _write(tmp_path, LAYOUTS[layout])
    tokens = read_vocab(directory)
    blank = layout.startswith("blank")
    assert len(tokens) == len(TOKENS) + blank
    assert [t for t in tokens if t] == TOKENS  # no "\r" left on CRLF lines
    ours = {t: i for i, t in enumerate(tokens)}
    for reader, theirs in _hf_vocabs(directory / "vocab.txt").items():
        assert theirs == ours, reader


@pytest.mark.parametrize("text, lines", [("\n".join(TOKENS) + "\n\n\n", (13, 14)),
                                         ("\n".join([*TOKENS, "cat"]) + "\n", (7, 13))])
def test_a_token_on_two_lines_is_refused(text, lines, tmp_path):
    _write(tmp_path, text)
    with pytest.raises(ValueError, match=f"vocab.txt: token .* on line {lines[0]} and again on line {lines[1]}"):
        read_vocab(tmp_path)


def test_unreadable_vocab_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/vocab.txt: no WordPiece vocab.txt"):
        read_vocab(tmp_path)
    (tmp_path / "vocab.txt").write_bytes(b"[PAD]\n\xff\n")
    with pytest.raises(ValueError, match="vocab.txt: not UTF-8 at byte 6"):
        read_vocab(tmp_path / "vocab.txt")


def test_every_reader_agrees_on_a_trailing_blank_line(tmp_path):
    """The tokenizer, whole-word masking's table, the vocab hash and the exporter's count (HF BertTokenizer)."""
    directory = _write(tmp_path, LAYOUTS["blank last line"])
    tok = load_tokenizer(directory)
    assert tok.vocab_size == len(TOKENS) + 1
    dyn = DynamicMasking(vocab_size=tok.vocab_size, mask_id=tok.mask_id, whole_word=True, vocab=directory)
    assert dyn.continuation.shape == (tok.vocab_size,)
    assert np.array_equal(dyn.continuation, tok.continuation_table())
    assert np.array_equal(DynamicMasking.from_tokenizer(directory, whole_word=True).continuation, dyn.continuation)
    assert vocab_sha256(directory / "vocab.txt") == tok.vocab_sha256
    for reader, vocab in _hf_vocabs(directory / "vocab.txt").items():
        assert len(vocab) == tok.vocab_size, reader
    # The same tokens without the blank line are another vocabulary: another size and another hash.
    plain = load_tokenizer(_write(tmp_path / "plain", LAYOUTS["final newline"]))
    assert plain.vocab_size == tok.vocab_size - 1 and plain.vocab_sha256 != tok.vocab_sha256


def test_vocab_hash_of_an_ordinary_file_is_unchanged(tmp_path):
    """index.json files written before read_vocab existed hashed the file's text without its final newline."""
    text = LAYOUTS["final newline"]
    _write(tmp_path, text)
    assert vocab_sha256(tmp_path / "vocab.txt") == hashlib.sha256(text[:-1].encode()).hexdigest()
    assert vocab_sha256(_write(tmp_path / "crlf", LAYOUTS["CRLF"])) == vocab_sha256(tmp_path)


def test_continuation_table_marks_word_pieces():
    assert continuation_table(TOKENS).tolist() == [t.startswith("##") for t in TOKENS]
    assert continuation_table(TOKENS).sum() == 2


@pytest.mark.parametrize("files, expected", [
    ({}, True),  # a bare vocab.txt: uncased, as BertTokenizer's default
    ({"tokenizer_meta.json": {"lowercase": False}}, False),
    ({"tokenizer_config.json": {"do_lower_case": False}}, False),
    ({"tokenizer_config.json": {"model_max_length": 512}}, True),
    ({"tokenizer_meta.json": {"lowercase": True}, "tokenizer_config.json": {"do_lower_case": False}}, True),
])
def test_read_lowercase(files, expected, tmp_path):
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    assert read_lowercase(tmp_path) is expected
    # default=None (fine-tuning's model check, which then looks at the vocabulary): only what a file records.
    recorded = "lowercase" in files.get("tokenizer_meta.json", {}) or "do_lower_case" in files.get(
        "tokenizer_config.json", {})
    assert read_lowercase(tmp_path, default=None) is (expected if recorded else None)


@pytest.mark.parametrize("name, data, field", [("tokenizer_meta.json", {"lowercase": "yes"}, "lowercase"),
                                               ("tokenizer_meta.json", {}, "lowercase"),
                                               ("tokenizer_config.json", {"do_lower_case": 1}, "do_lower_case")])
def test_read_lowercase_refuses_a_bad_flag(name, data, field, tmp_path):
    (tmp_path / name).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{name}: field '{field}' must be true or false"):
        read_lowercase(tmp_path)
