"""Training metrics: analytic FLOPs, peak-throughput lookup, and the TensorBoard + console logger.

FLOPs are counted analytically (a multiply-add is 2 FLOPs; only matrix products count), so MFU compares like with
like across kernels and hardware: the same work, whatever recomputation (activation checkpointing) or padding
tricks an implementation adds. This is the "model FLOPs" of the PaLM paper (appendix B), not hardware FLOPs.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from bert_ds.config import BertConfig
from bert_ds.errors import BadInput

__all__ = ["forward_flops_per_sequence", "training_flops_per_sequence", "detect_peak_tflops", "peak_tflops_for",
           "MetricsLogger"]


def forward_flops_per_sequence(config: BertConfig, seq_len: int, max_predictions: int | None = None) -> float:
    """Forward-pass FLOPs of :class:`bert_ds.model.BertForPreTraining` for one sequence.

    With S = seq_len, H = hidden_size, I = intermediate_size, L = layers, V = vocab_size, P = MLM positions
    (``max_predictions``, or S when None: the head over every position, as Hugging Face's model does):

        per layer      2·S·H·3H (QKV) + 2·S²·H (scores) + 2·S²·H (context) + 2·S·H·H (output) + 2·2·S·H·I (FFN)
                     = 8·S·H² + 4·S·H·I + 4·S²·H
        pooler + NSP   2·H² + 2·H·2                    (the [CLS] vector only)
        MLM head       P · (2·H² + 2·H·V)              (transform dense, decoder over the vocabulary)

    When P is given, the model's last layer computes only the R = 1 + P rows the heads read ([CLS] and the masked
    positions): keys and values for all S rows, everything else for R rows, so that layer costs
    4·S·H² + 4·R·H² + 4·R·S·H + 4·R·H·I instead of the full layer above.

    V is the real vocabulary: the model's decoder slices off the padded rows (``pad_vocab_to_multiple_of``), so
    they cost nothing. Embedding look-ups, LayerNorm, GELU, softmax and biases are element-wise work, not matrix
    products, and are left out as model-FLOPs accounting does. The count equals PyTorch's ``FlopCounterMode`` on
    the model, forward and backward (``tests/test_metrics.py``).
    ``max_predictions`` is the cap per sequence, so the MLM term is an upper bound when fewer are masked.
    """
    if seq_len < 1:
        raise BadInput(f"seq_len must be a positive integer, got {seq_len!r}")
    if max_predictions is not None and max_predictions < 0:
        raise BadInput(f"max_predictions must be >= 0 or None, got {max_predictions!r}")
    s, h, i = seq_len, config.hidden_size, config.intermediate_size
    v = config.vocab_size
    p = s if max_predictions is None else max_predictions
    layer = 8 * s * h * h + 4 * s * h * i + 4 * s * s * h
    r = s if max_predictions is None else min(s, 1 + p)
    last_layer = 4 * s * h * h + 4 * r * h * h + 4 * r * s * h + 4 * r * h * i
    pooler_nsp = 2 * h * h + 2 * h * 2
    mlm = p * (2 * h * h + 2 * h * v)
    return float((config.num_hidden_layers - 1) * layer + last_layer + pooler_nsp + mlm)


def training_flops_per_sequence(config: BertConfig, seq_len: int, max_predictions: int | None = None) -> float:
    """Forward + backward FLOPs for one sequence: 3 × forward (the backward pass computes the gradients of both the
    activations and the weights, each a matrix product the size of the forward one).

    Summed over the model this is ≈ 6 × parameters × tokens plus 12 × L × H × S per token for attention; with
    I = 4H the encoder term is Megatron-LM's 72·S·L·H²·(1 + S/6H) (Narayanan et al. 2021, eq. 3) per sequence.
    ``tests/test_metrics.py`` checks the 6·N·T agreement at base and large shapes (within 3 %).
    BERT-large, vocabulary 30,522: 233.7 GFLOP per sequence at S = 128, P = 20, and 990.7 GFLOP at S = 512,
    P = 80. At NVIDIA's 574 seq/s per A100 (S = 128) this count gives ~134 TFLOP/s, 43 % of the 312 TFLOP/s bf16
    peak (NVIDIA's model runs the full last layer, ~3 % more work than counted here).
    """
    return 3.0 * forward_flops_per_sequence(config, seq_len, max_predictions)


# Dense (non-sparse) tensor-core peaks in TFLOP/s from NVIDIA's data sheets. Keys are matched as substrings of
# torch.cuda.get_device_name(), most specific first. "fp32" is the plain FP32 peak (no TF32).
_PEAK_TFLOPS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("H200", "NVL"), {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),  # PCIe card: the H100 NVL's clocks
    (("H200",), {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    (("GH200",), {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),
    (("H100", "NVL"), {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0}),
    (("H100", "PCIe"), {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0}),
    (("H100",), {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}),  # SXM5 ("NVIDIA H100 80GB HBM3")
    (("A100",), {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}),
    (("L40S",), {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6}),
    (("L40",), {"bf16": 181.0, "fp16": 181.0, "fp32": 90.5}),
    (("L4",), {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3}),
    (("A10G",), {}),  # AWS variant without a public data sheet: unknown rather than A10's figures
    (("A10",), {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2}),
    (("V100", "PCIe"), {"fp16": 112.0, "fp32": 14.0}),  # Volta has no bf16
    (("V100",), {"fp16": 125.0, "fp32": 15.7}),  # SXM2
    (("T4",), {"fp16": 65.0, "fp32": 8.1}),
)

_DTYPE_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
                  "fp32": "fp32", "float32": "fp32", "float": "fp32"}


def peak_tflops_for(device_name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of a GPU named ``device_name`` for ``dtype`` (bf16, fp16, fp32); None when unknown."""
    key = _DTYPE_ALIASES.get(str(dtype).lower().removeprefix("torch."))
    if key is None:
        raise BadInput(f"dtype={dtype!r}: expected one of {sorted(_DTYPE_ALIASES)}")
    for needles, peaks in _PEAK_TFLOPS:
        if all(n in device_name for n in needles):
            return peaks.get(key)
    return None


def detect_peak_tflops(dtype: str) -> float | None:
    """Dense peak TFLOP/s of the current CUDA device for ``dtype``; None on CPU or an unlisted GPU (the recipe may
    then give the peak itself)."""
    if not torch.cuda.is_available():
        peak_tflops_for("", dtype)  # still validate the dtype name
        return None
    return peak_tflops_for(torch.cuda.get_device_name(), dtype)


def _value(x) -> float | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return float(x.detach().float().item())
    return float(x)


def _mean(values: list) -> float | None:
    present = [v for v in (_value(x) for x in values) if v is not None]
    return sum(present) / len(present) if present else None


class MetricsLogger:
    """Per-step training metrics to TensorBoard (rank 0 only) and one console line per logging interval.

    Steps are buffered and written once per interval, when ``step % log_interval == 0`` (and at a phase change and
    on :meth:`close`, so nothing is lost). The written point is at the interval's last step and holds:

    - ``train/*`` losses, accuracies and grad norm: the mean over the interval's steps (each already a batch mean);
    - ``train/lr``, ``train/loss_scale``, ``progress/*``: the value at the last step;
    - ``perf/*``: totals over the interval, so slow and fast steps weigh by their time — sequences/s and tokens/s
      (tokens = sequences × seq_len, padding included) for the whole job, ``perf/tflops`` the achieved model
      TFLOP/s *per device* (analytic FLOPs / time / world_size) and ``perf/mfu`` that over the peak. The FLOPs are
      those of full-length sequences: the model skips padding (:mod:`bert_ds.model.unpad`), so on real data these
      are padding-equivalent figures, above the arithmetic executed by the share of padding (measured by
      ``tools/benchmark.py``'s FLOP section: 0.68 of the padded count at seq 128 and 0.64 at 512 on two real
      batches); they compare directly with a padded implementation's.

    Tensors passed to :meth:`log_step` are kept (detached) until the interval is written, so a GPU run synchronises
    once per interval, not every step. Ranks other than 0 do nothing and never import TensorBoard.
    """

    def __init__(self, log_dir: str | Path, *, rank: int, model_config: BertConfig, peak_tflops: float | None = None,
                 log_interval: int = 10, world_size: int = 1) -> None:
        if log_interval < 1:
            raise BadInput(f"log_interval must be >= 1, got {log_interval!r}")
        if world_size < 1:
            raise BadInput(f"world_size must be >= 1, got {world_size!r}")
        if peak_tflops is not None and not peak_tflops > 0:
            raise BadInput(f"peak_tflops must be positive or None, got {peak_tflops!r}")
        self.rank = rank
        self.model_config = model_config
        self.peak_tflops = peak_tflops
        self.log_interval = log_interval
        self.world_size = world_size
        self.log_dir = Path(log_dir)
        self._pending: list[dict] = []
        self._flops_cache: dict[tuple[int, int | None], float] = {}
        self._writer = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def _flops(self, seq_len: int, max_predictions: int | None) -> float:
        key = (seq_len, max_predictions)
        if key not in self._flops_cache:
            self._flops_cache[key] = training_flops_per_sequence(self.model_config, seq_len, max_predictions)
        return self._flops_cache[key]

    def log_step(self, step: int, *, phase: int, seq_len: int, max_predictions: int | None, loss, mlm_loss,
                 nsp_loss, mlm_accuracy, nsp_accuracy, lr, grad_norm, loss_scale, samples: int, step_time: float,
                 consumed_samples: int) -> None:
        """Record one optimizer step (``samples`` = sequences in it over all ranks). Values may be floats or 0-d
        tensors; ``nsp_*``, ``grad_norm`` and ``loss_scale`` may be None (MLM-only recipes, no clipping, not fp16)."""
        if not self.enabled:
            return
        if self._pending and self._pending[-1]["phase"] != phase:
            self._write_interval()  # an interval never mixes phases (different seq_len, different FLOPs per sequence)

        def keep(x):
            return x.detach() if isinstance(x, torch.Tensor) else x

        self._pending.append(dict(
            step=int(step), phase=int(phase), seq_len=int(seq_len), max_predictions=max_predictions,
            loss=keep(loss), mlm_loss=keep(mlm_loss), nsp_loss=keep(nsp_loss), mlm_accuracy=keep(mlm_accuracy),
            nsp_accuracy=keep(nsp_accuracy), lr=keep(lr), grad_norm=keep(grad_norm), loss_scale=keep(loss_scale),
            samples=int(samples), step_time=float(step_time), consumed_samples=int(consumed_samples),
        ))
        if step % self.log_interval == 0:
            self._write_interval()

    def _write_interval(self) -> None:
        steps, self._pending = self._pending, []
        if not steps:
            return
        last = steps[-1]
        step = last["step"]
        scalars: dict[str, float] = {}
        for name in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy", "grad_norm"):
            value = _mean([s[name] for s in steps])
            if value is not None:
                scalars[f"train/{name}"] = value
        scalars["train/lr"] = _value(last["lr"])
        if last["loss_scale"] is not None:
            scalars["train/loss_scale"] = _value(last["loss_scale"])

        seconds = sum(s["step_time"] for s in steps)
        sequences = sum(s["samples"] for s in steps)
        tokens = sum(s["samples"] * s["seq_len"] for s in steps)
        flops = sum(s["samples"] * self._flops(s["seq_len"], s["max_predictions"]) for s in steps)
        mfu = None
        if seconds > 0:
            tflops = flops / seconds / self.world_size / 1e12
            scalars["perf/sequences_per_s"] = sequences / seconds
            scalars["perf/tokens_per_s"] = tokens / seconds
            scalars["perf/tflops"] = tflops
            if self.peak_tflops is not None:
                mfu = tflops / self.peak_tflops
                scalars["perf/mfu"] = mfu
        scalars["progress/consumed_samples"] = float(last["consumed_samples"])
        scalars["progress/phase"] = float(last["phase"])

        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        print(self._console_line(step, last["phase"], scalars, mfu), flush=True)

    @staticmethod
    def _console_line(step: int, phase: int, s: dict[str, float], mfu: float | None) -> str:
        def fmt(tag: str, spec: str) -> str:
            value = s.get(tag)
            return "n/a" if value is None or not math.isfinite(value) else format(value, spec)

        parts = [
            f"step {step}",
            f"phase {phase}",
            f"loss {fmt('train/loss', '.4f')}",
            f"mlm acc {fmt('train/mlm_accuracy', '.4f')}",
            f"lr {fmt('train/lr', '.3e')}",
            f"{fmt('perf/sequences_per_s', ',.1f')} seq/s",
            f"{fmt('perf/tokens_per_s', ',.0f')} tok/s",
            f"{fmt('perf/tflops', '.2f')} TFLOP/s/dev",
            f"MFU {'n/a' if mfu is None else format(100 * mfu, '.1f') + '%'}",
        ]
        return " | ".join(parts)

    def log_eval(self, step: int, metrics: dict) -> None:
        """Write each numeric entry of ``metrics`` as ``eval/<name>`` (None entries are skipped) and print one line;
        a ``sources`` entry (:func:`bert_ds.evaluate.evaluate_sources`) adds ``eval/<source>/<name>`` per held-out set
        and one line each."""
        if not self.enabled:
            return
        lines = [f"eval step {step} | " + self._eval_scalars("eval", step, metrics)]
        for source, values in (metrics.get("sources") or {}).items():
            lines.append(f"eval step {step} {source} | " + self._eval_scalars(f"eval/{source}", step, values))
        self._writer.flush()
        print("\n".join(lines), flush=True)

    def _eval_scalars(self, prefix: str, step: int, metrics: dict) -> str:
        written = {}
        for name, value in metrics.items():
            value = _value(value) if isinstance(value, int | float | torch.Tensor) else None
            if value is not None:
                self._writer.add_scalar(f"{prefix}/{name}", value, step)
                written[name] = value
        return " | ".join(f"{k} {v:.4f}" if not float(v).is_integer() else f"{k} {int(v)}" for k, v in written.items())

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """Write each ``tag: value`` as it is (the loader's data wait, :func:`bert_ds.runtime.trainer`)."""
        if self.enabled:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, float(value), step)

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        """Free text (the resolved recipe, the command line) under ``tag`` in TensorBoard's Text tab."""
        if self.enabled:
            self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        """Write any partial interval and flush the event file (call before a checkpoint or an eval)."""
        if self.enabled:
            self._write_interval()
            self._writer.flush()

    def close(self) -> None:
        if self.enabled:
            self.flush()
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
