"""One command for the owner of a CUDA GPU: are bert_ds's kernels right and fast here, and how fast does BERT train?

    bert-ds-gpu-check [--out gpu_check.json]        (also python tools/gpu_check.py)

On a CUDA device (a plain PyTorch + Triton install; no DeepSpeed, apex or data needed; minutes, not hours):

- ``kernels.<op>.<dtype>``: every Triton kernel against its torch twin on the device, forward and backward, fp32 and
  bf16, at BERT shapes plus awkward ones (odd row counts, padding, ragged packed sequences);
- ``speed.<op>``: forward and forward+backward time of each Triton kernel against its twin at BERT-large shapes in
  bf16 (LayerNorm + residual vs ``F.layer_norm``, bias-GELU vs ``F.gelu``, attention vs SDPA);
- ``train.large.s128`` / ``train.large.s512``: BERT-large training steps in bf16 (bf16 model, fp32 master weights
  and LAMB, as the engine's DeepSpeed bf16 mode) with every kernel backend: sequences/s, TFLOP/s and MFU from the
  analytic model FLOPs (:mod:`bert_ds.runtime.metrics`) and the device's dense bf16 peak;
- ``aot.sass``: the ahead-of-time sm_80/sm_90 builds' machine code checks (:mod:`bert_ds.kernels.aot`), and
  ``aot.matches_jit``: every kernel the JIT compiled during the BERT-large steps is a build the AOT report checks.
- ``mfu.large.s<seq>``: auto's MFU against the GPU family's floor; ``profile.large.s<seq>``: where a step's time goes
  (:mod:`.gpu_profile`); ``golden_resume.base.s128``: 20 steps, saved at 10 and resumed, bit for bit
  (:mod:`.golden_resume`, in a child process in deterministic mode). Rules: :mod:`.gpu_rules`.

Without a GPU the same command runs what it can and exits 0 when that passes: the kernels against their twins under
the Triton CPU interpreter at small shapes, a tiny-model training step through the same step code with the Triton
kernels (interpreted) and the torch twins (their losses must agree and fall), the golden resume and the profile on the
tiny model, and the AOT machine-code checks; every
GPU item is listed as skipped with its reason. Items needing triton's interpreter or compiler run in a child process
with ``TRITON_INTERPRET`` set for them (triton fixes the mode at import). Results go to a JSON report.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

import bert_ds.kernels as kernels
from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, option
from bert_ds.config import IGNORE_INDEX, BertConfig, model_preset
from bert_ds.devtools.bench_step import BenchStep, predictions_for, synthetic_batch
from bert_ds.devtools.golden_resume import CUBLAS_WORKSPACE
from bert_ds.devtools.gpu_profile import format_profile, profile_steps, profile_training
from bert_ds.devtools.gpu_rules import (
    RULES,
    SPEED_FLOOR,
    TRAIN_FLOORS,
    golden_rule,
    gpu_family,
    keep_rate_rule,
    loss_rule,
    mask_rule,
    mfu_rule,
    profile_rule,
    reference_keep_mask,
    speed_rule,
    twin_rule,
)
from bert_ds.runtime.metrics import peak_tflops_for, training_flops_per_sequence

__all__ = ["Item", "check_kernels", "jit_matches_aot", "main", "measure_kernel_speed", "measure_training",
           "record_jit_compiles", "run_gpu_check"]

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"
# Per-GPU micro-batches of the two pre-training phases (NVIDIA's BERT-large recipe on 80 GB A100s); halved on OOM.
DEFAULT_BATCH = {128: 64, 512: 16}


@dataclass
class Item:
    """One line of the report: a check or a measurement."""

    name: str
    status: str
    seconds: float = 0.0
    details: dict = field(default_factory=dict)
    reason: str = ""  # why it was skipped or failed


def _run(name: str, fn: Callable[[], tuple[bool, dict] | dict]) -> Item:
    """Run ``fn`` as the item ``name``: it returns details (passed) or (ok, details); an exception fails the item."""
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # one broken item must not hide the others
        return Item(name, FAILED, time.perf_counter() - start, {"traceback": traceback.format_exc(limit=8)},
                    f"{type(exc).__name__}: {exc}")
    ok, details = result if isinstance(result, tuple) else (True, result)
    reason = "" if ok else details.get("reason", "a comparison is out of tolerance (see details)")
    return Item(name, PASSED if ok else FAILED, time.perf_counter() - start, details, reason)


# ---------------------------------------------------------------------------------------------- kernels vs twins

# The reference is the twin in fp32 on the same (upcast) inputs; the pass rule is gpu_rules.twin_rule (fp32
# elementwise as tests/kernels; bf16 in units of its eps, as tests/helpers/kernels.py).

@dataclass(frozen=True)
class _Case:
    """One comparison: ``run(backend, *inputs)`` for backend "triton" and "torch"; ``rows`` selects the output
    entries that must agree (real query rows of padded attention), None for all."""

    label: str
    run: Callable
    inputs: list
    grad_out: torch.Tensor
    rows: torch.Tensor | None = None


def _layer_norm_cases(shapes, dtype, device, gen) -> list[_Case]:
    cases = []
    for shape in shapes:
        n = shape[-1]
        x, r, dy = (torch.randn(shape, generator=gen) for _ in range(3))
        w, b = 1 + 0.5 * torch.randn(n, generator=gen), 0.5 * torch.randn(n, generator=gen)
        to = [t.to(device, dtype) for t in (x, w, b, r)]
        cases.append(_Case(f"{tuple(shape)}+residual", lambda be, x, w, b, r: kernels.layer_norm(
            x, w, b, 1e-12, residual=r, backend=be), to, dy.to(device, dtype)))
        cases.append(_Case(f"{tuple(shape)}", lambda be, x, w, b: kernels.layer_norm(x, w, b, 1e-12, backend=be),
                           to[:3], dy.to(device, dtype)))
    return cases


def _bias_gelu_cases(shapes, dtype, device, gen) -> list[_Case]:
    cases = []
    for shape in shapes:
        x, b, dy = 2 * torch.randn(shape, generator=gen), torch.randn(shape[-1], generator=gen), torch.randn(
            shape, generator=gen)
        cases.append(_Case(f"{tuple(shape)}", lambda be, x, b: kernels.bias_gelu(x, b, backend=be),
                           [x.to(device, dtype), b.to(device, dtype)], dy.to(device, dtype)))
    return cases


def _attention_cases(shapes, dtype, device, gen, dropout_p: float = 0.0) -> list[_Case]:
    # dropout_p > 0 only for timing: kernel and twin draw different masks, so their values are not compared.
    cases = []
    for lengths, heads, seq in shapes:
        batch = len(lengths)
        # (B, nh, S, hd) views of (B, S, H) projections, as the model passes them.
        q, k, v, do = (torch.randn(batch, seq, heads, 64, generator=gen).to(device, dtype).transpose(1, 2)
                       for _ in range(4))
        mask = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]).to(device)
        rows = mask[:, None, :, None].expand(q.shape)
        label = f"batch={batch},seq={seq},heads={heads}" + (f",lengths={lengths}" if min(lengths) < seq else "")
        label += f",dropout={dropout_p}" if dropout_p else ""
        cases.append(_Case(label, lambda be, q, k, v, mask=mask: kernels.attention(
            q, k, v, mask, dropout_p, backend=be), [q, k, v], do, rows))
    return cases


def _varlen_attention_cases(shapes, dtype, device, gen, dropout_p: float = 0.0) -> list[_Case]:
    cases = []
    for lengths, heads in shapes:
        total = sum(lengths)
        q, k, v, do = (torch.randn(total, heads, 64, generator=gen).to(device, dtype) for _ in range(4))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        label = (f"lengths={lengths}" if len(set(lengths)) > 1 else f"{len(lengths)}x{lengths[0]} tokens") + \
            f",heads={heads}" + (f",dropout={dropout_p}" if dropout_p else "")
        longest = max(lengths)
        cases.append(_Case(label, lambda be, q, k, v, cu=cu, m=longest: kernels.varlen_attention(
            q, k, v, cu, m, dropout_p, backend=be), [q, k, v], do))
    return cases


# Shapes on the device: BERT-base/large sizes and awkward ones. Under the interpreter: small, same code paths.
_KERNEL_SHAPES = {
    "layer_norm": (_layer_norm_cases, [(4, 128, 1024), (3, 77, 768)], [(2, 13, 256)]),
    "bias_gelu": (_bias_gelu_cases, [(4, 128, 4096), (3, 77, 3072)], [(2, 13, 512)]),
    "attention": (_attention_cases, [([512, 300], 16, 512), ([128, 77, 5], 12, 128)], [([64, 40], 2, 64)]),
    "varlen_attention": (_varlen_attention_cases, [([512, 300, 17], 16), ([128, 77, 5], 12)], [([40, 17], 2)]),
}


def _grads(run: Callable, backend: str, inputs: list, grad_out: torch.Tensor):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = run(backend, *leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


def _selected(got: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if rows is not None and got.shape == rows.shape:
        return got[rows], ref[rows]
    return got, ref


def _max_error(got: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    got, ref = got.float(), ref.float()
    if rows is not None and got.shape == rows.shape:
        got, ref = got[rows], ref[rows]
    return (got - ref).abs(), ref


def _kernel_dtypes(op: str, device: torch.device) -> tuple[torch.dtype, ...]:
    """fp32 and bf16, except attention on CUDA: its Triton kernels refuse fp32 there (registry)."""
    if device.type == "cuda" and "attention" in op:
        return (torch.bfloat16,)
    return torch.float32, torch.bfloat16


def check_kernels(device: torch.device, small: bool = False, ops: tuple[str, ...] = tuple(_KERNEL_SHAPES),
                  prefix: str = "kernels") -> list[Item]:
    """Each op's Triton kernels against the torch twin, forward and backward, fp32 and bf16: one item per op and
    dtype, with the largest absolute error of the output and of each gradient (and, in bf16, the twin's own)."""
    items = []
    for op in ops:
        make, full, tiny = _KERNEL_SHAPES[op]
        for dtype in _kernel_dtypes(op, device):
            def check(make=make, dtype=dtype, shapes=tiny if small else full):
                gen = torch.Generator().manual_seed(0)
                fp32 = dtype == torch.float32
                ok, details = True, {"device": str(device), "rule": RULES["kernels.<op>.<dtype>"]}
                for case in make(shapes, dtype, device, gen):
                    runs = {"triton": _grads(case.run, "triton", case.inputs, case.grad_out),
                            "reference": _grads(case.run, "torch", [t.float() if t.is_floating_point() else t
                                                                    for t in case.inputs], case.grad_out.float())}
                    if not fp32:
                        runs["twin"] = _grads(case.run, "torch", case.inputs, case.grad_out)
                    flat = {backend: [out, *grads] for backend, (out, grads) in runs.items()}
                    names = ["out"] + [f"grad{i}" for i in range(len(flat["triton"]) - 1)]
                    row = {"max_abs_error": {}, "twin_max_abs_error": {}, "error_in_eps": {}}
                    for i, name in enumerate(names):
                        # Padded query rows of attention hold anything finite: outputs compare on real rows only.
                        rows = case.rows if name == "out" else None
                        got, ref = _selected(flat["triton"][i], flat["reference"][i], rows)
                        good, verdict = twin_rule(got, ref, dtype)
                        row["max_abs_error"][name] = verdict["max_abs_error"]
                        if not fp32:
                            row["error_in_eps"][name] = verdict["error_in_eps"]
                            row["twin_max_abs_error"][name] = float(
                                _max_error(flat["twin"][i], flat["reference"][i], rows)[0].max())
                        ok = ok and good
                    for key in ("twin_max_abs_error", "error_in_eps"):
                        if not row[key]:
                            del row[key]
                    details[case.label] = row
                return ok, details

            items.append(_run(f"{prefix}.{op}.{_dtype_name(dtype)}", check))
    return items


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


# ---------------------------------------------------------------------------------------------- dropout masks


def _kernel_masks(kind: str, p: float, lengths: list[int], heads: int, device, dtype) -> tuple[list, tuple]:
    """The keep-mask each sequence got inside the ``kind`` ("padded"/"varlen") Triton attention, read out of its
    output: q = k = 0 makes the attention uniform (1/L), v = identity makes the output the dropped attention matrix,
    so out > 0 exactly where a pair was kept. Returns per-sequence (nh, L, L) masks and the Philox key drawn."""
    from bert_ds.kernels.dropout import draw_dropout_seed

    seq = max(lengths)
    head_dim = 128 if seq > 64 else (64 if seq > 32 else 32)
    eye = torch.eye(seq, head_dim, dtype=dtype, device=device)
    torch.manual_seed(1234)
    seed = draw_dropout_seed()
    torch.manual_seed(1234)  # the kernel call draws the same key
    if kind == "padded":
        zeros = torch.zeros(len(lengths), heads, seq, head_dim, dtype=dtype, device=device)
        mask = torch.arange(seq, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
        out = kernels.attention(zeros, zeros, eye.expand_as(zeros), mask, p, backend="triton")
        return [out[b, :, :n, :n] > 0 for b, n in enumerate(lengths)], seed
    packed = torch.cat([eye[:n, None, :].expand(n, heads, head_dim) for n in lengths])  # (T, nh, hd)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    out = kernels.varlen_attention(torch.zeros_like(packed), torch.zeros_like(packed), packed, cu, seq, p,
                                   backend="triton")
    return [rows.transpose(0, 1)[:, :, :n] > 0 for rows, n in zip(out.split(lengths), lengths, strict=True)], seed


def check_dropout_masks(device: torch.device, small: bool = False, prefix: str = "dropout",
                        reference=reference_keep_mask) -> list[Item]:
    """Both Triton attentions' masks against the CPU Philox reference bit for bit, and their keep rates, at p = 0.1
    (the recipes) and 0.5; ``reference`` is replaceable so that a wrong reference can be shown to fail the rule."""
    lengths, heads = ([32, 19], 2) if small else ([128, 77, 128], 8)
    dtype = torch.float32 if small else torch.bfloat16
    items = []
    for kind in ("padded", "varlen"):
        for p in (0.1, 0.5):
            def check(kind=kind, p=p):
                masks, seed = _kernel_masks(kind, p, lengths, heads, device, dtype)
                want = reference(seed, p, len(lengths), heads, max(lengths))
                got = torch.zeros_like(want)
                for b, (m, n) in enumerate(zip(masks, lengths, strict=True)):
                    got[b, :, :n, :n] = m.cpu()
                real = torch.cat([m.reshape(-1).cpu() for m in masks])
                same, bits = mask_rule(torch.cat([got[b, :, :n, :n].reshape(-1) for b, n in enumerate(lengths)]),
                                       torch.cat([want[b, :, :n, :n].reshape(-1) for b, n in enumerate(lengths)]))
                rate_ok, rate = keep_rate_rule(real, p)
                details = {"rule": RULES["dropout.<padded|varlen>.p<p>"], "bits": bits, "keep": rate}
                if not (same and rate_ok):
                    details["reason"] = bits.get("reason") or rate.get("reason")
                return same and rate_ok, details

            items.append(_run(f"{prefix}.{kind}.p{p}", check))
    return items


# ---------------------------------------------------------------------------------------------- kernel speed


def _cuda_ms(fn: Callable[[], object], warmup: int = 5, reps: int = 20) -> float:
    """Median time of ``fn`` on the current CUDA stream, in ms (CUDA events around each call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_kernel_speed(device: torch.device) -> list[Item]:
    """Triton kernel vs torch twin at BERT-large bf16 shapes (batch 32 x seq 128 rows; attention also at seq 512, with
    and without attention dropout 0.1): forward and forward+backward median ms, and the twin's time over the
    kernel's (speedup)."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    benches = {
        "layer_norm": _layer_norm_cases([(32, 128, 1024)], dtype, device, gen)[:1],
        "bias_gelu": _bias_gelu_cases([(32, 128, 4096)], dtype, device, gen),
        "attention": [case for p in (0.0, 0.1) for case in _attention_cases(
            [([128] * 32, 16, 128), ([512] * 8, 16, 512)], dtype, device, gen, p)],
        "varlen_attention": [case for p in (0.0, 0.1) for case in _varlen_attention_cases(
            [([128] * 32, 16), ([512] * 8, 16)], dtype, device, gen, p)],
    }
    items = []
    for op, cases in benches.items():
        def bench(cases=cases, op=op):
            details = {}
            for case in cases:
                row = {}
                for backend in ("triton", "torch"):
                    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in case.inputs]
                    grads_of = [t for t in leaves if t.requires_grad]

                    def forward(run=case.run, backend=backend, leaves=leaves):
                        return run(backend, *leaves)

                    def forward_backward(forward=forward, grads_of=grads_of, dy=case.grad_out):
                        return torch.autograd.grad(forward(), grads_of, dy)

                    with torch.no_grad():
                        fwd = _cuda_ms(forward)
                    row[backend] = {"fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(_cuda_ms(forward_backward), 4)}
                row["speedup_fwd"] = round(row["torch"]["fwd_ms"] / row["triton"]["fwd_ms"], 3)
                row["speedup_fwd_bwd"] = round(row["torch"]["fwd_bwd_ms"] / row["triton"]["fwd_bwd_ms"], 3)
                details[case.label] = row
            return _auto_is_faster(op, details)

        items.append(_run(f"speed.{op}", bench))
    return items


def _auto_is_faster(op: str, details: dict) -> tuple[bool, dict]:
    """speed.<op>'s rule: in every case, the backend ``auto`` picks for bf16 (registry.AUTO_TRITON_ON_CUDA) is at
    least SPEED_FLOOR as fast as the other, forward + backward."""
    from bert_ds.kernels.registry import AUTO_TRITON_ON_CUDA

    picks_triton = torch.bfloat16 in AUTO_TRITON_ON_CUDA[op]
    ok, reasons = True, []
    for label, row in details.items():
        ratio = row["speedup_fwd_bwd"] if picks_triton else 1.0 / row["speedup_fwd_bwd"]
        good, verdict = speed_rule(ratio, SPEED_FLOOR, f"{label}: auto's {'triton' if picks_triton else 'torch'}")
        row["auto_rule"] = verdict
        ok = ok and good
        reasons += [verdict["reason"]] if not good else []
    out = {"rule": RULES["speed.<op>"], "auto_picks": "triton" if picks_triton else "torch", **details}
    if reasons:
        out["reason"] = "; ".join(reasons)
    return ok, out


# ---------------------------------------------------------------------------------------------- training step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_training(config: BertConfig, seq: int, batch: int, device: torch.device, dtype: torch.dtype,
                     kernel_backend: str, steps: int = 10, warmup: int = 3, lr: float = 1e-3,
                     peak_tflops: float | None = None) -> dict:
    """Time ``warmup + steps`` training steps on one repeated synthetic batch.

    A step: forward + backward of :class:`~bert_ds.model.BertForPreTraining` in ``dtype``, then (for bf16) the
    gradients into fp32 master weights, a LAMB step (:class:`~bert_ds.optim.lamb.ZeroAwareLamb`, weight decay 0.01
    except biases and LayerNorm) and the weights back, as the engine's DeepSpeed bf16 mode does on one rank.
    Sequences/s is reported for forward+backward alone (a micro-batch under gradient accumulation, how BERT is
    pre-trained: the optimizer runs once per 100+ micro-batches) and for whole steps."""
    bench = BenchStep(config, device, dtype, kernel_backend, lr=lr)
    data = synthetic_batch(config, batch, seq, predictions_for(seq), device)

    losses, fwd_bwd, opt = [], [], []
    for step in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = bench.forward_backward(data)
        _sync(device)
        t1 = time.perf_counter()
        bench.optimizer_step()
        _sync(device)
        t2 = time.perf_counter()
        losses.append(loss)
        if step >= warmup:
            fwd_bwd.append(t1 - t0)
            opt.append(t2 - t1)
    losses = [float(x) for x in losses]
    t_fb, t_opt = statistics.median(fwd_bwd), statistics.median(opt)
    flops = training_flops_per_sequence(config, seq, predictions_for(seq))
    seq_per_s = batch / t_fb
    tflops = flops * seq_per_s / 1e12
    result = {
        "kernels": kernel_backend, "dtype": _dtype_name(dtype), "batch": batch, "seq": seq, "steps": steps,
        "warmup": warmup, "fwd_bwd_ms": round(1e3 * t_fb, 3), "optimizer_ms": round(1e3 * t_opt, 3),
        "seq_per_s": round(seq_per_s, 2), "seq_per_s_with_optimizer_each_step": round(batch / (t_fb + t_opt), 2),
        "model_tflop_per_seq": round(flops / 1e12, 6), "tflops": round(tflops, 2),
        "mfu": round(tflops / peak_tflops, 4) if peak_tflops else "unknown peak",
        "losses": [round(x, 5) for x in losses],
    }
    if device.type == "cuda":
        result["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del bench
    return result


def _transformers_training(config: BertConfig, seq: int, batch: int, device: torch.device, steps: int,
                           warmup: int = 3, peak_tflops: float | None = None) -> dict:
    """transformers' BertForPreTraining (SDPA attention) in bf16 on the same synthetic batch: forward + backward
    sequences/s, TFLOP/s and MFU by the same FLOP count, the baseline of train.large.*. MLM labels at the same
    masked positions. No optimizer runs (a micro batch's work), so its losses are only checked to be finite."""
    from transformers import BertConfig as HFConfig
    from transformers import BertForPreTraining as HFBert

    hf = HFConfig(**{k: getattr(config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                     "num_attention_heads", "intermediate_size",
                                                     "hidden_dropout_prob", "attention_probs_dropout_prob",
                                                     "max_position_embeddings", "layer_norm_eps")},
                  attn_implementation="sdpa")
    model = HFBert(hf).to(device=device, dtype=torch.bfloat16).train()
    data = synthetic_batch(config, batch, seq, predictions_for(seq), device)
    labels = torch.full_like(data["input_ids"], IGNORE_INDEX)
    labels.scatter_(1, data["masked_lm_positions"], data["masked_lm_ids"])
    times, losses = [], []
    for step in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=data["input_ids"], token_type_ids=data["token_type_ids"],
                    attention_mask=data["attention_mask"], labels=labels,
                    next_sentence_label=data["next_sentence_label"])
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        _sync(device)
        losses.append(out.loss.detach())
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    del model
    seq_per_s = batch / statistics.median(times)
    tflops = training_flops_per_sequence(config, seq, predictions_for(seq)) * seq_per_s / 1e12
    return {"kernels": "transformers (sdpa)", "batch": batch, "seq": seq, "seq_per_s": round(seq_per_s, 2),
            "tflops": round(tflops, 2), "mfu": round(tflops / peak_tflops, 4) if peak_tflops else "unknown peak",
            "losses": [round(float(x), 5) for x in losses]}


def _train_on_gpu(config: BertConfig, seq: int, batch: int, device: torch.device, steps: int,
                  peak: float | None) -> tuple[bool, dict]:
    """BERT-large at ``seq`` with the recipe's dropout: ``auto`` against the torch twins and transformers, measured
    in the same run at the same batch (halved for all on out-of-memory). Rule: gpu_rules.TRAIN_FLOORS."""
    runs = {}
    while True:
        try:
            torch.cuda.reset_peak_memory_stats(device)
            for backend in ("auto", "torch"):
                runs[backend] = measure_training(config, seq, batch, device, torch.bfloat16, backend, steps=steps,
                                                 peak_tflops=peak)
            runs["transformers"] = _transformers_training(config, seq, batch, device, steps, peak_tflops=peak)
            break
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            batch //= 2  # every backend again at half the batch; the report says which batch ran
        finally:
            gc.collect()
            torch.cuda.empty_cache()
    ok, verdicts = True, {}
    for name, key in (("torch twins", "torch"), ("transformers", "transformers")):
        good, verdicts[name] = speed_rule(runs["auto"]["seq_per_s"] / runs[key]["seq_per_s"], TRAIN_FLOORS[name],
                                          f"auto vs {name}")
        ok = ok and good
    for key in ("auto", "torch"):
        good, verdicts[f"losses {key}"] = loss_rule(runs[key]["losses"], runs[key]["warmup"])
        if not good:
            verdicts[f"losses {key}"]["reason"] = f"{key}: {verdicts[f'losses {key}']['reason']}"
        ok = ok and good
    finite = all(math.isfinite(x) for x in runs["transformers"]["losses"])
    verdicts["losses transformers"] = {"finite": finite} | ({} if finite else {"reason": "transformers: non-finite "
                                                                                          "loss"})
    ok = ok and finite
    details = {"rule": RULES["train.large.s<seq>"], "mfu_formula": "MFU = 3 x forward FLOPs per sequence "
               "(bert_ds.runtime.metrics.training_flops_per_sequence) x sequences/s (forward + backward) / peak",
               "peak_bf16_tflops": peak if peak else "unknown peak", "floors": verdicts, **runs}
    reasons = [v["reason"] for v in verdicts.values() if "reason" in v]
    if reasons:
        details["reason"] = "; ".join(reasons)
    return ok, details


def _tiny_training_check(triton_backend: str = "triton") -> tuple[bool, dict]:
    """The training-step code on the CPU with the tiny preset: Triton kernels (interpreted) and torch twins from
    the same weights and batch, dropout off, judged by the golden rule with the fp32 twins as the reference (so the
    bound is its 1e-3 floor); the loss must also fall."""
    # A 4,000-token vocabulary (as the tests' tokenizer): the step path is the point, not the embedding size.
    base = model_preset("tiny", vocab_size=4000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool only adds overhead (9 ms vs 770 ms a step, busy 2 cores)
    try:
        runs = {b: measure_training(base, 32, 4, torch.device("cpu"), torch.float32, b, steps=3, warmup=1, lr=1e-2)
                for b in (triton_backend, "torch")}
    finally:
        torch.set_num_threads(threads)
    tri, ref = runs[triton_backend]["losses"], runs["torch"]["losses"]
    agree, golden = golden_rule(tri, ref, ref)
    falls, losses = loss_rule(tri, 0)
    details = {"rule": RULES["golden.base.s128"], "golden": golden, "loss_falls": falls, "loss_rule": losses, **runs}
    if not (agree and falls):
        details["reason"] = golden.get("reason") or losses["reason"]
    return agree and falls, details


def _golden_on_gpu(device: torch.device, steps: int = 8) -> tuple[bool, dict]:
    """golden.base.s128: BERT-base at seq 128, batch 32, dropout off, the same seed and batch: Triton kernels (bf16)
    and the torch twins (bf16) against the twins in fp32, step by step (gpu_rules.golden_rule)."""
    config = model_preset("base", vocab_size=30522, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    runs = {name: measure_training(config, 128, 32, device, dtype, backend, steps=steps, warmup=0)
            for name, backend, dtype in (("triton", "triton", torch.bfloat16), ("twins", "torch", torch.bfloat16),
                                         ("fp32 reference", "torch", torch.float32))}
    ok, golden = golden_rule(runs["triton"]["losses"], runs["twins"]["losses"], runs["fp32 reference"]["losses"])
    # Dropout off, one batch: the loss falls; the first LAMB steps may overshoot (H100: step 2 above step 1).
    falls = {name: loss_rule(run["losses"], 3) for name, run in runs.items()}
    reasons = [golden.get("reason")] + [f"{name}: {v['reason']}" for name, (_, v) in falls.items() if "reason" in v]
    details = {"rule": RULES["golden.base.s128"], **golden, **{k: v["losses"] for k, v in runs.items()},
               "loss_falls": {name: v for name, (_, v) in falls.items()}}
    if any(reasons):
        details["reason"] = "; ".join(r for r in reasons if r)
    return ok and all(good for good, _ in falls.values()), details


# ---------------------------------------------------------------------------------------------- AOT and the JIT


@functools.cache
def _recipe_launches() -> tuple:
    """Every shipped recipe's launches (``recipe_launches.shipped_launches``: the recipes' models run on the CPU,
    seconds), recorded once per gpu-check: the SASS check and the JIT comparison both build from them."""
    from bert_ds.devtools.recipe_launches import shipped_launches

    return tuple(shipped_launches()[0])


def _aot_builds(targets) -> list:
    """The kernel report's builds (every shipped recipe's launches) for ``targets``; a clear error when the installed
    Triton is not the one the AOT code is written against (its internals differ: e.g. triton 3.6 has no
    ``knobs.compilation.fpsan_homomorphic_casts``)."""
    from bert_ds.kernels import aot
    from bert_ds.kernels.jit import triton_version_problem

    problem = triton_version_problem()
    if problem is not None:
        raise RuntimeError(f"unsupported Triton version: {problem}")
    return aot.builds_from_launches(list(_recipe_launches()), targets)


def _aot_sass_check() -> tuple[bool, dict]:
    from bert_ds.kernels import aot

    rows = [aot.analyse(b) for b in _aot_builds(aot.TARGETS)]
    details = {"rule": RULES["aot.sass"], "summary": aot.format_summary(rows)}
    details |= {f"{r.kernel} [{r.config}] sm_{r.arch}": {
        "reg": r.reg, "stack": r.stack, "local": r.local, "loads_by_bits": r.loads, "stores_by_bits": r.stores,
        "tensor_core_ops": r.tensor_core_ops, "shapes": list(r.shapes), "problems": list(r.problems)} for r in rows}
    problems = [f"{k}: {p}" for k, v in details.items() if isinstance(v, dict) for p in v["problems"]]
    if not rows:  # nothing checked is not a pass: the recipes' launches gave no build
        problems = ["no AOT build to check (the shipped recipes' launches produced none)"]
    if problems:
        details["reason"] = "; ".join(problems)
    return not problems, details


def _spec_key(name: str, signature: dict, constants: dict, attrs: dict, num_warps: int, num_stages: int) -> tuple:
    return (name, tuple(signature.items()), repr(sorted(constants.items())), repr(sorted(attrs.items())),
            num_warps, num_stages)


@contextmanager
def record_jit_compiles() -> Iterator[list[tuple]]:
    """Collect what the JIT compiles inside the block (kernel name, signature, constexprs, attrs, warps, stages),
    through triton's ``jit_post_compile_hook``; a hook already installed keeps being called."""
    from triton import knobs

    seen: list[tuple] = []
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        seen.append(_spec_key(fn.name.split(".")[-1], compile["signature"], compile["constants"],
                              compile["configs"][0], compile["num_warps"], compile["num_stages"]))
        if previous is not None:
            return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled)
        return None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def jit_matches_aot(compiled: list[tuple], target) -> tuple[bool, dict]:
    """Every JIT compile must be one of the AOT builds for ``target``: a compile of a kernel the AOT report has no
    build of at all fails as well as one whose binary differs, each named."""
    builds = _aot_builds([target])
    known = {_spec_key(b.kernel, b.spec.signature, b.spec.constexprs, b.spec.attrs, b.spec.options["num_warps"],
                       b.spec.options["num_stages"]): b for b in builds}
    covered = {b.kernel for b in builds}
    matched, missing, other = set(), [], set()
    for key in compiled:
        if key[0] not in covered:
            other.add(key[0])
        elif key in known:
            matched.add(f"{key[0]} [{known[key].label}]")
        else:
            missing.append({"kernel": key[0], "signature": dict(key[1]), "constexprs": key[2], "attrs": key[3]})
    details = {"target": f"sm_{target.arch}", "jit_compiles": len(compiled), "matched_aot_builds": sorted(matched),
               "not_built_ahead_of_time": missing, "kernels_without_aot_entry": sorted(other)}
    reasons = []
    if missing:
        reasons.append(f"{len(missing)} JIT compile(s) differ from every AOT build (the AOT report checks another "
                       f"binary than the one that runs)")
    if other:
        reasons.append(f"the JIT compiled {sorted(other)}, which no AOT build covers (the AOT report never checks "
                       f"them)")
    if not compiled:
        reasons.append("the JIT compiled nothing (kernels already in memory?)")
    if reasons:
        details["reason"] = "; ".join(reasons)
    return not reasons, details


# ---------------------------------------------------------------------------------------------- orchestration


def _environment() -> dict:
    import triton

    from bert_ds.kernels.jit import triton_version_problem

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "triton_supported": triton_version_problem() or "yes", "cuda_available": torch.cuda.is_available(),
           "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        env.update(device=name, capability=".".join(map(str, torch.cuda.get_device_capability())),
                   cuda=torch.version.cuda, peak_bf16_tflops=peak_tflops_for(name, "bf16") or "unknown peak")
    return env


def _child(section: str, interpret: bool, timeout: float = 900, env: dict | None = None) -> list[Item]:
    """Run ``section`` in a fresh interpreter with TRITON_INTERPRET set as it needs (and ``env``), and read its
    items back."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **(env or {}), "TRITON_INTERPRET": "1" if interpret else "0",
           "PYTHONPATH": os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "items.json"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "bert_ds.devtools.gpu_check", "--child", section,
                               "--out", str(out)],
                              env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            return [Item(f"child.{section}", FAILED, time.perf_counter() - start, {"output": proc.stdout[-4000:] +
                         proc.stderr[-4000:]}, f"child process exited {proc.returncode}")]
        return [Item(**d) for d in json.loads(out.read_text())]


def _golden_resume_item() -> Item:
    """golden_resume.base.s128 on a GPU (BERT-base, bf16, ``auto``, batch 32), golden_resume.tiny on the CPU (same
    code, the tiny preset at seq 32, batch 4); run in a child started with CUBLAS_WORKSPACE_CONFIG set."""
    from bert_ds.devtools.golden_resume import golden_resume

    if torch.cuda.is_available():
        config, name, shape = model_preset("base", vocab_size=30522), "golden_resume.base.s128", (128, 32)
    else:
        config, name, shape = model_preset("tiny", vocab_size=4000), "golden_resume.tiny", (32, 4)
        torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return _run(name, lambda: _with_rule(RULES["golden_resume.<model>"], *golden_resume(
        config, *shape, device, torch.bfloat16)))


def _with_rule(rule: str, ok: bool, details: dict) -> tuple[bool, dict]:
    return ok, {"rule": rule, **details}


def _tiny_profile() -> tuple[bool, dict]:
    """profile.tiny: the profile's code on the CPU (the tiny preset, torch twins, fp32): the device's work is the
    aten ops that would launch kernels, idle the Python and dispatch time between them."""
    config = model_preset("tiny", vocab_size=4000)
    bench = BenchStep(config, torch.device("cpu"), torch.float32, "torch")
    data = synthetic_batch(config, 8, 64, predictions_for(64), bench.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = profile_steps(lambda: bench.forward_backward(data), bench.optimizer_step, bench.device)
    finally:
        torch.set_num_threads(threads)
    ok, verdict = profile_rule(summary)
    return ok, {"rule": RULES["profile.large.s<seq>"], "rule_check": verdict, "batch": 8, "seq": 64, **summary,
                **({"reason": verdict["reason"]} if not ok else {})}


def _profile_on_gpu(bench: Callable[[], BenchStep], seq: int, batch: int) -> tuple[bool, dict]:
    """profile.large.s<seq>: BERT-large in bf16 with ``auto`` at the recipe's micro batch and the largest that fits
    (doubling up to 16x the recipe's, while a forward + backward takes under 2 s)."""
    ok, details = profile_training(bench(), seq, batch, cap=16 * batch)
    return ok, {"rule": RULES["profile.large.s<seq>"], **details}


def _mfu_check(train: Item, family: str | None, seq: int) -> tuple[bool, dict]:
    """mfu.large.s<seq>: auto's MFU from the train item of the same run against the family's floor."""
    auto = train.details.get("auto")
    if not isinstance(auto, dict):
        return False, {"rule": RULES["mfu.large.s<seq>"], "reason": f"{train.name} measured nothing: {train.reason}"}
    ok, verdict = mfu_rule(auto["mfu"], family, seq)
    return ok, {"rule": RULES["mfu.large.s<seq>"], "batch": auto["batch"], **verdict}


_CHILD_SECTIONS: dict[str, Callable[[], list[Item]]] = {
    "interpreter_kernels": lambda: check_kernels(torch.device("cpu"), small=True, prefix="interpreter.kernels")
    + check_dropout_masks(torch.device("cpu"), small=True, prefix="interpreter.dropout"),
    "interpreter_training": lambda: [_run("interpreter.train.tiny", _tiny_training_check)],
    "aot": lambda: [_run("aot.sass", _aot_sass_check)],
    "golden_resume": lambda: [_golden_resume_item()],
}
_DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE}


def gpu_checks() -> dict[str, str]:
    """Every check a GPU run makes, by name, with its pass rule (gpu_rules.RULES)."""
    checks = {f"dropout.{kind}.p{p}": RULES["dropout.<padded|varlen>.p<p>"] for kind in ("padded", "varlen")
              for p in (0.1, 0.5)}
    checks |= {f"kernels.{op}.{_dtype_name(d)}": RULES["kernels.<op>.<dtype>"] for op in _KERNEL_SHAPES
               for d in _kernel_dtypes(op, torch.device("cuda"))}
    checks["golden.base.s128"] = RULES["golden.base.s128"]
    checks |= {f"speed.{op}": RULES["speed.<op>"] for op in _KERNEL_SHAPES}
    checks |= {f"train.large.s{seq}": RULES["train.large.s<seq>"] for seq in DEFAULT_BATCH}
    checks |= {f"mfu.large.s{seq}": RULES["mfu.large.s<seq>"] for seq in DEFAULT_BATCH}
    checks |= {f"profile.large.s{seq}": RULES["profile.large.s<seq>"] for seq in DEFAULT_BATCH}
    checks["golden_resume.base.s128"] = RULES["golden_resume.<model>"]
    return checks | {"aot.matches_jit": RULES["aot.matches_jit"]}


def run_gpu_check(steps: int = 10, batch: dict[int, int] | None = None,
                  report: Callable[[Item], None] = lambda item: None) -> tuple[dict, list[Item]]:
    """Every item this machine can run (GPU or dry mode); ``report`` is called as each item finishes."""
    batch = {**DEFAULT_BATCH, **(batch or {})}
    env = _environment()
    items: list[Item] = []

    def add(new: list[Item]) -> None:
        for item in new:
            items.append(item)
            report(item)

    if not torch.cuda.is_available():
        add(_child("interpreter_kernels", interpret=True))
        add(_child("interpreter_training", interpret=True))
        add(_child("aot", interpret=False))
        add(_child("golden_resume", interpret=False, env=_DETERMINISTIC_ENV))
        add([_run("profile.tiny", _tiny_profile)])
        add([Item(name, SKIPPED, details={"rule": rule}, reason=NO_GPU) for name, rule in gpu_checks().items()])
        return env, items

    from bert_ds.kernels.jit import interpreter_enabled

    if interpreter_enabled():
        raise RuntimeError("TRITON_INTERPRET=1 is set: the kernels would run in the CPU interpreter, not on the GPU; "
                           "unset it and run again")
    from triton.runtime import driver

    device = torch.device("cuda")
    config, peak = model_preset("large"), env["peak_bf16_tflops"]
    peak = peak if isinstance(peak, float) else None
    # Training first: the JIT then compiles exactly the BERT-large launches, which aot.matches_jit compares (a kernel
    # already compiled by an earlier check would come from the in-memory cache, unseen by the hook).
    family = gpu_family(env["device"])
    with record_jit_compiles() as compiled:
        add([_run("golden.base.s128", lambda: _golden_on_gpu(device))])
        for seq in DEFAULT_BATCH:
            train = _run(f"train.large.s{seq}", lambda seq=seq: _train_on_gpu(config, seq, batch[seq], device, steps,
                                                                              peak))
            add([train, _run(f"mfu.large.s{seq}", lambda seq=seq, train=train: _mfu_check(train, family, seq))])
    add([_run("aot.matches_jit", lambda: jit_matches_aot(compiled, driver.active.get_current_target()))])
    bench = functools.cache(lambda: BenchStep(config, device, torch.bfloat16, "auto"))  # one model for both shapes
    for seq in DEFAULT_BATCH:
        add([_run(f"profile.large.s{seq}", lambda seq=seq: _profile_on_gpu(bench, seq, batch[seq]))])
    bench.cache_clear()
    gc.collect()
    torch.cuda.empty_cache()
    add(_child("golden_resume", interpret=False, env=_DETERMINISTIC_ENV))
    add(check_dropout_masks(device))
    add(check_kernels(device))
    add(measure_kernel_speed(device))
    add([_run("aot.sass", _aot_sass_check)])
    return env, items


def _print_item(item: Item) -> None:
    line = f"{item.status.upper():7} {item.name:42} {item.seconds:6.1f} s"
    if item.reason:
        line += f"  {item.reason}"
    elif item.name.startswith("train.") and item.status == PASSED:
        line += "  " + ", ".join(f"{k}: {v['seq_per_s']} seq/s, {v['tflops']} TFLOP/s, MFU {v['mfu']}"
                                 for k, v in item.details.items() if isinstance(v, dict) and "seq_per_s" in v)
    elif item.name.startswith("mfu.") and item.status == PASSED:
        line += f"  MFU {item.details['mfu']} (floor {item.details['floor']}, {item.details['floor_is']})"
    elif item.name.startswith("speed.") and item.status == PASSED:
        line += "  speedup fwd+bwd " + ", ".join(f"{k}: {v['speedup_fwd_bwd']}x" for k, v in item.details.items())
    print(line, flush=True)
    for key in ("recipe_batch", "largest_batch"):
        if isinstance(item.details.get(key), dict) and "ms" in item.details[key]:
            print(format_profile(f"    {key} {item.details[key]['batch']}", item.details[key]), flush=True)
    if item.name == "profile.tiny" and "ms" in item.details:
        print(format_profile("    tiny, batch 8 x 64", item.details), flush=True)


@dataclasses.dataclass(frozen=True)
class GpuCheckArgs:
    """``bert-ds-gpu-check``: where the report goes and how long the training items run."""

    out: Path = Path("gpu_check.json")
    """JSON report"""
    steps: int = 10
    """timed training steps per run"""
    batch_128: int = option(DEFAULT_BATCH[128], help=f"micro-batch at seq 128 (default: {DEFAULT_BATCH[128]}; halved "
                            "on out-of-memory)")
    batch_512: int = option(DEFAULT_BATCH[512], help=f"micro-batch at seq 512 (default: {DEFAULT_BATCH[512]}; halved "
                            "on out-of-memory)")
    child: str | None = option(None, choices=sorted(_CHILD_SECTIONS), hidden=True)
    """internal: run one section in this process and write its items to --out"""


def cli_parser() -> argparse.ArgumentParser:
    return build_parser(GpuCheckArgs, "bert-ds-gpu-check", __doc__.split("\n\n")[0])


main = alias("gpu-check")


def _check(args: GpuCheckArgs) -> int:
    if args.child:
        args.out.write_text(json.dumps([dataclasses.asdict(i) for i in _CHILD_SECTIONS[args.child]()]))
        return 0

    start = time.perf_counter()
    print(f"bert_ds gpu_check: {'CUDA device ' + torch.cuda.get_device_name() if torch.cuda.is_available() else NO_GPU}"
          f" -> {args.out}", flush=True)
    env, items = run_gpu_check(args.steps, {seq: getattr(args, f"batch_{seq}") for seq in DEFAULT_BATCH},
                               _print_item)
    failed = [i.name for i in items if i.status == FAILED]
    skipped = [{"name": i.name, "reason": i.reason} for i in items if i.status == SKIPPED]
    doc = {"mode": "gpu" if torch.cuda.is_available() else "dry (no GPU)", "environment": env,
           "seconds": round(time.perf_counter() - start, 1), "passed": [i.name for i in items if i.status == PASSED],
           "failed": failed, "skipped": skipped, "items": [dataclasses.asdict(i) for i in items]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"{len(doc['passed'])} passed, {len(failed)} failed, {len(skipped)} skipped in {doc['seconds']} s"
          + (f"; skipped because: {NO_GPU}" if skipped and not torch.cuda.is_available() else "")
          + f"; report: {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
