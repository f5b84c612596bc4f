import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from bert_ds.config import IGNORE_INDEX, BertConfig, model_preset
from bert_ds.data.loader import build_eval_loader
from bert_ds.data.tokenizer import read_vocab, vocab_sha256
from bert_ds.evaluate import evaluate
from bert_ds.model import BertForPreTraining, PretrainingOutput
from tests.helpers import HANG_GUARD_S, free_port
from tests.helpers.ds_checkpoint import TAG, stage_checkpoint_dir
from tests.helpers.eval_shards import write_shards

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------- pure function level
class CountingModel(nn.Module):
    """Stand-in whose outputs are read off the batch: a masked prediction is correct when its label is even, NSP is
    correct when the label is 0, mlm_loss = input_ids[0, 0] / 2 and nsp_loss = input_ids[0, 1] / 2."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.modes: list[bool] = []

    def forward(self, input_ids, token_type_ids, attention_mask, masked_lm_positions, masked_lm_ids,
                next_sentence_label=None) -> PretrainingOutput:
        assert not torch.is_grad_enabled()
        self.modes.append(self.training)
        valid = masked_lm_ids != IGNORE_INDEX
        mlm_total = valid.sum()
        mlm_correct = (valid & (masked_lm_ids % 2 == 0)).sum()
        mlm_loss = input_ids[0, 0].float() / 2 + self.weight
        if next_sentence_label is None:
            zero = torch.zeros((), dtype=torch.long)
            return PretrainingOutput(mlm_loss, mlm_loss, None, mlm_correct / mlm_total, None, mlm_correct, mlm_total,
                                     zero, zero)
        nsp_loss = input_ids[0, 1].float() / 2
        nsp_correct = (next_sentence_label == 0).sum()
        nsp_total = torch.tensor(next_sentence_label.numel())
        return PretrainingOutput(mlm_loss + nsp_loss, mlm_loss, nsp_loss, mlm_correct / mlm_total,
                                 nsp_correct / nsp_total, mlm_correct, mlm_total, nsp_correct, nsp_total)


def _batch(first_ids, labels, nsp) -> dict:
    b = len(labels)
    input_ids = torch.zeros(b, 4, dtype=torch.long)
    input_ids[0, :2] = torch.tensor(first_ids)
    batch = dict(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids),
                 attention_mask=torch.ones_like(input_ids), masked_lm_positions=torch.zeros(b, 3, dtype=torch.long),
                 masked_lm_ids=torch.tensor(labels), lengths=torch.full((b,), 4))
    if nsp is not None:
        batch["next_sentence_label"] = torch.tensor(nsp)
    return batch


def _batches(nsp: bool = True) -> list[dict]:
    # A: 4 masked (2 correct), mlm_loss 1.0, NSP 1/2 correct, nsp_loss 3.0.
    # B: 1 masked (1 correct), mlm_loss 6.0, NSP 1/1 correct, nsp_loss 0.5.
    return [_batch([2, 6], [[2, 4, 5], [7, -100, -100]], [0, 1] if nsp else None),
            _batch([12, 1], [[6, -100, -100]], [0] if nsp else None)]


FULL = {"mlm_accuracy": 3 / 5, "nsp_accuracy": 2 / 3, "mlm_loss": (1.0 * 4 + 6.0 * 1) / 5,
        "nsp_loss": (3.0 * 2 + 0.5 * 1) / 3, "samples": 3, "masked_tokens": 5}


def _assert_metrics(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == (value if value is None or isinstance(value, int) else pytest.approx(value)), key


def test_counts_are_summed_not_batch_means_averaged():
    model = CountingModel().train()
    # A mean of batch means would give mlm_accuracy 0.75 and mlm_loss 3.5.
    _assert_metrics(evaluate(model, _batches()), FULL)
    assert model.modes == [False, False]  # ran in eval mode
    assert model.training  # and got train mode back


def test_eval_mode_is_kept_and_max_batches():
    model = CountingModel().eval()
    got = evaluate(model, _batches(), max_batches=1)
    _assert_metrics(got, {"mlm_accuracy": 0.5, "nsp_accuracy": 0.5, "mlm_loss": 1.0, "nsp_loss": 3.0,
                          "samples": 2, "masked_tokens": 4})
    assert not model.training


def test_mlm_only_batches_give_no_nsp_metrics():
    got = evaluate(CountingModel(), _batches(nsp=False))
    _assert_metrics(got, {**FULL, "nsp_accuracy": None, "nsp_loss": None})


def test_train_mode_restored_after_an_error_and_empty_loader_refused():
    model = CountingModel().train()
    with pytest.raises(KeyError):
        evaluate(model, [{"token_type_ids": torch.zeros(1, 4)}])
    assert model.training
    with pytest.raises(ValueError, match="no batches"):
        evaluate(model, [])


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # Rank 0 holds batch A, rank 1 batch B: each must report the metrics of both.
        metrics = evaluate(CountingModel(), [_batches()[rank]])
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(metrics))
    finally:
        torch.distributed.destroy_process_group()


def test_two_gloo_ranks_return_the_global_metrics(tmp_path):
    mp.spawn(_two_rank_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        _assert_metrics(json.loads((tmp_path / f"rank{rank}.json").read_text()), FULL)


# ------------------------------------------------------------------------------------ real model, real shard set
def reference_metrics(model: BertForPreTraining, loader) -> dict:
    """The metrics recomputed from the full logits (``model.logits``), independently of the training forward."""
    correct = total = nsp_correct = samples = 0
    mlm_loss = nsp_loss = 0.0
    model.eval()
    with torch.no_grad():
        for batch in loader:
            mlm_logits, nsp_logits = model.logits(batch["input_ids"], batch["token_type_ids"],
                                                  batch["attention_mask"])
            valid = batch["masked_lm_ids"] != IGNORE_INDEX
            rows = torch.arange(len(valid)).unsqueeze(1).expand_as(valid)[valid]
            logits = mlm_logits[rows, batch["masked_lm_positions"][valid]]
            labels = batch["masked_lm_ids"][valid]
            correct += int((logits.argmax(-1) == labels).sum())
            total += int(valid.sum())
            mlm_loss += float(F.cross_entropy(logits, labels, reduction="sum"))
            nsp_correct += int((nsp_logits.argmax(-1) == batch["next_sentence_label"]).sum())
            nsp_loss += float(F.cross_entropy(nsp_logits, batch["next_sentence_label"], reduction="sum"))
            samples += len(valid)
    return {"mlm_accuracy": correct / total, "nsp_accuracy": nsp_correct / samples, "mlm_loss": mlm_loss / total,
            "nsp_loss": nsp_loss / samples, "samples": samples, "masked_tokens": total}


def _assert_close(got: dict, want: dict) -> None:
    assert set(want) <= set(got)
    for key, value in want.items():
        assert got[key] == (value if isinstance(value, int) else pytest.approx(value, rel=1e-5, abs=1e-7)), key


VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(59)]


def test_real_model_on_a_real_shard_set(tmp_path):
    vocab_file = tmp_path / "vocab.txt"
    vocab_file.write_text("\n".join(VOCAB) + "\n")
    write_shards(tmp_path / "eval", vocab_file, num_samples=37)
    torch.manual_seed(0)
    model = BertForPreTraining(model_preset("tiny", vocab_size=len(VOCAB), max_position_embeddings=32),
                               kernels="torch")
    # 37 samples in batches of 8: a short last batch, and padded prediction slots in every batch.
    loader = build_eval_loader(tmp_path / "eval", micro_batch_size=8, expected_vocab_sha256=vocab_sha256(vocab_file))
    got = evaluate(model.train(), loader)
    assert model.training
    assert got["samples"] == 37
    _assert_close(got, reference_metrics(model, loader))


# ---------------------------------------------------------------------------------- CLI on a DeepSpeed checkpoint
@pytest.fixture(scope="module")
def ds_checkpoint(tmp_path_factory) -> Path:
    """A real ZeRO-2 checkpoint of a tiny model (one gloo rank), written by the exporter's test helper in its own
    process, plus an eval shard set over its tokenizer's vocabulary."""
    out = tmp_path_factory.mktemp("ckpt")
    result = subprocess.run([sys.executable, "-m", "tests.helpers.ds_checkpoint", str(out), "--stages", "2"],
                            capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    write_shards(out / "eval", stage_checkpoint_dir(out, 2) / "tokenizer" / "vocab.txt", num_samples=21, seq_len=32)
    return out


def _cli_main():
    spec = importlib.util.spec_from_file_location("evaluate_cli", ROOT / "tools" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_cli_prints_one_json_line_matching_the_weights(ds_checkpoint):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "evaluate.py"), "--checkpoint",
                             str(stage_checkpoint_dir(ds_checkpoint, 2)), "--data", str(ds_checkpoint / "eval"),
                             "--batch-size", "4", "--kernels", "torch", "--device", "cpu"], capture_output=True,
                            text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    got = json.loads(lines[0])
    assert got["tag"] == TAG and got["samples"] == 21

    model = BertForPreTraining(BertConfig.load(stage_checkpoint_dir(ds_checkpoint, 2) / "model_config.json"),
                               kernels="torch")
    model.load_state_dict(torch.load(ds_checkpoint / "stage2_reference.pt"))
    loader = build_eval_loader(ds_checkpoint / "eval", micro_batch_size=4)
    _assert_close(got, reference_metrics(model, loader))

    limited = subprocess.run([sys.executable, str(ROOT / "tools" / "evaluate.py"), "--checkpoint",
                              str(stage_checkpoint_dir(ds_checkpoint, 2)), "--tag", TAG, "--data",
                              str(ds_checkpoint / "eval"), "--batch-size", "4", "--max-batches", "2",
                              "--kernels", "torch"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert limited.returncode == 0, limited.stderr[-3000:]
    assert json.loads(limited.stdout)["samples"] == 8


@pytest.mark.parametrize("case,pattern", [
    ("no_checkpoint", "not a directory"),
    ("bad_tag", "tag 'nope' not found"),
    ("no_data", "eval data directory does not exist"),
    ("other_vocab", "vocab_sha256"),
])
def test_cli_bad_input_exits_2(ds_checkpoint, tmp_path, capsys, case, pattern):
    checkpoint, data, extra = stage_checkpoint_dir(ds_checkpoint, 2), ds_checkpoint / "eval", []
    if case == "no_checkpoint":
        checkpoint = tmp_path / "missing"
    elif case == "bad_tag":
        extra = ["--tag", "nope"]
    elif case == "no_data":
        data = tmp_path / "missing"
    else:
        other = tmp_path / "vocab.txt"
        size = len(read_vocab(checkpoint / "tokenizer"))
        other.write_text("\n".join(VOCAB[:size]) + "\n")  # same size, different tokens
        data = tmp_path / "other"
        write_shards(data, other, num_samples=4)
    code = _cli_main()(["--checkpoint", str(checkpoint), "--data", str(data), *extra])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert pattern in captured.err and captured.err.startswith("error: ")


def _run_with_recipe_kernels(ds_checkpoint: Path, tmp_path: Path, kernels: str | None, *extra: str,
                             env: dict | None = None) -> subprocess.CompletedProcess:
    """tools/evaluate.py on a copy of the stage-2 run whose recipe.json says ``kernels`` (None: as written)."""
    run = tmp_path / "run"
    shutil.copytree(ds_checkpoint / "stage2", run)
    if kernels is not None:
        recipe = json.loads((run / "recipe.json").read_text())
        recipe["kernels"] = kernels
        if kernels == "triton":  # triton with fp32 is refused when the recipe loads; this checks the device refusal
            recipe["deepspeed"]["precision"] = "bf16"
        (run / "recipe.json").write_text(json.dumps(recipe))
    return subprocess.run([sys.executable, str(ROOT / "tools" / "evaluate.py"), "--checkpoint",
                           str(run / "checkpoints"), "--data", str(ds_checkpoint / "eval"), "--batch-size", "4",
                           "--device", "cpu", *extra], capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.search("warn", line, re.IGNORECASE)]


def test_cli_uses_the_recipe_kernels_and_warns_at_most_once(ds_checkpoint, tmp_path):
    # The shipped tiny_cpu recipe says torch: no fallback to announce, and DeepSpeed's accelerator guess is silenced.
    plain = _run_with_recipe_kernels(ds_checkpoint, tmp_path / "torch", None)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert re.search(r"kernels torch \(.*recipe\.json\)", plain.stderr), plain.stderr[-3000:]
    assert _warnings(plain.stderr) == [], plain.stderr[-3000:]
    # A recipe saying auto on a CPU: one warning, not one per fused op, and the same numbers.
    auto = _run_with_recipe_kernels(ds_checkpoint, tmp_path / "auto", "auto")
    assert auto.returncode == 0, auto.stderr[-3000:]
    warned = _warnings(auto.stderr)
    assert len(warned) == 1 and "kernels 'auto'" in warned[0] and "recipe.json" in warned[0], auto.stderr[-3000:]
    same_run = {"checkpoint"}  # two copies of one run: everything but the path agrees
    assert {k: v for k, v in json.loads(auto.stdout).items() if k not in same_run} == \
        {k: v for k, v in json.loads(plain.stdout).items() if k not in same_run}


def test_cli_refuses_recipe_kernels_that_cannot_run_unless_overridden(ds_checkpoint, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # Triton then needs CUDA tensors
    refused = _run_with_recipe_kernels(ds_checkpoint, tmp_path / "refused", "triton", env=env)
    assert refused.returncode == 2 and refused.stdout == ""
    assert re.search(r"^error: kernels='triton' \(.*recipe\.json\): .*pass --kernels torch$", refused.stderr,
                     re.MULTILINE), refused.stderr[-3000:]
    overridden = _run_with_recipe_kernels(ds_checkpoint, tmp_path / "overridden", "triton", "--kernels", "torch",
                                          env=env)
    assert overridden.returncode == 0, overridden.stderr[-3000:]
    assert "kernels torch (--kernels)" in overridden.stderr
