"""Single-sentence (SST-2 layout) and sentence-pair (MRPC layout) classification from a real hub BERT, through the
presets' GLUE readers and metrics: each beats always answering the majority label on its main metric."""

from __future__ import annotations

import json

import pytest

from bert_ds.downstream.finetune import METRICS_NAME, main
from tests.helpers.downstream_data import write_mrpc, write_sst2

FAST = ["--device", "cpu", "--max-seq-length", "64", "--batch-size", "16", "--logging-steps", "5"]


@pytest.mark.slow  # minutes of CPU fine-tuning
def test_single_sentence_sst2_layout(hub_bert, corpus_documents, tmp_path):
    glue = tmp_path / "glue"
    write_sst2(corpus_documents, glue / "SST-2", n_train=192, n_dev=96)
    out = tmp_path / "sst2"
    assert main(["--model", str(hub_bert), "--task", "sst2", "--data-dir", str(glue), "--out", str(out),
                 "--epochs", "1", "--learning-rate", "1e-4", *FAST]) == 0
    metrics = json.loads((out / METRICS_NAME).read_text())
    assert metrics["num_labels"] == 2 and metrics["labels"] == ["0", "1"]
    accuracy, chance = metrics["eval"]["dev"]["accuracy"], metrics["baseline"]["dev"]["accuracy"]
    print(f"SST-2 layout: accuracy {accuracy:.3f} vs majority {chance:.3f}")
    assert accuracy >= chance + 0.2, metrics["eval"]


@pytest.mark.slow  # minutes of CPU fine-tuning
def test_sentence_pair_mrpc_layout(hub_bert, corpus_documents, tmp_path):
    glue = tmp_path / "glue"
    write_mrpc(corpus_documents, glue / "MRPC", n_train=256, n_dev=96)
    out = tmp_path / "mrpc"
    assert main(["--model", str(hub_bert), "--task", "mrpc", "--data-dir", str(glue), "--out", str(out),
                 "--epochs", "1", "--learning-rate", "2e-4", *FAST]) == 0
    metrics = json.loads((out / METRICS_NAME).read_text())
    dev, base = metrics["eval"]["dev"], metrics["baseline"]["dev"]
    print(f"MRPC layout (is B the next sentence): F1 {dev['f1']:.3f} vs majority {base['f1']:.3f}, accuracy "
          f"{dev['accuracy']:.3f} vs {base['accuracy']:.3f}")
    assert set(dev) >= {"f1", "accuracy", "loss"}
    assert dev["accuracy"] >= base["accuracy"] + 0.1, (dev, base)
    assert dev["f1"] > base["f1"], (dev, base)
