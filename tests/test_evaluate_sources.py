"""Per-source held-out evaluation on real text (licence texts and standard-library docstrings): each source's MLM/NSP
accuracy, the total over all of them, TensorBoard's scalar per source, and bert-ds-evaluate's JSON with several sets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bert_ds.config import model_preset
from bert_ds.data.loader import build_eval_loader
from bert_ds.data.tokenizer import load_tokenizer
from bert_ds.evaluate import evaluate, evaluate_sources
from bert_ds.model import BertForPreTraining
from bert_ds.runtime.metrics import MetricsLogger
from tests.helpers import HANG_GUARD_S
from tests.helpers.ds_checkpoint import stage_checkpoint_dir
from tests.helpers.eval_shards import write_shards

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def per_source(mix_shards_128, tokenizer_dir):
    torch.manual_seed(0)
    model = BertForPreTraining(model_preset("tiny", vocab_size=load_tokenizer(tokenizer_dir).vocab_size,
                                            max_position_embeddings=128), kernels="torch")
    loaders = {p.name: build_eval_loader(p, micro_batch_size=32) for p in mix_shards_128.values()}
    return model, loaders, evaluate_sources(model, loaders, max_batches=4)


def test_each_source_is_scored_on_its_own_and_the_total_sums_counts(per_source):
    model, loaders, got = per_source
    assert set(got["sources"]) == {"licenses128", "stdlib128"}
    for name, loader in loaders.items():
        assert got["sources"][name] == evaluate(model, loader, max_batches=4)
    parts = got["sources"].values()
    assert got["samples"] == sum(p["samples"] for p in parts) == 256
    assert got["masked_tokens"] == sum(p["masked_tokens"] for p in parts)
    correct = sum(p["mlm_accuracy"] * p["masked_tokens"] for p in parts)
    assert got["mlm_accuracy"] == pytest.approx(correct / got["masked_tokens"], rel=1e-12)
    nsp = sum(p["nsp_accuracy"] * p["samples"] for p in parts)
    assert got["nsp_accuracy"] == pytest.approx(nsp / got["samples"], rel=1e-12)


def test_tensorboard_shows_a_scalar_per_source(per_source, tmp_path, capsys):
    _, _, got = per_source
    logger = MetricsLogger(tmp_path, rank=0, model_config=model_preset("tiny"), log_interval=1)
    logger.log_eval(12, got)
    logger.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    for name in ("licenses128", "stdlib128"):
        for metric in ("mlm_accuracy", "nsp_accuracy"):
            (event,) = acc.Scalars(f"eval/{name}/{metric}")
            assert event.step == 12 and event.value == pytest.approx(got["sources"][name][metric], rel=1e-6)
    assert acc.Scalars("eval/mlm_accuracy")[0].value == pytest.approx(got["mlm_accuracy"], rel=1e-6)
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("eval step 12 licenses128 | mlm_accuracy ")


def test_bert_ds_evaluate_prints_each_source_in_its_json(tmp_path_factory):
    """A real DeepSpeed checkpoint (its tokenizer is the helper's small vocabulary) on two held-out sets."""
    out = tmp_path_factory.mktemp("ckpt_sources")
    result = subprocess.run([sys.executable, "-m", "tests.helpers.ds_checkpoint", str(out), "--stages", "2"],
                            capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = stage_checkpoint_dir(out, 2)
    for name, seed in (("wiki", 1), ("books", 2)):
        write_shards(out / name, checkpoint / "tokenizer" / "vocab.txt", num_samples=13 + seed, seed=seed)

    def run(data: str) -> dict:
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "evaluate.py"), "--checkpoint", str(checkpoint),
                               "--data", data, "--batch-size", "4", "--kernels", "torch", "--device", "cpu"],
                              capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    both = run(f"{out / 'wiki'},{out / 'books'}")
    alone = {name: run(str(out / name)) for name in ("wiki", "books")}
    for name in ("wiki", "books"):
        assert both["sources"][name] == {k: v for k, v in alone[name].items() if k not in ("checkpoint", "tag")}
    assert both["samples"] == 14 + 15 and "sources" not in alone["wiki"]
