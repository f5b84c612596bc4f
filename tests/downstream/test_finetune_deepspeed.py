"""A fine-tune through ``Trainer``'s DeepSpeed integration (``--deepspeed CONFIG``) on 2 real CPU ranks started by
the ``deepspeed`` launcher (gloo), ZeRO stage 1 with gradient accumulation: both ranks train, the global batch is
split between them, and rank 0 writes the model. (8 steps of a random tiny model do not lower its loss reliably, so
the test checks that the weights moved, not the score.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from bert_ds.runtime.caches import extensions_root
from tests.helpers.downstream_data import write_sst2
from tests.helpers.hf_export import random_tiny_export
from tests.helpers.ranks import REPO, rank_command, run_ranks

pytestmark = pytest.mark.e2e


def test_finetune_on_two_deepspeed_cpu_ranks(tokenizer_dir, corpus_documents, tmp_path):
    export = random_tiny_export(tokenizer_dir, tmp_path / "export", seed=0)
    glue = tmp_path / "glue"
    write_sst2(corpus_documents, glue / "SST-2", n_train=128, n_dev=32)
    config = tmp_path / "ds.json"
    # "auto" values are filled in by transformers from TrainingArguments (batch, accumulation, lr schedule).
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                                  "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}))
    out = tmp_path / "model"
    proc = run_ranks(rank_command(2, ["--model", str(export), "--task", "sst2", "--data-dir", str(glue),
                                      "--out", str(out), "--deepspeed", str(config), "--batch-size", "8",
                                      "--gradient-accumulation-steps", "2", "--epochs", "2",
                                      "--learning-rate", "5e-4", "--max-seq-length", "48", "--logging-steps", "2"],
                                 script=REPO / "tools" / "finetune.py"), check=True)
    metrics = json.loads((out / "finetune_metrics.json").read_text())
    assert metrics["world_size"] == 2
    # 128 examples / (8 per rank x 2 ranks x 2 accumulation) = 4 optimizer steps an epoch.
    assert metrics["steps"] == 8, metrics["steps"]
    assert len(metrics["train_loss_log"]) == 4  # logged every 2 of the 8 steps
    # The optimizer stepped: the encoder the ranks trained differs from the export it started from.
    before = load_file(export / "model.safetensors")
    after = load_file(out / "model.safetensors")
    name = next(k for k in after if k.endswith("encoder.layer.0.attention.self.query.weight"))
    start = before.get(name, before.get(name.removeprefix("bert.")))
    assert start is not None and not torch.equal(start, after[name])
    assert "DeepSpeed" in proc.stdout + proc.stderr
    # DeepSpeed's shared-memory extension is the one pre-training builds (bert_ds.runtime.caches), not a second build
    # in torch's default directory.
    assert f"JIT extensions deepspeed_shm_comm loaded from {extensions_root()}" in proc.stderr, proc.stderr[-3000:]
