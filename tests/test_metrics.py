import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bert_ds.config import BertConfig, model_preset
from bert_ds.runtime.metrics import (
    MetricsLogger,
    detect_peak_tflops,
    forward_flops_per_sequence,
    peak_tflops_for,
    training_flops_per_sequence,
)


def _bert_parameter_count(c: BertConfig) -> int:
    """Hugging Face BertForPreTraining parameter count (decoder weight tied to the word embeddings)."""
    h, i = c.hidden_size, c.intermediate_size
    embeddings = (c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    heads = (h * h + h) + (h * 2 + 2) + (h * h + h) + 2 * h + c.vocab_size  # pooler, NSP, transform, bias
    return embeddings + c.num_hidden_layers * layer + heads


def test_flops_exact_on_a_hand_computed_tiny_shape():
    c = BertConfig(vocab_size=10, hidden_size=4, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    # S=3, H=4, I=8, P=2, V=10: layer 8·3·16 + 4·3·4·8 + 4·9·4 = 384 + 384 + 144 = 912;
    # pooler + NSP 2·16 + 2·4·2 = 48; MLM 2·(2·16 + 2·4·10) = 224; forward 1184, training 3 × 1184.
    assert forward_flops_per_sequence(c, 3, 2) == 1184
    assert training_flops_per_sequence(c, 3, 2) == 3 * 1184
    # max_predictions=None runs the head on all 3 positions: MLM 3 · 112 = 336.
    assert forward_flops_per_sequence(c, 3) == 912 + 48 + 336


def test_flops_ignore_vocabulary_padding():
    """The decoder multiplies by the real vocabulary rows only (the model slices the padding away)."""
    plain = BertConfig(vocab_size=10, hidden_size=4, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    padded = BertConfig(vocab_size=10, hidden_size=4, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                        pad_vocab_to_multiple_of=16)
    assert forward_flops_per_sequence(padded, 3, 2) == forward_flops_per_sequence(plain, 3, 2)


def test_flops_match_torch_flop_counter_on_the_model():
    """Forward and forward + backward of the real model, counted by PyTorch's FlopCounterMode (matmuls only)."""
    from torch.utils.flop_counter import FlopCounterMode

    from bert_ds.model import BertForPreTraining

    c = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                   max_position_embeddings=16, pad_vocab_to_multiple_of=8)
    model = BertForPreTraining(c, kernels="torch")
    B, S, P = 3, 8, 2
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 50, (B, S), generator=gen)
    args = (ids, torch.zeros_like(ids), torch.ones_like(ids), torch.tensor([[1, 2]] * B),
            torch.randint(5, 50, (B, P), generator=gen), torch.tensor([0, 1, 0]))
    with FlopCounterMode(display=False) as forward:
        model(*args)
    with FlopCounterMode(display=False) as training:
        model(*args).loss.backward()
    assert forward.get_total_flops() == B * forward_flops_per_sequence(c, S, P)
    assert training.get_total_flops() == B * training_flops_per_sequence(c, S, P)


@pytest.mark.parametrize("preset,seq_len", [("base", 128), ("large", 128), ("large", 512)])
def test_flops_agree_with_the_6NT_rule(preset, seq_len):
    c = model_preset(preset)
    n = _bert_parameter_count(c)
    assert 109e6 < n < 111e6 if preset == "base" else 334e6 < n < 337e6  # paper: ~110M / ~340M
    # Kaplan et al. 2020 (arXiv:2001.08361) §2.1: ≈ 6 × parameters × tokens, plus the attention scores and context
    # (2 matmuls of seq × seq × H per layer, ×2 FLOPs ×3 for forward+backward) = 12 × L × H × seq per token.
    rule = 6 * n * seq_len + 12 * c.num_hidden_layers * c.hidden_size * seq_len * seq_len
    ours = training_flops_per_sequence(c, seq_len)  # MLM head on every position, as the rule assumes
    assert abs(ours - rule) / rule < 0.03


def test_flops_figure_bert_large_seq128():
    c = model_preset("large")
    assert training_flops_per_sequence(c, 128, 20) == pytest.approx(233.74e9, rel=1e-4)
    assert training_flops_per_sequence(c, 128, 20) < training_flops_per_sequence(c, 128)


def test_peak_lookup():
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert peak_tflops_for("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert peak_tflops_for("NVIDIA H100 PCIe", "fp16") == 756.0
    assert peak_tflops_for("NVIDIA H200 NVL", "bf16") == 835.0 and peak_tflops_for("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops_for("Tesla V100-SXM2-32GB", "fp16") == 125.0
    assert peak_tflops_for("Tesla V100-SXM2-32GB", "bf16") is None
    assert peak_tflops_for("Some Future GPU", "bf16") is None
    assert peak_tflops_for("NVIDIA L40", "bf16") == 181.0  # not L4's figure
    assert peak_tflops_for("NVIDIA A10G", "bf16") is None  # not A10's figure
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB", "torch.float32") == 19.5
    with pytest.raises(ValueError, match="dtype"):
        peak_tflops_for("NVIDIA A100-SXM4-80GB", "int8")
    if not torch.cuda.is_available():
        assert detect_peak_tflops("bf16") is None


def _step_kwargs(i: int, **overrides) -> dict:
    kw = dict(phase=1, seq_len=128, max_predictions=20, loss=torch.tensor(10.0 - i), mlm_loss=9.0 - i,
              nsp_loss=torch.tensor(1.0), mlm_accuracy=0.1 * i, nsp_accuracy=0.5, lr=1e-4 * i,
              grad_norm=torch.tensor(2.0 * i), loss_scale=65536.0, samples=64, step_time=0.5 * i,
              consumed_samples=64 * i)
    kw.update(overrides)
    return kw


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_logger_writes_interval_aggregates(tmp_path, capsys):
    c = model_preset("large")
    logger = MetricsLogger(tmp_path / "tb", rank=0, model_config=c, peak_tflops=312.0, log_interval=2, world_size=4)
    for i in (1, 2, 3):
        logger.log_step(i, **_step_kwargs(i))
    logger.log_eval(3, {"mlm_accuracy": torch.tensor(0.5), "nsp_loss": None, "samples": 100})
    logger.close()  # writes the partial interval (step 3)
    s = _scalars(tmp_path / "tb")

    expected_tags = {"train/loss", "train/mlm_loss", "train/nsp_loss", "train/mlm_accuracy", "train/nsp_accuracy",
                     "train/lr", "train/grad_norm", "train/loss_scale", "perf/sequences_per_s", "perf/tokens_per_s",
                     "perf/tflops", "perf/mfu", "progress/consumed_samples", "progress/phase",
                     "eval/mlm_accuracy", "eval/samples"}
    assert set(s) == expected_tags
    approx = pytest.approx
    # Interval 1 = steps 1, 2 written at step 2; interval 2 = step 3 alone, written by close().
    assert [st for st, _ in s["train/loss"]] == [2, 3]
    assert s["train/loss"][0][1] == approx(8.5) and s["train/loss"][1][1] == approx(7.0)  # mean of 9, 8; then 7
    assert s["train/mlm_loss"][0][1] == approx(7.5)
    assert s["train/nsp_loss"][0][1] == approx(1.0)
    assert s["train/mlm_accuracy"][0][1] == approx(0.15)
    assert s["train/nsp_accuracy"][0][1] == approx(0.5)
    assert s["train/grad_norm"][0][1] == approx(3.0)
    assert s["train/lr"][0][1] == approx(2e-4)  # last value, not the mean
    assert s["train/loss_scale"][0][1] == approx(65536.0)
    # 128 sequences in 0.5 + 1.0 s.
    assert s["perf/sequences_per_s"][0][1] == approx(128 / 1.5)
    assert s["perf/tokens_per_s"][0][1] == approx(128 * 128 / 1.5)
    tflops = 128 * training_flops_per_sequence(c, 128, 20) / 1.5 / 4 / 1e12
    assert s["perf/tflops"][0][1] == approx(tflops, rel=1e-6)
    assert s["perf/mfu"][0][1] == approx(tflops / 312.0, rel=1e-6)
    assert s["progress/consumed_samples"] == [(2, 128.0), (3, 192.0)]
    assert s["progress/phase"][0][1] == 1.0
    assert s["eval/mlm_accuracy"] == [(3, 0.5)]
    assert s["eval/samples"] == [(3, 100.0)]

    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2  # one console line per interval
    assert lines[0].startswith("step 2 | phase 1 | loss 8.5000 | mlm acc 0.1500 | lr 2.000e-04 | 85.3 seq/s")
    assert "TFLOP/s" in lines[0] and "MFU " in lines[0] and "%" in lines[0]


def test_logger_optional_values_and_phase_change(tmp_path, capsys):
    c = BertConfig(vocab_size=100, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    with MetricsLogger(tmp_path, rank=0, model_config=c, log_interval=10) as logger:
        logger.log_step(1, **_step_kwargs(1, nsp_loss=None, nsp_accuracy=None, grad_norm=None, loss_scale=None))
        logger.log_step(2, **_step_kwargs(2, phase=2, seq_len=512, max_predictions=80, nsp_loss=None,
                                          nsp_accuracy=None, grad_norm=None, loss_scale=None))
    s = _scalars(tmp_path)
    for absent in ("train/nsp_loss", "train/nsp_accuracy", "train/grad_norm", "train/loss_scale", "perf/mfu"):
        assert absent not in s
    assert s["progress/phase"] == [(1, 1.0), (2, 2.0)]  # the phase change closed interval 1 at step 1
    assert s["perf/tokens_per_s"][1][1] == pytest.approx(64 * 512 / 1.0)
    assert "MFU n/a" in capsys.readouterr().out


def test_logger_other_ranks_write_nothing(tmp_path, capsys):
    c = model_preset("tiny")
    logger = MetricsLogger(tmp_path / "rank1", rank=1, model_config=c, log_interval=1)
    for i in (1, 2):
        logger.log_step(i, **_step_kwargs(i))
    logger.log_eval(2, {"mlm_accuracy": 0.5})
    logger.log_text("recipe", "x")
    logger.close()
    assert not (tmp_path / "rank1").exists()
    assert capsys.readouterr().out == ""


def test_logger_text(tmp_path):
    with MetricsLogger(tmp_path, rank=0, model_config=model_preset("tiny")) as logger:
        logger.log_text("recipe", "phase1: seq 128")
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    assert "recipe/text_summary" in acc.Tags()["tensors"]
