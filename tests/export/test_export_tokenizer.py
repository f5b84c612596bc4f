"""The export carries the tokenizer training used (vocabulary and casing), and verification compares token ids.

Runs on ZeRO-0 checkpoints written in process (``tests.helpers.ds_checkpoint.write_stage0_run``): the tokenizer path
does not depend on the ZeRO stage, which ``test_convert_checkpoint.py`` covers with real DeepSpeed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from bert_ds.data.tokenizer import load_tokenizer
from bert_ds.export import convert as convert_module
from bert_ds.export import convert_checkpoint, verify_tokenizer
from bert_ds.export.convert import VERIFY_TEXT, VerificationError
from bert_ds.model import BertForPreTraining
from tests.helpers.ds_checkpoint import tiny_config, write_stage0_run, write_tokenizer_dir

CLI_PATH = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"

# Cased and uncased spellings of the same words: lowercasing or accent stripping changes the ids.
CASED_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "The", "the", "Café", "café", "cafe", "Hello", "hello",
               "WORLD", "world", "Señor", "senor", "O", "o", "Brien", "brien", "'", ",", "!", ".", "?", "s", "##s"]


def _run(tmp_path: Path, vocab: list[str], files: dict[str, str], name: str = "run") -> Path:
    tokenizer = write_tokenizer_dir(tmp_path / f"{name}_tokenizer", vocab, files)
    torch.manual_seed(0)
    model = BertForPreTraining(tiny_config(load_tokenizer(tokenizer).vocab_size), kernels="torch")
    return write_stage0_run(tmp_path / name, model, tokenizer)


def _cli():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tools_convert_checkpoint", CLI_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("files, lowercase", [
    ({"tokenizer_config.json": json.dumps({"do_lower_case": False})}, False),  # an HF cased dir, no meta
    ({"tokenizer_meta.json": json.dumps({"lowercase": False})}, False),  # bert_ds's own cased tokenizer
    ({}, True),  # a bare vocab.txt, as Google's uncased release
])
def test_export_carries_the_casing_training_used(tmp_path, files, lowercase):
    ckpt = _run(tmp_path, CASED_VOCAB, files)
    # The run directory records the casing training resolved, whatever the source directory held.
    assert json.loads((ckpt / "tokenizer" / "tokenizer_meta.json").read_text()) == {"lowercase": lowercase}
    out = tmp_path / "hf"
    mlm_diff, nsp_diff = convert_checkpoint(ckpt, out)
    assert mlm_diff <= 1e-4 and nsp_diff <= 1e-4
    assert json.loads((out / "tokenizer_config.json").read_text())["do_lower_case"] is lowercase

    exported = transformers.AutoTokenizer.from_pretrained(out)
    training = load_tokenizer(tmp_path / "run_tokenizer")
    assert training.lowercase is lowercase
    text = "The Café, Señor O'Brien!"
    assert exported(text, add_special_tokens=False)["input_ids"] == training.encode(text)
    want = ["the", "cafe", ",", "senor", "o", "'", "brien", "!"] if lowercase else \
        ["The", "Café", ",", "Señor", "O", "'", "Brien", "!"]
    assert exported.tokenize(text) == want


def test_verification_refuses_an_exported_tokenizer_with_the_wrong_casing(tmp_path):
    ckpt = _run(tmp_path, CASED_VOCAB, {"tokenizer_config.json": json.dumps({"do_lower_case": False})})
    out = tmp_path / "hf"
    assert convert_checkpoint(ckpt, out, verify=False) is None
    assert verify_tokenizer(out, ckpt / "tokenizer") > len(VERIFY_TEXT.split())
    # What the exporter used to write for this directory: the right vocabulary, uncased.
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "do_lower_case": True}))
    with pytest.raises(VerificationError, match=r"splits .* unlike bert_ds .*lowercase=False"):
        verify_tokenizer(out, ckpt / "tokenizer")


def test_verification_refuses_swapped_token_ids(tmp_path):
    ckpt = _run(tmp_path, CASED_VOCAB, {"tokenizer_meta.json": json.dumps({"lowercase": False})})
    out = tmp_path / "hf"
    convert_checkpoint(ckpt, out, verify=False)
    data = json.loads((out / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["Hello"], vocab["hello"] = vocab["hello"], vocab["Hello"]  # same size, same casing, two ids exchanged
    (out / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(VerificationError, match="splits"):
        verify_tokenizer(out, ckpt / "tokenizer")


def test_cli_exits_1_and_leaves_nothing_when_the_tokenizer_disagrees(tmp_path, monkeypatch, capsys):
    ckpt = _run(tmp_path, CASED_VOCAB, {"tokenizer_config.json": json.dumps({"do_lower_case": False})})
    real_export = convert_module.export_model

    def export_then_lowercase(state, config, out_dir, tokenizer_dir, source):
        real_export(state, config, out_dir, tokenizer_dir, source=source)
        path = Path(out_dir) / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "do_lower_case": True}))

    monkeypatch.setattr(convert_module, "export_model", export_then_lowercase)
    assert _cli()(["--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 1
    assert "the exported tokenizer splits" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.tmp-*"))


def test_a_vocab_ending_in_a_blank_line_exports(tmp_path):
    tokenizer = tmp_path / "run_tokenizer"
    tokenizer.mkdir()
    (tokenizer / "vocab.txt").write_text("".join(f"{t}\n" for t in CASED_VOCAB) + "\n", encoding="utf-8")
    training = load_tokenizer(tokenizer)
    torch.manual_seed(0)
    ckpt = write_stage0_run(tmp_path / "run", BertForPreTraining(tiny_config(training.vocab_size), kernels="torch"),
                            tokenizer)
    out = tmp_path / "hf"
    assert convert_checkpoint(ckpt, out) is not None
    # Whatever count the tokenizer reader gives the blank line, the export has exactly training's tokens and ids.
    assert json.loads((out / "config.json").read_text())["vocab_size"] == training.vocab_size
    assert len(transformers.AutoTokenizer.from_pretrained(out)) == training.vocab_size
    assert load_tokenizer(out).vocab == training.vocab
