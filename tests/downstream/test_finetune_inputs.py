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
    transformers.BertTokenizerFast(vocab_file=str(directory / "vocab.txt"), do_lower_case=False).save_pretrained(
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
