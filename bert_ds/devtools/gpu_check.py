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

Without a GPU the same command runs what it can and exits 0 when that passes: the kernels against their twins under
the Triton CPU interpreter at small shapes, a tiny-model training step through the same step code with the Triton
kernels (interpreted) and the torch twins (their losses must agree and fall), and the AOT machine-code checks; every
GPU item is listed as skipped with its reason. Items needing triton's interpreter or compiler run in a child process
with ``TRITON_INTERPRET`` set for them (triton fixes the mode at import). Results go to a JSON report.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from bert_ds.config import BertConfig, model_preset
from bert_ds.errors import run_main
from bert_ds.runtime.metrics import peak_tflops_for, training_flops_per_sequence

__all__ = ["Item", "check_kernels", "jit_matches_aot", "main", "measure_kernel_speed", "measure_training",
           "record_jit_compiles", "run_gpu_check"]

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"
# Per-GPU micro-batches of the two pre-training phases (NVIDIA's BERT-large recipe on 80 GB A100s); halved on OOM.
DEFAULT_BATCH = {128: 64, 512: 16}
PREDICTIONS = {128: 20, 512: 80}  # max_predictions_per_seq (Google/NVIDIA)


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

# The reference is the twin in fp32 on the same (upcast) inputs. fp32 must match it elementwise as tests/kernels
# require. bf16 is judged by a rule in units of bf16's machine epsilon (2^-7), per tensor, so it depends neither on
# which elements happen to be extremes nor on the machine: normwise error ||got - ref|| / ||ref|| and the largest
# element's error over max |ref|. The kernel's error is its output rounding plus the bf16 rounding of P and dS before
# the matmuls (as in FlashAttention), each a fraction of eps of the tensor's scale: measured at most 0.9 eps normwise
# and 1.35 eps at the largest element on every bf16 case of tests/kernels; a wrong softmax scale or mask lands at
# 65-127 eps. The same rule as tests/helpers/kernels.py.
TOLERANCE = {torch.float32: (1e-4, 1e-4)}
BF16_NORM_EPS, BF16_PEAK_EPS = 10.0, 16.0

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


def _max_error(got: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    got, ref = got.float(), ref.float()
    if rows is not None and got.shape == rows.shape:
        got, ref = got[rows], ref[rows]
    return (got - ref).abs(), ref


def check_kernels(device: torch.device, small: bool = False, ops: tuple[str, ...] = tuple(_KERNEL_SHAPES),
                  prefix: str = "kernels") -> list[Item]:
    """Each op's Triton kernels against the torch twin, forward and backward, fp32 and bf16: one item per op and
    dtype, with the largest absolute error of the output and of each gradient (and, in bf16, the twin's own)."""
    items = []
    for op in ops:
        make, full, tiny = _KERNEL_SHAPES[op]
        for dtype in (torch.float32, torch.bfloat16):
            def check(make=make, dtype=dtype, shapes=tiny if small else full):
                gen = torch.Generator().manual_seed(0)
                fp32 = dtype == torch.float32
                ok, details = True, {"device": str(device), "tolerance": (
                    {"atol, rtol": list(TOLERANCE[dtype])} if fp32 else
                    {"normwise eps": BF16_NORM_EPS, "largest element eps": BF16_PEAK_EPS})}
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
                        got = flat["triton"][i]
                        err, ref = _max_error(got, flat["reference"][i], rows)
                        if fp32:
                            atol, rtol = TOLERANCE[dtype]
                            good = bool((err <= atol + rtol * ref.abs()).all())
                        else:
                            eps = torch.finfo(dtype).eps
                            norm = float(err.double().norm() / ref.double().norm().clamp_min(1e-300)) / eps
                            peak = float(err.max().double() / ref.double().abs().max().clamp_min(1e-300)) / eps
                            row["error_in_eps"][name] = [round(norm, 3), round(peak, 3)]
                            good = norm <= BF16_NORM_EPS and peak <= BF16_PEAK_EPS
                            row["twin_max_abs_error"][name] = float(
                                _max_error(flat["twin"][i], flat["reference"][i], rows)[0].max())
                        row["max_abs_error"][name] = float(err.max())
                        ok = ok and good and got.dtype == dtype and bool(torch.isfinite(got).all())
                    for key in ("twin_max_abs_error", "error_in_eps"):
                        if not row[key]:
                            del row[key]
                    details[case.label] = row
                return ok, details

            items.append(_run(f"{prefix}.{op}.{_dtype_name(dtype)}", check))
    return items


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


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
        def bench(cases=cases):
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
            return details

        items.append(_run(f"speed.{op}", bench))
    return items


# ---------------------------------------------------------------------------------------------- training step


def synthetic_batch(config: BertConfig, batch: int, seq: int, predictions: int, device: torch.device,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """A pre-training batch of full-length sequences: random tokens, ``predictions`` masked positions each, NSP
    labels. Every position is a real token, so the analytic FLOP count is exactly the work done."""
    gen = torch.Generator().manual_seed(seed)
    low = min(1000, config.vocab_size // 2)  # above the special tokens of a BERT vocabulary
    positions = torch.stack([torch.randperm(seq - 2, generator=gen)[:predictions] + 1 for _ in range(batch)])
    batch_tensors = dict(
        input_ids=torch.randint(low, config.vocab_size, (batch, seq), generator=gen),
        token_type_ids=(torch.arange(seq) >= seq // 2).long().repeat(batch, 1),
        attention_mask=torch.ones(batch, seq, dtype=torch.long),
        masked_lm_positions=positions.sort(dim=1).values,
        masked_lm_ids=torch.randint(low, config.vocab_size, (batch, predictions), generator=gen),
        next_sentence_label=torch.randint(0, 2, (batch,), generator=gen),
    )
    return {k: v.to(device) for k, v in batch_tensors.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _master_step(named: list, masters: list, optimizer) -> None:
    """The optimizer step on fp32 master weights: gradients into the masters (bf16 models), step, weights back."""
    for (_, p), m in zip(named, masters, strict=True):
        if m is not p:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for (_, p), m in zip(named, masters, strict=True):
        if m is not p:
            p.copy_(m)


def measure_training(config: BertConfig, seq: int, batch: int, device: torch.device, dtype: torch.dtype,
                     kernel_backend: str, steps: int = 10, warmup: int = 3, lr: float = 1e-3,
                     peak_tflops: float | None = None) -> dict:
    """Time ``warmup + steps`` training steps on one repeated synthetic batch.

    A step: forward + backward of :class:`~bert_ds.model.BertForPreTraining` in ``dtype``, then (for bf16) the
    gradients into fp32 master weights, a LAMB step (:class:`~bert_ds.optim.lamb.ZeroAwareLamb`, weight decay 0.01
    except biases and LayerNorm) and the weights back, as the engine's DeepSpeed bf16 mode does on one rank.
    Sequences/s is reported for forward+backward alone (a micro-batch under gradient accumulation, how BERT is
    pre-trained: the optimizer runs once per 100+ micro-batches) and for whole steps."""
    from bert_ds.model import BertForPreTraining
    from bert_ds.optim.factory import no_decay
    from bert_ds.optim.lamb import ZeroAwareLamb

    torch.manual_seed(0)
    model = BertForPreTraining(config, kernels=kernel_backend).to(device=device, dtype=dtype).train()
    named = list(model.named_parameters())
    masters = [p for _, p in named] if dtype == torch.float32 else [p.detach().float().clone() for _, p in named]
    groups = [{"params": [m for (n, p), m in zip(named, masters, strict=True) if not no_decay(n, p)],
               "weight_decay": 0.01},
              {"params": [m for (n, p), m in zip(named, masters, strict=True) if no_decay(n, p)], "weight_decay": 0.0}]
    optimizer = ZeroAwareLamb([g for g in groups if g["params"]], lr=lr, eps=1e-6)
    data = synthetic_batch(config, batch, seq, PREDICTIONS.get(seq, max(1, seq // 7)), device)

    losses, fwd_bwd, opt = [], [], []
    for step in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = model(**data).loss
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        _master_step(named, masters, optimizer)
        _sync(device)
        t2 = time.perf_counter()
        losses.append(loss.detach())
        if step >= warmup:
            fwd_bwd.append(t1 - t0)
            opt.append(t2 - t1)
    losses = [float(x) for x in losses]
    t_fb, t_opt = statistics.median(fwd_bwd), statistics.median(opt)
    flops = training_flops_per_sequence(config, seq, PREDICTIONS.get(seq, max(1, seq // 7)))
    seq_per_s = batch / t_fb
    tflops = flops * seq_per_s / 1e12
    result = {
        "kernels": kernel_backend, "dtype": _dtype_name(dtype), "batch": batch, "seq": seq, "steps": steps,
        "fwd_bwd_ms": round(1e3 * t_fb, 3), "optimizer_ms": round(1e3 * t_opt, 3),
        "seq_per_s": round(seq_per_s, 2), "seq_per_s_with_optimizer_each_step": round(batch / (t_fb + t_opt), 2),
        "model_tflop_per_seq": round(flops / 1e12, 6), "tflops": round(tflops, 2),
        "mfu": round(tflops / peak_tflops, 4) if peak_tflops else "unknown peak",
        "losses": [round(x, 5) for x in losses],
    }
    if device.type == "cuda":
        result["max_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del model, optimizer, masters
    return result


def _train_on_gpu(config: BertConfig, seq: int, batch: int, device: torch.device, steps: int,
                  peak: float | None) -> tuple[bool, dict]:
    """BERT at ``seq`` with each kernel backend: ``auto`` with the recipe's attention dropout (every Triton kernel,
    the attention with its in-kernel dropout), and ``triton`` / ``torch`` with attention dropout 0 so that every
    fused kernel runs against its twin on equal terms."""
    no_attn_dropout = dataclasses.replace(config, attention_probs_dropout_prob=0.0)
    runs = {}
    for backend, cfg in (("auto", config), ("triton", no_attn_dropout), ("torch", no_attn_dropout)):
        b = batch
        while True:
            try:
                torch.cuda.reset_peak_memory_stats(device)
                runs[backend] = measure_training(cfg, seq, b, device, torch.bfloat16, backend, steps=steps,
                                                 peak_tflops=peak)
                break
            except torch.cuda.OutOfMemoryError:
                if b == 1:
                    raise
                b //= 2  # keep going at half the batch; the report says which batch ran
            finally:
                gc.collect()
                torch.cuda.empty_cache()
    ok = all(math.isfinite(x) for r in runs.values() for x in r["losses"])
    return ok, {"peak_bf16_tflops": peak if peak else "unknown peak", **runs}


def _tiny_training_check() -> tuple[bool, dict]:
    """The training-step code on the CPU with the tiny preset: Triton kernels (interpreted) and torch twins from
    the same weights and batch, dropout off. Their losses must agree and the loss must fall over the steps."""
    # A 4,000-token vocabulary (as the tests' tokenizer): the step path is the point, not the embedding size.
    base = model_preset("tiny", vocab_size=4000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a thread pool only adds overhead (9 ms vs 770 ms a step, busy 2 cores)
    try:
        runs = {b: measure_training(base, 32, 4, torch.device("cpu"), torch.float32, b, steps=3, warmup=1, lr=1e-2)
                for b in ("triton", "torch")}
    finally:
        torch.set_num_threads(threads)
    tri, ref = runs["triton"]["losses"], runs["torch"]["losses"]
    agree = all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(tri, ref, strict=True))
    falls = tri[-1] < tri[0]
    details = {"losses_agree (rtol 1e-3)": agree, "loss_falls": falls, **runs}
    if not (agree and falls):
        details["reason"] = "Triton and torch losses differ" if not agree else "loss did not fall"
    return agree and falls, details


# ---------------------------------------------------------------------------------------------- AOT and the JIT


def _aot_sass_check() -> tuple[bool, dict]:
    from bert_ds.kernels import aot

    rows = aot.report()
    details = {f"{r.kernel} [{r.config}] sm_{r.arch}": {
        "reg": r.reg, "stack": r.stack, "local": r.local, "loads_by_bits": r.loads, "stores_by_bits": r.stores,
        "tensor_core_ops": r.tensor_core_ops, "shapes": list(r.shapes), "problems": list(r.problems)} for r in rows}
    problems = [f"{k}: {p}" for k, v in details.items() for p in v["problems"]]
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
    """Every JIT compile of a kernel that has an AOT entry must be one of the AOT builds for ``target``."""
    from bert_ds.kernels import aot

    builds = aot.kernel_builds([target])
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
    if missing:
        details["reason"] = f"{len(missing)} JIT compile(s) differ from every AOT build (the AOT report checks " \
                            "another binary than the one that runs)"
    elif not compiled:
        details["reason"] = "the JIT compiled nothing (kernels already in memory?)"
    return bool(compiled) and not missing, details


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


def _child(section: str, interpret: bool, timeout: float = 900) -> list[Item]:
    """Run ``section`` in a fresh interpreter with TRITON_INTERPRET set as it needs, and read its items back."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0",
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


_CHILD_SECTIONS: dict[str, Callable[[], list[Item]]] = {
    "interpreter_kernels": lambda: check_kernels(torch.device("cpu"), small=True, prefix="interpreter.kernels"),
    "interpreter_training": lambda: [_run("interpreter.train.tiny", _tiny_training_check)],
    "aot": lambda: [_run("aot.sass", _aot_sass_check)],
}


def _gpu_item_names() -> list[str]:
    names = [f"kernels.{op}.{d}" for op in _KERNEL_SHAPES for d in ("fp32", "bf16")]
    names += [f"speed.{op}" for op in _KERNEL_SHAPES]
    return names + [f"train.large.s{seq}" for seq in DEFAULT_BATCH] + ["aot.matches_jit"]


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
        add([Item(name, SKIPPED, reason=NO_GPU) for name in _gpu_item_names()])
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
    with record_jit_compiles() as compiled:
        for seq in DEFAULT_BATCH:
            add([_run(f"train.large.s{seq}", lambda seq=seq: _train_on_gpu(config, seq, batch[seq], device, steps,
                                                                          peak))])
    add([_run("aot.matches_jit", lambda: jit_matches_aot(compiled, driver.active.get_current_target()))])
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
                                 for k, v in item.details.items() if isinstance(v, dict))
    elif item.name.startswith("speed.") and item.status == PASSED:
        line += "  speedup fwd+bwd " + ", ".join(f"{k}: {v['speedup_fwd_bwd']}x" for k, v in item.details.items())
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bert-ds-gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="JSON report (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per run (default: %(default)s)")
    for seq, b in DEFAULT_BATCH.items():
        parser.add_argument(f"--batch-{seq}", type=int, default=b, dest=f"batch_{seq}",
                            help=f"micro-batch at seq {seq} (default: %(default)s; halved on out-of-memory)")
    parser.add_argument("--child", choices=sorted(_CHILD_SECTIONS), help=argparse.SUPPRESS)  # internal
    return run_main(parser.prog, _check, parser.parse_args(argv))


def _check(args: argparse.Namespace) -> int:
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
