"""What the runner refuses before any training: a tokenizer whose casing differs from the model's (naming both), an
unknown task, a missing data file; and that a hub ``BertModel`` directory is accepted as the start."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers

from bert_ds.downstream.finetune import check_casing, main


@pytest.fixture
def cased_tokenizer(hub_bert, tmp_path):
    vocab = (hub_bert / "vocab.txt").read_text(encoding="utf-8").split("\n")
    directory = tmp_path / "cased_tokenizer"
    (directory).mkdir()
    (directory / "vocab.txt").write_text("\n".join(vocab), encoding="utf-8")
    transformers.BertTokenizerFast(vocab=str(directory / "vocab.txt"), do_lower_case=False).save_pretrained(
        directory)
    return directory


def test_casing_mismatch_is_refused_naming_both(hub_bert, cased_tokenizer, tmp_path, capsys):
    uncased = transformers.AutoTokenizer.from_pretrained(hub_bert)
    assert check_casing(hub_bert, uncased) is True
    with pytest.raises(ValueError, match="cased .* but model .* was trained uncased"):
        check_casing(hub_bert, transformers.AutoTokenizer.from_pretrained(cased_tokenizer))
    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "a b", "label": "x"}\n{"text": "c d", "label": "y"}\n')
    code = main(["--model", str(hub_bert), "--tokenizer", str(cased_tokenizer), "--train", str(train),
                 "--out", str(tmp_path / "out"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and str(cased_tokenizer) in err and str(hub_bert) in err, err
    assert not (tmp_path / "out").exists()


def test_model_casing_read_from_vocabulary_when_not_recorded(hub_bert, cased_tokenizer, tmp_path):
    # A directory with only a vocab.txt: an uncased vocabulary has no upper-case tokens.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(hub_bert / "vocab.txt", bare / "vocab.txt")
    with pytest.raises(ValueError, match="trained uncased"):
        check_casing(bare, transformers.AutoTokenizer.from_pretrained(cased_tokenizer))


def test_hub_model_is_a_bert_model(hub_bert):
    # The start the shape tests fine-tune from is a plain BertModel (no pre-training heads): the heads are new.
    assert json.loads((hub_bert / "config.json").read_text())["architectures"] == ["BertModel"]


@pytest.mark.parametrize("argv, pattern", [
    (["--task", "nope", "--train", "x.csv"], "task='nope': choose one of"),
    (["--task", "cola", "--data-dir", "{tmp}"], "no such file (task 'cola', split 'train')"),
    (["--task", "cola"], "give --data-dir or --train"),
])
def test_bad_task_or_files(hub_bert, tmp_path, capsys, argv, pattern):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:  # argparse refusals exit 2 through SystemExit, the runner's own return 2
        code = main(["--model", str(hub_bert), "--out", str(tmp_path / "o"), "--device", "cpu", *argv])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert pattern in capsys.readouterr().err


def _fast_tokenizer(directory, vocab: list[str], lowercase: bool = True):
    directory.mkdir()
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    tokenizer = transformers.BertTokenizerFast(vocab=str(directory / "vocab.txt"), do_lower_case=lowercase)
    tokenizer.save_pretrained(directory)
    return transformers.AutoTokenizer.from_pretrained(directory)


def test_casing_probe_ignores_unk_pieces(hub_bert, tmp_path):
    """An uncased tokenizer whose vocabulary cannot spell "hello" turns "Hello HELLO" into [UNK] [UNK]; those
    upper-case letters are the special token's, not the input's: it is uncased, like the model."""
    vocab = [t for t in (hub_bert / "vocab.txt").read_text(encoding="utf-8").splitlines() if not t.startswith("h")]
    tokenizer = _fast_tokenizer(tmp_path / "no_hello", vocab)
    assert "hello" not in tokenizer.get_vocab() and tokenizer.tokenize("Hello HELLO") == ["[UNK]", "[UNK]"]
    assert check_casing(hub_bert, tokenizer) is True
    assert check_casing(tmp_path / "no_hello", tokenizer) is True  # against itself
    cased = _fast_tokenizer(tmp_path / "no_hello_cased", vocab, lowercase=False)
    with pytest.raises(ValueError, match="cased .* but model .* was trained uncased"):
        check_casing(hub_bert, cased)


def test_tokenizer_vocabulary_is_compared_token_by_id(hub_bert, tmp_path):
    from bert_ds.downstream.identity import check_vocabulary

    vocab = (hub_bert / "vocab.txt").read_text(encoding="utf-8").splitlines()
    same = _fast_tokenizer(tmp_path / "same", vocab)
    check_vocabulary(hub_bert, same, tmp_path / "same", 30522)
    swapped = list(vocab)
    swapped[1996], swapped[1997] = swapped[1997], swapped[1996]
    with pytest.raises(ValueError) as info:
        check_vocabulary(hub_bert, _fast_tokenizer(tmp_path / "swapped", swapped), tmp_path / "swapped", 30522)
    assert f"id 1996: 'the' in {hub_bert / 'vocab.txt'} but 'of' in {tmp_path / 'swapped'}" in str(info.value)
    longer = _fast_tokenizer(tmp_path / "longer", vocab + ["zzextra"])
    with pytest.raises(ValueError, match=r"30522 tokens in .*vocab\.txt but 30523 in .*longer \(ids 0-30521 agree\)"):
        check_vocabulary(hub_bert, longer, tmp_path / "longer", 30523)
    # The model's own tokenizer (no --tokenizer) is only held to config.vocab_size; fewer ids than rows are fine.
    check_vocabulary(hub_bert, same, None, 30528)
    with pytest.raises(ValueError, match=r"30522 tokens, but .*config\.vocab_size is 30000: ids 30000-30521"):
        check_vocabulary(hub_bert, same, None, 30000)


def test_model_sha256_is_content(hub_bert, tmp_path):
    from bert_ds.downstream.identity import model_sha256

    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "model.safetensors", "vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hub_bert / name, copy / name)
    (copy / "finetune_metrics.json").write_text("{}")  # a run's output is not part of the model
    base = model_sha256(copy)
    assert model_sha256(copy) == base
    with open(copy / "model.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert model_sha256(copy) != base
    (copy / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weight file"):
        model_sha256(copy)
