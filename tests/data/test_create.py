
"""Shard creation end to end: index.json, bad input (determinism: ``test_create_parallel``)."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest

from bert_ds.data.create import create_shards, iter_chunks, main
from bert_ds.data.index import INDEX_NAME, ShardIndex, ShardWriter, file_sha256, shard_name
from bert_ds.data.tokenizer import vocab_sha256

REPO = Path(__file__).resolve().parents[2]


def test_index_describes_the_shards(shards_128, tokenizer_dir, shard_reader):
    index = ShardIndex.load(shards_128)
    assert index.seq_len == 128 and index.seed == 1234 and index.lowercase is True
    assert index.vocab_sha256 == vocab_sha256(tokenizer_dir / "vocab.txt") and index.id_dtype == "<u2"
    assert index.masking["max_predictions"] == 20 and index.masking["masked_lm_prob"] == 0.15
    assert index.pairing["dupe_factor"] == 2 and index.pairing["short_seq_prob"] == 0.1
    assert len(index.shards) >= 3
    assert all(300 <= s.samples <= 2000 for s in index.shards)  # about samples_per_shard (1000)
    for shard in index.shards:
        path = shards_128 / shard.name
        assert file_sha256(path) == shard.sha256 and path.stat().st_size == shard.bytes
    samples = shard_reader(shards_128)
    names = [m for _, m, _ in samples]
    assert len(names) == index.total_samples == len(set(names))
    assert all(re.fullmatch(r"\d{12}\.pair", n) for n in names)
    assert index.extra["counts"]["samples"] == index.total_samples
    assert not list(shards_128.glob("*.tmp"))


def test_shard_writer_is_byte_identical_to_tarfile(tmp_path):
    rng = np.random.default_rng(0)
    payloads = [rng.bytes(int(n)) for n in rng.integers(1, 3000, size=50)] + [b"x" * 512, b"y" * 1024]
    names = [f"{i:012d}.pair" for i in range(len(payloads))] + ["a" * 100]
    payloads.append(b"long name")
    with tarfile.open(tmp_path / "a.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, p in zip(names, payloads, strict=True):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uname, info.gname = len(p), 0, 0o444, "bert_ds", "bert_ds"
            tar.addfile(info, io.BytesIO(p))
    with ShardWriter(tmp_path / "b.tar") as w:
        for name, p in zip(names, payloads, strict=True):
            w.write(name, p)
        info_b = w.close()
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    assert info_b.sha256 == file_sha256(tmp_path / "a.tar") and info_b.samples == len(payloads)
    with tarfile.open(tmp_path / "b.tar") as tar:
        assert [tar.extractfile(m).read() for m in tar] == payloads


def test_jsonl_input_is_sentence_split(tokenizer_dir, english_corpus, tmp_path, shard_reader):
    docs = [d for d in english_corpus.read_text().split("\n\n") if d.strip()][:40]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": " ".join(d.splitlines()), "id": i}) + "\n" for i, d in enumerate(docs)))
    index = create_shards([src], tokenizer_dir, tmp_path / "out", seq_len=128, progress=False)
    assert index.total_samples > 100 and index.extra["sentence_splitter"] in ("blingfire", "pysbd")
    # a real splitter found (about) the sentences the BERT-layout corpus has, not one per document
    assert index.extra["counts"]["sentences"] > 0.7 * sum(len(d.splitlines()) for d in docs)


# ---- bad input ------------------------------------------------------------------------------------------------


def _make(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def _no_output(out: Path) -> None:
    assert not (out / INDEX_NAME).exists()
    assert not list(out.glob("shard-*"))


@pytest.mark.parametrize("content", ["", "\n\n   \n\n"])
def test_empty_corpus(tokenizer_dir, tmp_path, content):
    src = _make(tmp_path, "empty.txt", content)
    with pytest.raises(ValueError, match="no documents"):
        create_shards([src], tokenizer_dir, tmp_path / "out", seq_len=128, progress=False)
    _no_output(tmp_path / "out")


def test_only_one_sentence_documents(tokenizer_dir, tmp_path):
    src = _make(tmp_path, "one.txt", "A single sentence.\n\nAnother document of one line.\n\nAnd a third.\n")
    with pytest.raises(ValueError, match="fewer than two sentences"):
        create_shards([src], tokenizer_dir, tmp_path / "out", seq_len=128, progress=False)
    _no_output(tmp_path / "out")


def test_single_document_cannot_make_not_next(tokenizer_dir, tmp_path):
    src = _make(tmp_path, "one_doc.txt", "First sentence.\nSecond sentence.\nThird one.\n")
    with pytest.raises(ValueError, match="one document"):
        create_shards([src], tokenizer_dir, tmp_path / "out", seq_len=128, progress=False)
    _no_output(tmp_path / "out")


def _multi(i: int) -> str:
    return (f"Document {i} opens with a sentence about the license. It goes on with a second sentence on the terms. "
            f"A third sentence names the copyright holder and the year. A fourth sentence says that the software is "
            f"provided as is, without any warranty. The last one ends document {i}.")


def _single(i: int) -> str:
    return f"one long sentence without an end in sight number {i} " * 5 + "that stops here."


def test_chunk_with_one_usable_document_is_skipped_and_counted(tokenizer_dir, tmp_path, shard_reader):
    """JSON-lines texts count as usable before they are split into sentences, so a chunk can hold one multi-sentence
    document and no partner for a NotNext B: that chunk is skipped and counted, the run goes on."""
    # samples_per_shard=1 makes chunks of ~440 bytes: two ~300-byte texts each. Chunks: MM | MS | SS | MM
    texts = [_multi(0), _multi(1), _multi(2), _single(3), _single(4), _single(5), _multi(6), _multi(7)]
    src = _make(tmp_path, "mostly.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts))
    chunks = [docs for _, docs, _ in iter_chunks([src], 440)]
    assert chunks == [texts[0:2], texts[2:4], texts[4:6], texts[6:8]]  # the cut this test relies on
    out = tmp_path / "out"
    index = create_shards([src], tokenizer_dir, out, seq_len=128, dupe_factor=2, samples_per_shard=1, progress=False)
    assert index.extra["chunk_bytes"] == 440
    assert index.extra["skipped"] == {"short_documents": 3, "empty_sentences": 0, "unpaired_chunks": 1,
                                      "unpaired_documents": 1, "long_lines": 0, "long_sentences": 0,
                                      "document_cuts": 0}
    assert [s.name for s in index.shards] == [shard_name(i) for i in (0, 1, 6, 7)]  # chunks 0 and 3, two copies
    assert index.extra["counts"]["documents"] == 4
    assert sorted(p.name for p in out.glob("shard-*")) == [s.name for s in index.shards]
    assert len(shard_reader(out)) == index.total_samples > 0


def test_no_chunk_can_pair(tokenizer_dir, tmp_path):
    texts = [_multi(0), _single(1), _single(2), _multi(3)]  # chunks M S | S M: one usable document each
    src = _make(tmp_path, "lonely.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts))
    with pytest.raises(ValueError, match=r"no NotNext pair can be drawn: every chunk .* at most one document .* "
                                         r"\(2 such document"):
        create_shards([src], tokenizer_dir, tmp_path / "out", seq_len=128, samples_per_shard=1, progress=False)
    _no_output(tmp_path / "out")


def test_one_sentence_documents_are_counted(english_corpus, tokenizer_dir, tmp_path):
    extra = _make(tmp_path, "z_lonely.txt", "Just one line.\n\nAnother single line.\n\n")
    index = create_shards([english_corpus, extra], tokenizer_dir, tmp_path / "out", seq_len=128, progress=False)
    assert index.extra["skipped"]["short_documents"] == 2


def test_invalid_utf8_names_file_line_and_offset(english_corpus, tokenizer_dir, tmp_path):
    bad = _make(tmp_path, "z_bad.txt", b"Fine line one.\nFine line two.\n\nBroken \xff byte here.\nMore.\n")
    out = tmp_path / "out"
    # the good corpus first, so shards are already written when the bad byte is met: they must be removed
    with pytest.raises(ValueError, match=r"z_bad\.txt:4: invalid UTF-8 byte 0xff at byte offset 38"):
        create_shards([english_corpus, bad], tokenizer_dir, out, seq_len=128, samples_per_shard=200, progress=False)
    _no_output(out)


def test_bad_jsonl_line(tokenizer_dir, tmp_path):
    src = _make(tmp_path, "d.jsonl", '{"text": "One. Two."}\n{"txt": "no text field"}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: expected a JSON object with a string field 'text'"):
        create_shards([src], tokenizer_dir, tmp_path / "out", seq_len=128, progress=False)


def test_tokenizer_dir_without_vocab(english_corpus, tmp_path):
    (tmp_path / "tok").mkdir()
    with pytest.raises(FileNotFoundError, match="tok has no vocab.txt"):
        create_shards([english_corpus], tmp_path / "tok", tmp_path / "out", seq_len=128, progress=False)


@pytest.mark.parametrize("seq_len", [4, 0, 70000])
def test_bad_seq_len(english_corpus, tokenizer_dir, tmp_path, seq_len):
    with pytest.raises(ValueError, match="seq_len"):
        create_shards([english_corpus], tokenizer_dir, tmp_path / "out", seq_len=seq_len, progress=False)


def test_missing_input(tokenizer_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        create_shards([tmp_path / "nope.txt"], tokenizer_dir, tmp_path / "out", seq_len=128, progress=False)


def test_existing_shard_set_is_not_overwritten(english_corpus, tokenizer_dir, tmp_path):
    out = tmp_path / "out"
    first = create_shards([english_corpus], tokenizer_dir, out, seq_len=128, seed=1, progress=False)
    for seed in (1, 2):  # the same set and a different one: both refused
        with pytest.raises(FileExistsError, match="already holds a shard set.*--overwrite"):
            create_shards([english_corpus], tokenizer_dir, out, seq_len=128, seed=seed, progress=False)
    assert ShardIndex.load(out) == first
    second = create_shards([english_corpus], tokenizer_dir, out, seq_len=128, seed=2, overwrite=True, progress=False)
    assert ShardIndex.load(out) == second and second.seed == 2
    assert sorted(p.name for p in out.glob("shard-*")) == sorted(s.name for s in second.shards)


def test_unfinished_run_leftovers_are_replaced(english_corpus, tokenizer_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-000042.tar").write_bytes(b"partial")
    (out / "shard-000000.tar.tmp").write_bytes(b"partial")
    index = create_shards([english_corpus], tokenizer_dir, out, seq_len=128, progress=False)
    assert sorted(p.name for p in out.glob("shard-*")) == sorted(s.name for s in index.shards)


def test_cli(english_corpus, tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "out"
    main(["--input", str(english_corpus.parent), "--tokenizer", str(tokenizer_dir), "--seq-len", "128", "--out",
          str(out), "--dupe-factor", "2", "--max-predictions", "10", "--whole-word-mask", "--seed", "3",
          "--samples-per-shard", "2000"])
    index = ShardIndex.load(out)
    assert index.masking["max_predictions"] == 10 and index.masking["whole_word_mask"] is True
    assert "wrote" in capsys.readouterr().out
    code = main(["--input", str(english_corpus), "--tokenizer", str(tokenizer_dir), "--seq-len", "128", "--out",
                str(out)])
    assert code == 2 and "already holds" in capsys.readouterr().err


def _cli_bad_inputs(tmp_path: Path, tokenizer_dir: Path) -> list[tuple[list[str], str]]:
    """(input and tokenizer arguments, what the one error line must say) for each kind of unusable input."""
    tmp_path.mkdir()
    _make(tmp_path, "empty.txt", "")
    _make(tmp_path, "latin1.txt", "Fine line.\nCaf\xe9 au lait.\n".encode("latin-1"))
    (tmp_path / "no_files").mkdir()
    (tmp_path / "blank_files").mkdir()
    _make(tmp_path / "blank_files", "a.txt", "\n  \n\n")
    _make(tmp_path / "blank_files", "b.jsonl", "")
    tok = ["--tokenizer", str(tokenizer_dir)]
    return [(["--input", str(tmp_path / "empty.txt"), *tok], r"no documents in the inputs \(.*empty\.txt\)"),
            (["--input", str(tmp_path / "latin1.txt"), *tok], r"latin1\.txt:2: invalid UTF-8 byte 0xe9"),
            (["--input", str(tmp_path / "nope.txt"), *tok], r"input .*nope\.txt does not exist"),
            (["--input", str(tmp_path / "no_files"), *tok], r"input directory .*no_files holds no files"),
            (["--input", str(tmp_path / "blank_files"), *tok], r"no documents in the inputs \(.*a\.txt, .*b\.jsonl\)"),
            (["--input", str(tmp_path / "latin1.txt"), "--tokenizer", str(tmp_path / "no_tok")],
             r"tokenizer directory .*no_tok does not exist")]


@pytest.mark.parametrize("case", range(6))
def test_cli_bad_input_is_one_line_exit_2_and_leaves_nothing(tokenizer_dir, tmp_path, capsys, case):
    args, message = _cli_bad_inputs(tmp_path / "in", tokenizer_dir)[case]
    run = tmp_path / "run"
    run.mkdir()
    code = main([*args, "--seq-len", "128", "--out", str(run / "deeper" / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bert-ds-create-shards: error: ") and "Traceback" not in err
    assert re.search(message, err), err
    assert list(run.iterdir()) == []  # not even the empty output directory


def test_text_limits_are_applied_and_counted(english_corpus, tokenizer_dir, tmp_path, shard_reader):
    long_line = "word " * 3000  # 15,000 bytes: over max_document_bytes
    long_sentence = "Short. " * 300  # 2,100 characters: over max_sentence_chars
    bert = _make(tmp_path, "z1.txt", f"Alpha one.\n{long_line}\nAlpha two.\n{long_sentence}\nAlpha three.\n\n")
    text = "Beta one. " + "license " * 300 + "ends here. Beta two. Beta three."  # one 2,400-character sentence
    jsonl = _make(tmp_path, "z2.jsonl", json.dumps({"text": text}) + "\n")
    index = create_shards([english_corpus, bert, jsonl], tokenizer_dir, tmp_path / "out", seq_len=128,
                          progress=False, max_document_bytes=10_000, max_sentence_chars=2000)
    skipped = index.extra["skipped"]
    assert (skipped["long_lines"], skipped["long_sentences"]) == (1, 2)
    assert skipped["document_cuts"] > 0  # the licence texts are longer than 10,000 bytes
    assert index.extra["limits"] == {"max_document_bytes": 10_000, "max_sentence_chars": 2000}
    vocab = (tokenizer_dir / "vocab.txt").read_text().splitlines()
    piece_ids = [vocab.index(w) for w in ("word", "short", "license")]
    for _, _, sample in shard_reader(tmp_path / "out"):
        ids = np.asarray(sample.input_ids).copy()
        ids[np.asarray(sample.masked_positions, dtype=np.int64)] = np.asarray(sample.masked_ids)
        # each skipped text would fill a sample with its one repeated word (measured without limits: 121, 60, 121)
        assert all((ids == i).sum() < 50 for i in piece_ids)


@pytest.mark.parametrize(("option", "value"), [("--max-document-bytes", "0"), ("--max-sentence-chars", "-5")])
def test_cli_bad_limit(english_corpus, tokenizer_dir, tmp_path, capsys, option, value):
    code = main(["--input", str(english_corpus), "--tokenizer", str(tokenizer_dir), "--seq-len", "128", "--out",
                str(tmp_path / "out"), option, value])
    assert code == 2
    assert f"{option[2:].replace('-', '_')}={value} must be a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

