"""STS-B-shaped data trains as regression: one output and MSE (never one class per distinct score), scored by
Pearson/Spearman; the word-overlap score of the pairs is learnt (a constant prediction has no correlation)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from bert_ds.downstream.finetune import METRICS_NAME, main
from tests.helpers.downstream_data import write_stsb


@pytest.mark.slow  # minutes of CPU fine-tuning
def test_stsb_trains_as_regression(hub_bert, corpus_documents, tmp_path):
    glue = tmp_path / "glue"
    write_stsb(corpus_documents, glue / "STS-B", n_train=256, n_dev=96)
    out = tmp_path / "stsb"
    assert main(["--model", str(hub_bert), "--task", "stsb", "--data-dir", str(glue), "--out", str(out),
                 "--epochs", "3", "--learning-rate", "1e-4", "--device", "cpu", "--max-seq-length", "64",
                 "--batch-size", "16", "--logging-steps", "5"]) == 0
    metrics = json.loads((out / METRICS_NAME).read_text())
    assert metrics["num_labels"] == 1 and metrics["problem_type"] == "regression"
    config = json.loads((out / "config.json").read_text())
    assert len(config["id2label"]) == 1 and config["problem_type"] == "regression"
    dev = metrics["eval"]["dev"]
    print(f"STS-B layout (word overlap): spearman {dev['spearman']:.3f}, pearson {dev['pearson']:.3f} vs 0 for a "
          f"constant; dev MSE {dev['loss']:.3f}")
    assert dev["spearman"] >= 0.3 and dev["pearson"] >= 0.3, dev
    # The saved model is a one-output regressor whose loss is the MSE of its raw output.
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = tokenizer(["a b c d"], ["a b c e"], return_tensors="pt")
    target = torch.tensor([3.5])
    result = model(**batch, labels=target)
    assert result.logits.shape == (1, 1)
    assert np.isclose(result.loss.item(), (result.logits[0, 0] - 3.5).pow(2).item(), rtol=1e-5)
