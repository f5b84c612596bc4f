"""Reading corpora under ``TextLimits``: over-long lines skipped without being held, long sentences skipped, long
BERT-layout documents cut, every byte still accounted for (the chunk cut depends on it)."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import pytest

from bert_ds.data import text
from bert_ds.data.text import SkipCounts, TextLimits, iter_documents, iter_training_texts


def _write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def _read(path: Path, limits: TextLimits) -> tuple[list, SkipCounts]:
    skipped = SkipCounts()
    return list(iter_documents([path], limits, skipped)), skipped


@pytest.mark.parametrize(("name", "value"), [("max_document_bytes", 0), ("max_sentence_chars", -1),
                                             ("max_document_bytes", 1.5), ("max_sentence_chars", True)])
def test_bad_limit_is_refused_by_name(name, value):
    with pytest.raises(ValueError, match=f"{name}="):
        TextLimits(**{name: value})


def test_long_bert_line_is_skipped_and_bytes_still_counted(tmp_path):
    long = "x" * 200 + "\n"
    at_limit = "y" * 63 + "\n"  # 64 bytes with its newline: exactly the limit, kept
    data = "One sentence.\n" + long + "Two sentence.\n\n" + at_limit + "z" * 64 + "\n" + "Three.\n" + "w" * 500
    path = _write(tmp_path, "a.txt", data)
    docs, skipped = _read(path, TextLimits(max_document_bytes=64, max_sentence_chars=1000))
    # a skipped line is neither a sentence nor a document break; a last line without a newline is skipped too; the
    # line at the limit fills a document, so the next sentence starts another (a cut)
    assert [d for d, _ in docs] == [["One sentence.", "Two sentence."], ["y" * 63], ["Three."]]
    assert (skipped.long_lines, skipped.long_sentences, skipped.document_cuts) == (3, 0, 1)
    assert sum(n for _, n in docs) == len(data.encode())


def test_a_long_line_is_read_in_pieces_never_whole():
    reads: list[int] = []

    class Recording(io.BytesIO):
        def readline(self, size=-1):
            reads.append(size)
            return super().readline(size)

    f = Recording(b"short\n" + b"a" * 10_000 + b"\n" + b"b" * 33 + b"\nend")
    assert list(text._raw_lines(f, 32)) == [(b"short\n", 6), (None, 10_001), (None, 34), (b"end", 3)]
    assert all(0 < size <= max(33, text._DRAIN_BYTES) for size in reads)
    assert reads[:2] == [33, 33]  # never asked for more than the limit + 1 of a line


def test_invalid_utf8_after_a_skipped_line_names_the_right_line_and_offset(tmp_path):
    path = _write(tmp_path, "a.txt", b"ok\n" + b"q" * 100 + b"\nbad \xff\n")
    with pytest.raises(ValueError, match=r"a\.txt:3: invalid UTF-8 byte 0xff at byte offset 108"):
        _read(path, TextLimits(max_document_bytes=50))


def test_long_bert_sentence_is_skipped(tmp_path):
    path = _write(tmp_path, "a.txt", "Short one.\n" + "  " + "s" * 11 + "  \nShort two.\n")
    docs, skipped = _read(path, TextLimits(max_sentence_chars=10))
    assert [d for d, _ in docs] == [["Short one.", "Short two."]]
    assert skipped.long_sentences == 1 and skipped.long_lines == 0


def test_long_bert_document_is_cut_at_sentence_boundaries(tmp_path):
    sentences = [f"Sentence number {i} of a document that never ends." for i in range(100)]
    data = "\n".join(sentences) + "\n\nA second document.\nIts second line.\n"
    path = _write(tmp_path, "a.txt", data)
    limit = 300
    docs, skipped = _read(path, TextLimits(max_document_bytes=limit))
    pieces = [d for d, _ in docs]
    assert [s for d in pieces[:-1] for s in d] == sentences  # nothing lost, order kept
    assert pieces[-1] == ["A second document.", "Its second line."]
    assert all(sum(len(s) + 1 for s in d) <= limit for d in pieces)
    assert skipped.document_cuts == len(pieces) - 2 > 0
    assert sum(n for _, n in docs) == len(data.encode())


def test_long_jsonl_line_is_skipped_as_an_empty_document(tmp_path):
    lines = [json.dumps({"text": "First. Doc."}), json.dumps({"text": "y" * 500}), json.dumps({"text": "Last. Doc."})]
    data = "\n".join(lines) + "\n"
    path = _write(tmp_path, "a.jsonl", data)
    docs, skipped = _read(path, TextLimits(max_document_bytes=100))
    assert [d for d, _ in docs] == ["First. Doc.", "", "Last. Doc."]
    assert skipped.long_lines == 1
    assert sum(n for _, n in docs) == len(data.encode())


def test_drop_long_sentences_counts():
    skipped = SkipCounts(long_sentences=2)
    assert text.drop_long_sentences(["ab", "abcd", "abc"], 3, skipped) == ["ab", "abc"]
    assert skipped.long_sentences == 3


def _words(tokenizer, texts) -> Counter:
    """What a WordPiece trainer counts: the pre-tokenized words of the normalized texts."""
    inner = tokenizer._tokenizer
    return Counter(w for t in texts for w, _ in inner.pre_tokenizer.pre_tokenize_str(inner.normalizer.normalize_str(t)))


@pytest.mark.parametrize("lowercase", [True, False])
def test_training_pieces_give_the_trainer_the_same_words(english_corpus, tmp_path, lowercase):
    """A JSON-lines text is fed to the trainer in pieces cut at spaces and newlines: the words the trainer counts
    (normalized, pre-tokenized) are exactly those of the whole text, so the vocabulary cannot change; only a run
    without a space longer than a piece is left out, and counted."""
    from bert_ds.data.tokenizer import _bert_pipeline

    body = english_corpus.read_text(encoding="utf-8")[:200_000]
    body += " Ünïcödé  text\twith\u00a0odd spaces, 中文字符 and a " + "k" * 700 + " word."  # a word over the piece size
    path = _write(tmp_path, "a.jsonl", json.dumps({"text": body}) + "\n")
    limits = TextLimits(max_sentence_chars=500)
    skipped = SkipCounts()
    pieces = list(iter_training_texts([path], limits, skipped))
    assert len(pieces) > 400 and max(map(len, pieces)) <= 500 and skipped.long_sentences == 1
    tok = _bert_pipeline(None, lowercase=lowercase)
    whole, cut = _words(tok, [body]), _words(tok, pieces)
    assert cut - whole == Counter() and whole - cut == Counter({"k" * 700: 1})


def test_input_pattern_selects_files_below_a_directory_and_the_cli_lists_them(tmp_path, capsys):
    from bert_ds.data.text import input_files
    from bert_ds.data.tokenizer import main as train_tokenizer_main

    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    text = "The first sentence is here.\nA second one follows it.\n\nAnother document starts.\nIt ends now.\n"
    for name in ("a.txt", "sub/b.txt", "copy.jsonl", "held_out.eval"):
        (corpus / name).write_text(text if not name.endswith(".jsonl") else '{"text": "x y"}\n')
    assert [p.name for p in input_files(corpus)] == ["a.txt", "copy.jsonl", "held_out.eval", "b.txt"]
    assert [p.name for p in input_files(corpus, "*.txt")] == ["a.txt", "b.txt"]
    with pytest.raises(ValueError, match=r"no files matching --input-pattern '\*.md'"):
        input_files(corpus, "*.md")
    train_tokenizer_main(["--input", str(corpus), "--input-pattern", "*.txt", "--vocab-size", "120",
                          "--out", str(tmp_path / "tok")])
    listing = capsys.readouterr().out
    assert "reading 2 input file(s)" in listing and "a.txt" in listing and "copy.jsonl" not in listing
