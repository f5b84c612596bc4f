"""Tokenizer training and loading; parity with transformers.BertTokenizerFast on text it was not trained on."""

from __future__ import annotations

import inspect
import json
import shutil

import pytest

from bert_ds.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, main, read_vocab, train_tokenizer

# Not in the training corpus (license texts + Python docstrings): news-like prose, accents, digits, CJK, symbols.
HELD_OUT = [
    "The committee's Zürich meeting, held on 3 March 1998, approved a €4.5-million budget for the new observatory.",
    "Naïve travellers often mistake the café's crème brûlée for a dessert from Montréal!",
    "She whispered: \"Don't open the door before 10:45 p.m.\" — then vanished into the fog.",
    "東京 is the capital of Japan; its population exceeds thirteen million people.",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "UNDERSTANDABLY, the well-known antidisestablishmentarianism debate resurfaced in 2024.",
]


def _hf_fast(vocab_file, do_lower_case: bool):
    """transformers.BertTokenizerFast on a vocab file. transformers 5 names the argument ``vocab`` and silently
    ignores ``vocab_file`` (leaving a 5-token vocabulary), 4.x names it ``vocab_file``."""
    transformers = pytest.importorskip("transformers")
    params = inspect.signature(transformers.BertTokenizerFast.__init__).parameters
    key = "vocab" if "vocab" in params else "vocab_file"
    hf = transformers.BertTokenizerFast(**{key: str(vocab_file)}, do_lower_case=do_lower_case)
    assert len(hf) == len(read_vocab(vocab_file))
    return hf


def test_special_tokens_first_and_files_written(tokenizer_dir):
    vocab = read_vocab(tokenizer_dir)
    assert vocab[:len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)  # [PAD] = 0
    assert len(vocab) == 4000
    meta = json.loads((tokenizer_dir / "tokenizer_meta.json").read_text())
    assert meta["lowercase"] is True and meta["skipped"] == {"long_lines": 0, "long_sentences": 0}
    assert (tokenizer_dir / "tokenizer.json").is_file()


def test_ids_match_transformers_bert_tokenizer_fast(tokenizer_dir):
    hf = _hf_fast(tokenizer_dir / "vocab.txt", do_lower_case=True)
    tok = load_tokenizer(tokenizer_dir)
    flat, offsets = tok.encode_batch(HELD_OUT)
    for i, text in enumerate(HELD_OUT):
        expected = hf(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text) == expected, text
        assert flat[offsets[i]:offsets[i + 1]].tolist() == expected
    assert hf.convert_tokens_to_ids(["[PAD]", "[CLS]", "[SEP]", "[MASK]"]) == [tok.pad_id, tok.cls_id, tok.sep_id,
                                                                               tok.mask_id]


def test_vocab_only_directory_loads_uncased(tokenizer_dir, tmp_path):
    shutil.copy(tokenizer_dir / "vocab.txt", tmp_path / "vocab.txt")  # like Google's release: vocab.txt alone
    tok = load_tokenizer(tmp_path)
    assert tok.lowercase is True
    assert tok.encode(HELD_OUT[0]) == load_tokenizer(tokenizer_dir).encode(HELD_OUT[0])
    (tmp_path / "tokenizer_meta.json").write_text('{"lowercase": false}')
    assert load_tokenizer(tmp_path).lowercase is False


def test_missing_vocab_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*vocab.txt"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_cased_tokenizer_via_cli(english_corpus, tmp_path):
    main(["--input", str(english_corpus), "--vocab-size", "1500", "--out", str(tmp_path), "--cased"])
    tok = load_tokenizer(tmp_path)
    assert tok.lowercase is False and tok.vocab_size == 1500
    assert tok.encode("The") != tok.encode("the")
    hf = _hf_fast(tmp_path / "vocab.txt", do_lower_case=False)
    for text in HELD_OUT:
        assert tok.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text


def test_jsonl_and_directory_inputs(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.jsonl").write_text(json.dumps({"text": "Alpha beta gamma. Delta epsilon zeta."}) + "\n")
    (docs / "sub" / "b.txt").write_text("Eta theta iota.\nKappa lambda mu.\n")
    out = train_tokenizer([docs], tmp_path / "tok", vocab_size=200)
    tok = load_tokenizer(out)
    assert tok.tokenizer.decode(tok.encode("Alpha eta")) == "alpha eta"  # both files (jsonl + nested txt) were read
    with pytest.raises(ValueError, match="no text"):
        (tmp_path / "empty.txt").write_text("\n\n")
        train_tokenizer([tmp_path / "empty.txt"], tmp_path / "tok2", vocab_size=200)


@pytest.mark.parametrize("lowercase", [True, False])
def test_ascii_fast_path_gives_the_full_pipelines_ids(tokenizer_dir, tmp_path, lowercase):
    """encode_batch normalizes ASCII text in Python and skips BertNormalizer: ids must equal the full pipeline's."""
    import random

    shutil.copy(tokenizer_dir / "vocab.txt", tmp_path / "vocab.txt")
    (tmp_path / "tokenizer_meta.json").write_text(json.dumps({"lowercase": lowercase}))
    tok = load_tokenizer(tmp_path)
    rng = random.Random(0)
    chars = [chr(c) for c in range(128)]
    words = ["The", "[SEP]", "[sep]", "[MASK]", "[Mask]", "[CLS]", "[UNK]", "[PAD]", "##ing", "a\x00b", "x\x7fY",
             "tab\tbed", "UNDERSTANDABLY", "can't", "3.5%"]
    texts = chars + HELD_OUT + ["", " ", "\x01\x02", "[SEP] Hello\x0b[MASK]\x1f end"]
    texts += ["".join(rng.choice(chars) for _ in range(rng.randint(0, 30))) for _ in range(2000)]
    texts += [" ".join(rng.choice(words + chars) for _ in range(rng.randint(0, 10))) for _ in range(2000)]
    expected = [e.ids for e in tok.tokenizer.encode_batch(texts, add_special_tokens=False)]
    flat, offsets = tok.encode_batch(texts, batch_size=997)
    assert [flat[offsets[i]:offsets[i + 1]].tolist() for i in range(len(texts))] == expected
    assert [tok.encode(t) for t in texts[:300]] == expected[:300]


def _bad_inputs(tmp_path):
    """(name, input path, what the one error line must say) for each kind of unusable input."""
    tmp_path.mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "latin1.txt").write_bytes("Fine line.\nCaf\xe9 au lait.\n".encode("latin-1"))
    (tmp_path / "no_files").mkdir()
    (tmp_path / "blank_files").mkdir()
    (tmp_path / "blank_files" / "a.txt").write_text("\n  \n\n")
    (tmp_path / "blank_files" / "b.jsonl").write_text("")
    return [("empty", tmp_path / "empty.txt", r"no text to train a tokenizer on in .*empty\.txt"),
            ("non-utf8", tmp_path / "latin1.txt", r"latin1\.txt:2: invalid UTF-8 byte 0xe9"),
            ("missing", tmp_path / "nope.txt", r"input .*nope\.txt does not exist"),
            ("empty dir", tmp_path / "no_files", r"input directory .*no_files holds no files"),
            ("blank files", tmp_path / "blank_files", r"no text to train a tokenizer on in .*a\.txt, .*b\.jsonl")]


@pytest.mark.parametrize("case", range(5))
@pytest.mark.parametrize("out_exists", [False, True])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys, case, out_exists):
    import re

    name, src, message = _bad_inputs(tmp_path / "in")[case]
    run = tmp_path / "run"
    run.mkdir()
    out = run / "deeper" / "tok"
    if out_exists:
        out.mkdir(parents=True)  # the user's own empty directory: kept, and left empty
    code = main(["--input", str(src), "--vocab-size", "100", "--out", str(out)])
    assert code == 2, name
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bert-ds-train-tokenizer: error: ") and "Traceback" not in err
    assert re.search(message, err), err
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == (["deeper", "deeper/tok"] if out_exists
                                                                              else [])


def test_non_empty_out_is_refused_unless_overwrite(english_corpus, tmp_path, capsys):
    out = tmp_path / "tok"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    args = ["--input", str(english_corpus), "--vocab-size", "300", "--out", str(out)]
    code = main(args)
    assert code == 2
    assert "is not empty (holds notes.md); pass --overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.md"]
    main([*args, "--overwrite"])
    assert "wrote" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["notes.md", "tokenizer.json", "tokenizer_meta.json", "vocab.txt"]
    assert load_tokenizer(out).vocab_size == 300 and (out / "notes.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]  # no staging directory left beside it


def test_skips_are_printed_and_recorded(english_corpus, tmp_path, capsys):
    src = tmp_path / "long.txt"
    normal = english_corpus.read_text(encoding="utf-8").splitlines()[:40]
    assert max(map(len, normal)) <= 2000
    src.write_text("\n".join(normal[:20] + ["word " * 3000, "Short. " * 300] + normal[20:]) + "\n")
    main(["--input", str(src), "--vocab-size", "300", "--out", str(tmp_path / "tok"), "--max-document-bytes", "10000",
          "--max-sentence-chars", "2000"])
    assert "skipped 1 line(s) over --max-document-bytes and 1 sentence(s) over" in capsys.readouterr().out
    meta = json.loads((tmp_path / "tok" / "tokenizer_meta.json").read_text())
    assert meta["skipped"] == {"long_lines": 1, "long_sentences": 1}
    assert meta["limits"] == {"max_document_bytes": 10000, "max_sentence_chars": 2000}



def test_the_same_text_gives_the_same_vocabulary(english_corpus, tokenizer_dir, tmp_path):
    """tokenizers' trainer numbers the "##c" continuation tokens in hash-map order and breaks merge ties by those ids
    (huggingface/tokenizers#1794): unseeded, three trainings on this corpus gave three vocabularies. Trained here in
    fresh processes (a hash-map's seed is per process) and in this one, the files must be byte-identical."""
    import subprocess
    import sys

    from tests.helpers import HANG_GUARD_S, child_env

    code = ("import sys; from bert_ds.data.tokenizer import train_tokenizer; "
            "train_tokenizer([sys.argv[1]], sys.argv[2], vocab_size=4000)")
    outs = [tmp_path / f"run{i}" for i in range(2)]
    for out in outs:
        subprocess.run([sys.executable, "-c", code, str(english_corpus), str(out)], check=True, env=child_env(),
                       timeout=HANG_GUARD_S)
    for name in ("vocab.txt", "tokenizer.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes() == (tokenizer_dir / name).read_bytes()
    # The seeds are ordinary WordPiece entries: the only added (special) tokens are BERT's five.
    from tokenizers import Tokenizer

    fast = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert sorted(t.content for t in fast.get_added_tokens_decoder().values()) == sorted(SPECIAL_TOKENS)
    assert fast.encode("x##a", add_special_tokens=False).ids == load_tokenizer(tokenizer_dir).encode("x##a")


def test_the_alphabet_cut_is_the_same_in_every_process(tmp_path):
    """With more characters than ``limit_alphabet``, tokenizers' trainer drops the rarest by count alone, so characters
    tied at the cut-off were kept or dropped in hash-map order: another alphabet, another vocabulary, per process.
    bert_ds keeps the most frequent, ties by code point. Here 60 Greek/Cyrillic letters occur once each (all tied) and
    the limit falls among them."""
    import subprocess
    import sys
    import unicodedata

    from tests.helpers import HANG_GUARD_S, child_env

    # Letters the normalizer leaves alone (no accent to strip, already lower case), so each is counted once.
    rare = [c for c in map(chr, [*range(0x3b1, 0x3ca), *range(0x430, 0x460)])
            if unicodedata.normalize("NFD", c) == c and c.lower() == c][:60]
    assert len(rare) == 60
    lines = ["the quick brown fox jumps over the lazy dog and then runs away.\n"] * 50
    lines += [f"word{c}x is here.\n" for c in rare]
    src = tmp_path / "corpus.txt"
    src.write_text("".join(lines), encoding="utf-8")
    common = {c for c in "".join(lines) if not c.isspace()} - set(rare)
    limit = len(common) + 20  # 20 of the 60 tied letters are kept
    code = ("import sys; from bert_ds.data.tokenizer import train_tokenizer; "
            f"train_tokenizer([sys.argv[1]], sys.argv[2], vocab_size=200, limit_alphabet={limit}, min_frequency=1)")
    outs = [tmp_path / f"run{i}" for i in range(3)]
    for out in outs:
        subprocess.run([sys.executable, "-c", code, str(src), str(out)], check=True, env=child_env(),
                       timeout=HANG_GUARD_S)
    vocab = (outs[0] / "vocab.txt").read_text(encoding="utf-8").split("\n")
    assert all((out / "vocab.txt").read_bytes() == (outs[0] / "vocab.txt").read_bytes() for out in outs[1:])
    assert all((out / "tokenizer.json").read_bytes() == (outs[0] / "tokenizer.json").read_bytes() for out in outs[1:])
    kept = [c for c in rare if c in vocab]
    assert kept == sorted(rare)[:20], kept  # the tie is broken by code point, not by hash order
    assert common <= set(vocab)
