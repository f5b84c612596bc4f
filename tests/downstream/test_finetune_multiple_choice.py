"""Multiple choice (SWAG layout: 4 endings, ``[CLS] context [SEP] ending [SEP]``, softmax over the choices): the
true next sentence among 4 (the wrong ones from documents of the other kind) is found well above chance (0.25)."""

from __future__ import annotations

import json

import pytest

from bert_ds.downstream.finetune import METRICS_NAME, main
from tests.helpers.downstream_data import write_swag

CHANCE = 0.25  # 4 endings


@pytest.mark.slow  # minutes of CPU fine-tuning
def test_swag_layout_beats_chance(hub_bert, corpus_documents, tmp_path):
    data = write_swag(corpus_documents, tmp_path / "swag", n_train=64, n_dev=64)
    out = tmp_path / "swag_model"
    assert main(["--model", str(hub_bert), "--task", "swag", "--data-dir", str(data), "--out", str(out),
                 "--epochs", "2", "--learning-rate", "1e-4", "--device", "cpu", "--max-seq-length", "64",
                 "--batch-size", "8", "--logging-steps", "4"]) == 0
    metrics = json.loads((out / METRICS_NAME).read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForMultipleChoice"]
    accuracy, frequent = metrics["eval"]["dev"]["accuracy"], metrics["baseline"]["dev"]["accuracy"]
    print(f"SWAG layout (true next sentence among 4): accuracy {accuracy:.3f} vs chance {CHANCE}, "
          f"most frequent index {frequent:.3f}")
    # Wide by construction: twice chance, and 0.2 above always answering the most frequent index.
    assert accuracy >= 2 * CHANCE and accuracy >= frequent + 0.2, metrics["eval"]
