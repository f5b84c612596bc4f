"""The analytic FLOP count behind perf/tflops and MFU (:mod:`bert_ds.runtime.metrics`) against PyTorch's
FlopCounterMode, which counts every matrix product the model really runs, forward and backward.

PyTorch's counter has no formula for the CPU flash-attention kernel SDPA runs here, so it would miss the attention
matmuls (4·S²·H per layer forward); this module registers one: the two forward matmuls, and for the backward the
four gradient matmuls, leaving out the score matmul the kernel recomputes (model FLOPs count no recomputation,
PaLM appendix B). Two checks per shape: a full-length batch, where the count must be exact; and a real batch from
shards, where the unpadded model does less work than the padded count the logger uses: the counted FLOPs are
compared with the analytic count at each sequence's real length and masked positions, and with the padded count
(the work unpadding saves). What remains above the real-length count is the last layer's rows for prediction slots
that are padding in some rows but not all (computed, then dropped).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode, bmm_flop, sdpa_backward_flop_count, sdpa_flop_count

from bert_ds.config import IGNORE_INDEX, model_preset
from bert_ds.devtools.benchmarks.step import FIELDS, real_batches
from bert_ds.model import BertForPreTraining
from bert_ds.runtime.metrics import training_flops_per_sequence

__all__ = ["CPU_ATTENTION_FLOPS", "flop_check"]


def _cpu_sdpa_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    b, h, s_q, d = query
    recomputed_scores = bmm_flop((b * h, s_q, d), (b * h, d, key[2]))
    return sdpa_backward_flop_count(grad_out, query, key, value) - recomputed_scores


CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_forward,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}


def _counted(model: BertForPreTraining, batch: dict[str, torch.Tensor]) -> int:
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        model(*(batch[k] for k in FIELDS)).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def _full_length(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    full = dict(batch)
    full["attention_mask"] = torch.ones_like(batch["attention_mask"])
    return full


def flop_check(data_dir: Path, *, preset: str = "base", batch_size: int = 2) -> dict:
    # The first of ten loader batches with the most padding: a full-length one would show no difference.
    batch = min(real_batches(data_dir, batch_size, 10), key=lambda b: int(b["attention_mask"].sum()))
    seq_len = batch["input_ids"].shape[1]
    config = model_preset(preset)
    torch.manual_seed(0)
    model = BertForPreTraining(config, kernels="torch").eval()  # dropout off: FLOPs do not depend on it
    valid = (batch["masked_lm_ids"] != IGNORE_INDEX).sum(1).tolist()
    lengths = batch["attention_mask"].sum(1).tolist()

    full = _full_length(batch)
    counted_full = _counted(model, full)
    analytic_full = sum(training_flops_per_sequence(config, seq_len, p) for p in valid)
    counted_real = _counted(model, batch)
    analytic_real = sum(training_flops_per_sequence(config, n, p) for n, p in zip(lengths, valid, strict=True))
    return {
        "preset": preset, "seq_len": seq_len, "batch_size": batch_size, "lengths": lengths, "predictions": valid,
        "full_length": {"counted": counted_full, "analytic": analytic_full, "ratio": counted_full / analytic_full},
        "real_lengths": {"counted": counted_real, "analytic_at_real_lengths": analytic_real,
                         "ratio": counted_real / analytic_real, "analytic_padded": analytic_full,
                         "work_vs_padded": counted_real / analytic_full},
    }
