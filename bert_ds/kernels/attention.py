"""Scaled dot-product attention with a key-padding mask, FlashAttention-style in Triton.

Twins: :func:`attention_torch` (``F.scaled_dot_product_attention`` with a boolean ``attn_mask``
built from the key-padding mask; the reference and CPU path) and :func:`attention_triton`.

The Triton forward streams key/value blocks through an online softmax (Dao et al. 2022,
FlashAttention; FlashAttention-2's loop order) and stores the per-row log-sum-exp. The backward
recomputes probabilities from it: one kernel accumulates dK/dV per key block, another dQ per query
block, so no atomics are needed. ``delta = rowsum(dO * O)`` is one torch reduction.

Masking: ``key_padding_mask`` is (B, S) bool, True = real token. Keys that are padding get zero
weight. A query row with no real key at all (an all-padding sequence) outputs zeros instead of NaN;
padded query rows otherwise attend normally and are finite.

Dropout (``DROPOUT`` constexpr, FlashAttention-2's placement): the log-sum-exp and the softmax
statistics are those of the undropped probabilities P; the kernels multiply P by a Philox keep-mask
Z and 1/(1-p) before P V, and the backward regenerates Z from the call's seed (:mod:`.dropout`):
dV = (P*Z/(1-p))^T dO, dS = P * (Z/(1-p) * dO V^T - delta). ``delta = rowsum(dO * O)`` still equals
rowsum(P * dP) because O holds the dropped probabilities. :func:`attention_torch` given
``dropout_mask`` (from :func:`.dropout.dropout_keep_mask`) computes the same function in torch.

Scale is 1/sqrt(head_dim); inside the kernels it is folded with log2(e) so the softmax uses exp2.
fp32 inputs use IEEE fp32 matmuls (no TF32) so the kernel matches the fp32 twin; bf16/fp16 inputs
use tensor-core matmuls with fp32 accumulation and an fp32 softmax.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bert_ds.errors import BadInput

from .dropout import check_dropout_p, dropout_keep, dropout_seed_tensor
from .jit import interpreter_enabled, late_jit

__all__ = ["ATTENTION_CONFIGS", "SUPPORTED_HEAD_DIMS", "attention_torch", "attention_triton"]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)

# Block sizes shipped for head_dim 64 (BERT-base and -large); tools/kernel_report.py compiles exactly
# these. A forward with BLOCK_M=128, BLOCK_N=64, 4 warps spilled registers on sm_80/90 (STACK > 0 in the report
# `python tools/kernel_report.py` prints from cuobjdump --dump-resource-usage; tests/kernels/test_kernel_report.py).
# With dropout the dK/dV kernel also holds the Philox state of a BLOCK_M x BLOCK_N tile: at 32 x 64 it spilled on sm_80
# (255 registers, STACK 8); at 32 x 32 it takes about 120 on sm_80 and sm_90 (tests/kernels/test_sass.py).
ATTENTION_CONFIGS = {
    "fwd": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
    "bwd_dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4},
    "bwd_dkdv_dropout": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4},
    "bwd_dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4},
}

_LOG2E = 1.4426950408889634


def _sdpa_mask(key_padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    # (B, S) True = attend  ->  (B, 1, 1, S) boolean attn_mask, broadcast over heads and queries.
    return None if key_padding_mask is None else key_padding_mask[:, None, None, :].to(torch.bool)


def attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0, dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: SDPA on (B, nh, S, hd) with a boolean key-padding mask (True = real token).

    ``dropout_mask`` (B, nh, S, S) bool, True = kept: drop exactly these probabilities (scaled by 1/(1-p)) instead of
    SDPA's own draw, written out in torch; a sequence without a real key then outputs zeros, as the kernel does."""
    if dropout_mask is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_sdpa_mask(key_padding_mask), dropout_p=dropout_p)
    if dropout_mask.shape != (*q.shape[:3], k.shape[2]):
        raise ValueError(f"dropout_mask must be (B, nh, S, S) = {(*q.shape[:3], k.shape[2])}, "
                         f"got {tuple(dropout_mask.shape)}")
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # (B, nh, S, S)
    if key_padding_mask is not None:
        real = key_padding_mask[:, None, None, :].to(torch.bool)
        # A finite fill, not -inf: a row without a real key must not make NaN (its weights are zeroed below).
        scores = scores.masked_fill(~real, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1) * real.any(-1, keepdim=True)
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs * dropout_mask / (1.0 - dropout_p)) @ v


# The seed halves change every call: not specialised (an argument divisible by 16 or equal to 1 would recompile).
@late_jit(do_not_specialize=["seed_lo", "seed_hi"])
def _attn_fwd_kernel(
    Q, K, V, Mask, Out, LSE,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    H, S, qk_scale, seed_lo, seed_hi, dropout_p,
    HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < S
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, S, BLOCK_N):
        cols = start_n + offs_n
        key_ok = cols < S
        if HAS_MASK:
            key_ok = key_ok & (tl.load(Mask + b * S + cols, mask=cols < S, other=0) != 0)
        kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None],
                     mask=(cols < S)[None, :], other=0.0).to(DOT_DTYPE)  # K^T block (HEAD_DIM, BLOCK_N)
        qk = tl.dot(q, kt, input_precision=INPUT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 domain
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        # A row that has seen only padding keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)  # statistics of the undropped P
        if DROPOUT:
            p = tl.where(dropout_keep(seed_lo, seed_hi, dropout_p, b, h, offs_m, cols), p, 0.0)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :],
                    mask=(cols < S)[:, None], other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(Q.dtype.element_ty).to(DOT_DTYPE), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    empty = l_i == 0.0
    denom = tl.where(empty, 1.0, l_i)
    if DROPOUT:
        denom = denom * (1.0 - dropout_p)
    acc = acc / denom[:, None]
    tl.store(Out + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    lse = m_i + tl.math.log2(tl.where(empty, 1.0, l_i))  # log2-domain log-sum-exp of the scaled scores
    tl.store(LSE + bh.to(tl.int64) * S + offs_m, tl.where(empty, 0.0, lse), mask=row_ok)


@late_jit(do_not_specialize=["seed_lo", "seed_hi"])
def _attn_bwd_dkdv_kernel(
    Q, K, V, Mask, DO, LSE, Delta, DK, DV,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos, stride_gb, stride_gh, stride_gs,
    H, S, qk_scale, sm_scale, seed_lo, seed_hi, dropout_p,
    HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dV = P^T dO;  dS = P * (dO V^T - delta);  dK = scale * dS^T Q.  DK and DV share strides stride_g*.
    # With dropout, P in dV and dO V^T are masked by Z and scaled by 1/(1-p); dS keeps the undropped P (module doc).
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = cols < S
    key_ok = col_ok
    if HAS_MASK:
        key_ok = key_ok & (tl.load(Mask + b * S + cols, mask=col_ok, other=0) != 0)
    k = tl.load(K + b * stride_kb + h * stride_kh + cols[:, None] * stride_ks + offs_d[None, :],
                mask=col_ok[:, None], other=0.0).to(DOT_DTYPE)
    v = tl.load(V + b * stride_vb + h * stride_vh + cols[:, None] * stride_vs + offs_d[None, :],
                mask=col_ok[:, None], other=0.0).to(DOT_DTYPE)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    row_stats = bh.to(tl.int64) * S
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    rp = 1.0 / (1.0 - dropout_p)  # dropout's scale (1 without dropout)
    for start_m in range(0, S, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < S
        q = tl.load(q_base + rows[:, None] * stride_qs + offs_d[None, :], mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
        do = tl.load(do_base + rows[:, None] * stride_dos + offs_d[None, :],
                     mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
        lse = tl.load(LSE + row_stats + rows, mask=row_ok, other=0.0)
        delta = tl.load(Delta + row_stats + rows, mask=row_ok, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        p = tl.math.exp2(qk - lse[:, None])
        p = tl.where(row_ok[:, None] & key_ok[None, :], p, 0.0)
        if DROPOUT:
            # dO V^T first: this order compiled without spills (the other spilled on sm_90, tests/kernels/test_sass.py)
            dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
            keep = dropout_keep(seed_lo, seed_hi, dropout_p, b, h, rows, cols)
            dv += tl.dot(tl.trans(tl.where(keep, p, 0.0).to(Q.dtype.element_ty).to(DOT_DTYPE)), do,
                         input_precision=INPUT_PRECISION)
            dp = tl.where(keep, dp * rp, 0.0)
        else:
            dv += tl.dot(tl.trans(p.to(Q.dtype.element_ty).to(DOT_DTYPE)), do, input_precision=INPUT_PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(Q.dtype.element_ty).to(DOT_DTYPE)), q, input_precision=INPUT_PRECISION)
    if DROPOUT:
        dv = dv * rp
    out = b * stride_gb + h * stride_gh + cols[:, None] * stride_gs + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@late_jit(do_not_specialize=["seed_lo", "seed_hi"])
def _attn_bwd_dq_kernel(
    Q, K, V, Mask, DO, LSE, Delta, DQ,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_dob, stride_doh, stride_dos, stride_gb, stride_gh, stride_gs,
    H, S, qk_scale, sm_scale, seed_lo, seed_hi, dropout_p,
    HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dQ = scale * dS K, with dS recomputed per key block.  DQ has strides stride_g*.
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < S
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dos + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    row_stats = bh.to(tl.int64) * S
    lse = tl.load(LSE + row_stats + rows, mask=row_ok, other=0.0)
    delta = tl.load(Delta + row_stats + rows, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    rp = 1.0 / (1.0 - dropout_p)  # dropout's scale (1 without dropout)
    for start_n in range(0, S, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < S
        key_ok = col_ok
        if HAS_MASK:
            key_ok = key_ok & (tl.load(Mask + b * S + cols, mask=col_ok, other=0) != 0)
        k = tl.load(k_base + cols[:, None] * stride_ks + offs_d[None, :], mask=col_ok[:, None], other=0.0).to(DOT_DTYPE)
        v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=col_ok[:, None], other=0.0).to(DOT_DTYPE)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        p = tl.math.exp2(qk - lse[:, None])
        p = tl.where(row_ok[:, None] & key_ok[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        if DROPOUT:
            dp = tl.where(dropout_keep(seed_lo, seed_hi, dropout_p, b, h, rows, cols), dp * rp, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(Q.dtype.element_ty).to(DOT_DTYPE), k, input_precision=INPUT_PRECISION)
    tl.store(DQ + b * stride_gb + h * stride_gh + rows[:, None] * stride_gs + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_args(dtype: torch.dtype) -> dict:
    """Constexprs for the matmuls: IEEE fp32 for fp32 inputs (no TF32), tensor cores otherwise.

    Under the interpreter, bf16 operands are widened to fp32 before ``tl.dot``: triton 3.9's
    interpreter multiplies bf16 blocks as their raw uint16 bits (``np.matmul`` on the storage), and
    widening is exact (a bf16 x bf16 product fits in fp32), so it reproduces the GPU arithmetic.
    """
    dot_dtype = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
    if dtype == torch.bfloat16 and interpreter_enabled():
        dot_dtype = tl.float32
    return {"INPUT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "DOT_DTYPE": dot_dtype}


# A custom op, not an autograd.Function, so that torch.compile holds it without a graph break; the Philox key is an
# input drawn by the caller (as in .attention_varlen, which says why).
@torch.library.custom_op("bert_ds::attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float,
                   seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE): O (B, nh, S, hd), LSE (B * nh, S) fp32 in the log2 domain. ``mask`` (B, S) int8 or None."""
    batch, heads, seq, head_dim = q.shape
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    o = torch.empty((batch, heads, seq, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch * heads, seq), dtype=torch.float32, device=q.device)
    sm_scale = 1.0 / math.sqrt(head_dim)
    has_mask = mask is not None
    mask_arg = mask if has_mask else q  # never read when HAS_MASK is False
    cfg = ATTENTION_CONFIGS["fwd"]
    grid = (triton.cdiv(seq, cfg["BLOCK_M"]), batch * heads)
    _attn_fwd_kernel[grid](
        q, k, v, mask_arg, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        heads, seq, sm_scale * _LOG2E, *seed.tolist(), dropout_p,
        HAS_MASK=has_mask, DROPOUT=dropout_p > 0.0, HEAD_DIM=head_dim, **_dot_args(q.dtype), **cfg,
    )
    return o, lse


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, mask, dropout_p, seed):
    batch, heads, seq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch * heads, seq), dtype=torch.float32)


@torch.library.custom_op("bert_ds::attention_bwd", mutates_args=())
def _attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   o: torch.Tensor, lse: torch.Tensor, dropout_p: float,
                   seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV), regenerating the forward's dropout mask from ``seed``."""
    batch, heads, seq, head_dim = q.shape
    q, k, v, do = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(do)
    sm_scale = 1.0 / math.sqrt(head_dim)
    delta = (do.float() * o.float()).sum(-1).reshape(batch * heads, seq)  # rowsum(dO * O)
    dq = torch.empty((batch, heads, seq, head_dim), dtype=q.dtype, device=q.device)
    dk = torch.empty_like(dq)
    dv = torch.empty_like(dq)
    mask_arg = mask if mask is not None else q
    common = dict(HAS_MASK=mask is not None, DROPOUT=dropout_p > 0.0, HEAD_DIM=head_dim, **_dot_args(q.dtype))
    args = (q, k, v, mask_arg, do, lse, delta)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq))
    scales = (heads, seq, sm_scale * _LOG2E, sm_scale, *seed.tolist(), dropout_p)
    cfg = ATTENTION_CONFIGS["bwd_dkdv_dropout" if dropout_p > 0.0 else "bwd_dkdv"]
    _attn_bwd_dkdv_kernel[(triton.cdiv(seq, cfg["BLOCK_N"]), batch * heads)](
        *args, dk, dv, *strides, *scales, **common, **cfg,
    )
    cfg = ATTENTION_CONFIGS["bwd_dq"]
    _attn_bwd_dq_kernel[(triton.cdiv(seq, cfg["BLOCK_M"]), batch * heads)](
        *args, dq, *strides, *scales, **common, **cfg,
    )
    return dq, dk, dv


@_attention_bwd.register_fake
def _attention_bwd_fake(do, q, k, v, mask, o, lse, dropout_p, seed):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


def _attention_setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, mask, *output, seed)
    ctx.dropout_p = dropout_p


def _attention_backward(ctx, do, _dlse):
    q, k, v, mask, o, lse, seed = ctx.saved_tensors
    dq, dk, dv = _attention_bwd(do, q, k, v, mask, o, lse, ctx.dropout_p, seed)
    return dq, dk, dv, None, None, None


_attention_fwd.register_autograd(_attention_backward, setup_context=_attention_setup_context)


def attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """Triton FlashAttention on (B, nh, S, hd); differentiable in q, k, v. ``dropout_p > 0`` draws the call's Philox
    seed from torch's default CPU generator (:mod:`.dropout`)."""
    dropout_p = check_dropout_p(dropout_p, "attention backend 'triton'")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"attention: q, k, v must share one (B, nh, S, hd) shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise BadInput(f"attention backend 'triton' needs q, k, v of one dtype among fp32/fp16/bf16, got "
                       f"{q.dtype}, {k.dtype}, {v.dtype}")
    batch, _, seq, head_dim = q.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise BadInput(f"attention backend 'triton' supports head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    mask = None
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, seq):
            raise ValueError(f"key_padding_mask must be (B, S) = {(batch, seq)}, got {tuple(key_padding_mask.shape)}")
        mask = key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
    return _attention_fwd(q, k, v, mask, dropout_p, dropout_seed_tensor(dropout_p))[0]
