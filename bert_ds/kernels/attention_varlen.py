"""Variable-length attention on unpadded tokens: no work on padding, in Triton and its torch twin.

Layout (as FlashAttention-2's ``flash_attn_varlen_func``): the real tokens of a batch are packed one sequence after
another, ``q``, ``k``, ``v`` are (T, nh, hd) with T the number of real tokens, and ``cu_seqlens`` (B + 1,) int32
holds the cumulative sequence lengths, so sequence ``b`` owns rows ``cu_seqlens[b]:cu_seqlens[b + 1]``. Every token
attends to all tokens of its own sequence (BERT is bidirectional), none of another's. ``max_seqlen`` (a Python int)
sizes the launch grid and the twin's padding; it must be at least the longest sequence.

Twins: :func:`varlen_attention_torch`, on CPU tensors with the lengths known on the host SDPA per sequence (work
sum_b L_b^2, no padding at all), otherwise SDPA on a (B, max_seqlen) padded layout with the key-padding mask (one
launch on a GPU, where B small launches per layer would cost more than the padding; attention dropout supported
either way), and
:func:`varlen_attention_triton`, FlashAttention-style kernels that read the packed layout directly: a program owns
one query block of one head of one sequence and stops at that sequence's length, so the work is
sum_b ceil(L_b / BLOCK)^2 blocks instead of B * ceil(S / BLOCK)^2. The arithmetic per block is the padded kernels'
(:mod:`.attention`): online softmax in the exp2 domain, log-sum-exp saved for a backward that recomputes P, dK/dV per
key block and dQ per query block without atomics. Attention dropout as the padded kernels: the Philox keep-mask of
:mod:`.dropout` at (sequence, head, query, key) counted within the sequence, so a sequence gets the same mask here as
in the padded kernels for the same seed, and the backward regenerates it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bert_ds.errors import BadInput

from .attention import SUPPORTED_HEAD_DIMS, _dot_args, attention_torch
from .dropout import check_dropout_p, dropout_keep, dropout_seed_tensor
from .jit import late_jit

__all__ = ["VARLEN_ATTENTION_CONFIGS", "varlen_attention_torch", "varlen_attention_triton", "varlen_block_config"]

_LOG2E = 1.4426950408889634

VARLEN_ATTENTION_CONFIGS = {
    # Per longest-sequence bucket: short sequences waste less of a 32-row block on their ragged tail. The choice
    # depends only on the batch's max_seqlen (never on timing), so a run is reproducible; block sizes change only
    # the order of fp32 accumulation inside the online softmax. tools/kernel_report.py compiles every entry.
    # With dropout, dK/dV at 32 x 64 sat at sm_80's 255-register limit; 32 x 32 leaves room for the Philox state.
    128: {"fwd": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4},
          "bwd_dkdv": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4},
          "bwd_dkdv_dropout": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4},
          "bwd_dq": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4}},
    512: {"fwd": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
          "bwd_dkdv": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4},
          "bwd_dkdv_dropout": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4},
          "bwd_dq": {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4}},
}


def varlen_block_config(max_seqlen: int) -> dict:
    """The block sizes for a batch whose longest sequence is ``max_seqlen``: the first bucket that holds it."""
    for bound in sorted(VARLEN_ATTENTION_CONFIGS):
        if max_seqlen <= bound:
            return VARLEN_ATTENTION_CONFIGS[bound]
    return VARLEN_ATTENTION_CONFIGS[max(VARLEN_ATTENTION_CONFIGS)]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> None:
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"varlen attention: q, k, v must share one (T, nh, hd) shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"varlen attention: cu_seqlens must be a 1-D integer tensor (B + 1,), got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if max_seqlen < 1:
        raise ValueError(f"varlen attention: max_seqlen must be >= 1, got {max_seqlen}")


def _padding_slots(cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed token, its row in a (B * max_seqlen) padded layout; and the (B, max_seqlen) real-token mask.
    No host sync: ``total`` (T) is the packed tensors' first dimension."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    batch = lengths.numel()
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=cu_seqlens.device), lengths, output_size=total)
    offset = torch.arange(total, device=cu_seqlens.device) - cu_seqlens.long()[seq_of_token]
    mask = torch.arange(max_seqlen, device=cu_seqlens.device)[None, :] < lengths[:, None]
    return seq_of_token * max_seqlen + offset, mask


def varlen_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, dropout_p: float = 0.0, seqlens: Sequence[int] | None = None,
                           dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Reference and CPU path. On the CPU with ``seqlens`` (the lengths ``cu_seqlens`` encodes, as Python ints): SDPA
    on each sequence alone. Otherwise: pad to (B, nh, max_seqlen, hd), SDPA with the key-padding mask, unpad.

    ``dropout_mask`` (B, nh, max_seqlen, max_seqlen) bool, True = kept, in each sequence's own coordinates (what
    :func:`.dropout.dropout_keep_mask` gives): drop exactly these (padded path, :func:`.attention.attention_torch`)."""
    _check(q, k, v, cu_seqlens, max_seqlen)
    if seqlens is not None and q.device.type == "cpu" and dropout_mask is None:
        if sum(seqlens) != q.shape[0] or len(seqlens) != cu_seqlens.numel() - 1:
            raise ValueError(f"varlen attention: seqlens (sum {sum(seqlens)}, {len(seqlens)} sequences) disagree "
                             f"with q ({q.shape[0]} tokens) and cu_seqlens ({cu_seqlens.numel() - 1} sequences)")
        outs = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in qkv), dropout_p=dropout_p).transpose(0, 1)
                for qkv in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens), strict=True) if qkv[0].shape[0]]
        return torch.cat(outs) if outs else q.new_zeros(q.shape)
    total, heads, head_dim = q.shape
    batch = cu_seqlens.numel() - 1
    slots, mask = _padding_slots(cu_seqlens, total, max_seqlen)

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros(batch * max_seqlen, heads, head_dim).index_copy(0, slots, t)
        return out.view(batch, max_seqlen, heads, head_dim).transpose(1, 2)  # (B, nh, S, hd)

    if dropout_mask is not None:
        out = attention_torch(pad(q), pad(k), pad(v), mask, dropout_p, dropout_mask)
    else:
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask[:, None, None, :],
                                             dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(batch * max_seqlen, heads, head_dim).index_select(0, slots)


# T (packed tokens) changes every step and only offsets rows: not specialised, one binary for every batch.
@late_jit(do_not_specialize=["T", "seed_lo", "seed_hi"])
def _varlen_fwd_kernel(
    Q, K, V, CuSeqlens, Out, LSE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    H, T, qk_scale, seed_lo, seed_hi, dropout_p,
    DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = (bh % H).to(tl.int64)
    start = tl.load(CuSeqlens + b).to(tl.int64)
    length = (tl.load(CuSeqlens + b + 1) - tl.load(CuSeqlens + b)).to(tl.int32)
    if pid_m * BLOCK_M >= length:  # this sequence is shorter than the batch's longest: no block here
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < length
    q = tl.load(Q + (start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    k_base = K + start * stride_kt + h * stride_kh
    v_base = V + start * stride_vt + h * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for start_n in range(0, length, BLOCK_N):
        cols = start_n + offs_n
        key_ok = cols < length
        kt = tl.load(k_base + cols[None, :] * stride_kt + offs_d[:, None], mask=key_ok[None, :],
                     other=0.0).to(DOT_DTYPE)  # K^T block (HEAD_DIM, BLOCK_N)
        qk = tl.dot(q, kt, input_precision=INPUT_PRECISION) * qk_scale  # log2 domain
        qk = tl.where(key_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))  # every block has a real key: m_new is finite
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)  # statistics of the undropped P
        if DROPOUT:
            p = tl.where(dropout_keep(seed_lo, seed_hi, dropout_p, b, h, offs_m, cols), p, 0.0)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=key_ok[:, None],
                    other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(Q.dtype.element_ty).to(DOT_DTYPE), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    if DROPOUT:
        acc = acc / (l_i * (1.0 - dropout_p))[:, None]  # only the output is scaled; the LSE stays that of P
    else:
        acc = acc / l_i[:, None]
    tl.store(Out + (start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + h * T + start + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


@late_jit(do_not_specialize=["T", "seed_lo", "seed_hi"])
def _varlen_bwd_dkdv_kernel(
    Q, K, V, CuSeqlens, DO, LSE, Delta, DK, DV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_gt, stride_gh,
    H, T, qk_scale, sm_scale, seed_lo, seed_hi, dropout_p,
    DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dV = P^T dO;  dS = P * (dO V^T - delta);  dK = scale * dS^T Q.  DK and DV share strides stride_g*.
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = (bh % H).to(tl.int64)
    start = tl.load(CuSeqlens + b).to(tl.int64)
    length = (tl.load(CuSeqlens + b + 1) - tl.load(CuSeqlens + b)).to(tl.int32)
    if pid_n * BLOCK_N >= length:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = cols < length
    k = tl.load(K + (start + cols[:, None]) * stride_kt + h * stride_kh + offs_d[None, :],
                mask=col_ok[:, None], other=0.0).to(DOT_DTYPE)
    v = tl.load(V + (start + cols[:, None]) * stride_vt + h * stride_vh + offs_d[None, :],
                mask=col_ok[:, None], other=0.0).to(DOT_DTYPE)
    q_base = Q + start * stride_qt + h * stride_qh
    do_base = DO + start * stride_dot + h * stride_doh
    stats = h * T + start
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    rp = 1.0 / (1.0 - dropout_p)  # dropout's scale (1 without dropout)
    for start_m in range(0, length, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < length
        q = tl.load(q_base + rows[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None],
                    other=0.0).to(DOT_DTYPE)
        do = tl.load(do_base + rows[:, None] * stride_dot + offs_d[None, :], mask=row_ok[:, None],
                     other=0.0).to(DOT_DTYPE)
        lse = tl.load(LSE + stats + rows, mask=row_ok, other=0.0)
        delta = tl.load(Delta + stats + rows, mask=row_ok, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        p = tl.math.exp2(qk - lse[:, None])
        p = tl.where(row_ok[:, None] & col_ok[None, :], p, 0.0)
        if DROPOUT:  # as the padded kernel: Z and 1/(1-p) on P in dV and on dO V^T; dS keeps the undropped P
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
    out = (start + cols[:, None]) * stride_gt + h * stride_gh + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@late_jit(do_not_specialize=["T", "seed_lo", "seed_hi"])
def _varlen_bwd_dq_kernel(
    Q, K, V, CuSeqlens, DO, LSE, Delta, DQ,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_gt, stride_gh,
    H, T, qk_scale, sm_scale, seed_lo, seed_hi, dropout_p,
    DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dQ = scale * dS K, with dS recomputed per key block.  DQ has strides stride_g*.
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = (bh % H).to(tl.int64)
    start = tl.load(CuSeqlens + b).to(tl.int64)
    length = (tl.load(CuSeqlens + b + 1) - tl.load(CuSeqlens + b)).to(tl.int32)
    if pid_m * BLOCK_M >= length:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < length
    q = tl.load(Q + (start + rows[:, None]) * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    do = tl.load(DO + (start + rows[:, None]) * stride_dot + h * stride_doh + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)
    lse = tl.load(LSE + h * T + start + rows, mask=row_ok, other=0.0)
    delta = tl.load(Delta + h * T + start + rows, mask=row_ok, other=0.0)
    k_base = K + start * stride_kt + h * stride_kh
    v_base = V + start * stride_vt + h * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    rp = 1.0 / (1.0 - dropout_p)  # dropout's scale (1 without dropout)
    for start_n in range(0, length, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < length
        k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :], mask=col_ok[:, None],
                    other=0.0).to(DOT_DTYPE)
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :], mask=col_ok[:, None],
                    other=0.0).to(DOT_DTYPE)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        p = tl.math.exp2(qk - lse[:, None])
        p = tl.where(row_ok[:, None] & col_ok[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        if DROPOUT:
            dp = tl.where(dropout_keep(seed_lo, seed_hi, dropout_p, b, h, rows, cols), dp * rp, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(Q.dtype.element_ty).to(DOT_DTYPE), k, input_precision=INPUT_PRECISION)
    tl.store(DQ + (start + rows[:, None]) * stride_gt + h * stride_gh + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor) -> tuple[int, int]:
    return t.stride(0), t.stride(1)


# A custom op (torch.library), not an autograd.Function: torch.compile keeps it in the graph as one opaque node with
# a fake (shape-only) implementation, so a compiled layer has no graph break here. The Philox key is an input (a
# (2,) int64 CPU tensor drawn by the caller), never drawn inside: an op that consumed the RNG itself could be
# reordered or recomputed by the compiler, and the backward must see the forward's key.
@torch.library.custom_op("bert_ds::varlen_attention_fwd", mutates_args=())
def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                dropout_p: float, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(O, LSE): O like q, LSE (nh, T) fp32 in the log2 domain."""
    total, heads, head_dim = q.shape
    batch = cu_seqlens.numel() - 1
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((heads, total), dtype=torch.float32, device=q.device)
    cfg = varlen_block_config(max_seqlen)["fwd"]
    _varlen_fwd_kernel[(triton.cdiv(max_seqlen, cfg["BLOCK_M"]), batch * heads)](
        q, k, v, cu_seqlens, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        heads, total, 1.0 / math.sqrt(head_dim) * _LOG2E, *seed.tolist(), dropout_p, DROPOUT=dropout_p > 0.0,
        HEAD_DIM=head_dim, **_dot_args(q.dtype), **cfg,
    )
    return o, lse


@_varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


@torch.library.custom_op("bert_ds::varlen_attention_bwd", mutates_args=())
def _varlen_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                o: torch.Tensor, lse: torch.Tensor, max_seqlen: int, dropout_p: float,
                seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV), regenerating the forward's dropout mask from ``seed``."""
    total, heads, head_dim = q.shape
    batch = cu_seqlens.numel() - 1
    q, k, v, do = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(do)
    sm_scale = 1.0 / math.sqrt(head_dim)
    delta = (do.float() * o.float()).sum(-1).transpose(0, 1).contiguous()  # (nh, T) rowsum(dO * O)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk, dv = torch.empty_like(dq), torch.empty_like(dq)
    common = dict(DROPOUT=dropout_p > 0.0, HEAD_DIM=head_dim, **_dot_args(q.dtype))
    args = (q, k, v, cu_seqlens, do, lse, delta)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq))
    scales = (heads, total, sm_scale * _LOG2E, sm_scale, *seed.tolist(), dropout_p)
    blocks = varlen_block_config(max_seqlen)
    cfg = blocks["bwd_dkdv_dropout" if dropout_p > 0.0 else "bwd_dkdv"]
    _varlen_bwd_dkdv_kernel[(triton.cdiv(max_seqlen, cfg["BLOCK_N"]), batch * heads)](
        *args, dk, dv, *strides, *scales, **common, **cfg,
    )
    cfg = blocks["bwd_dq"]
    _varlen_bwd_dq_kernel[(triton.cdiv(max_seqlen, cfg["BLOCK_M"]), batch * heads)](
        *args, dq, *strides, *scales, **common, **cfg,
    )
    return dq, dk, dv


@_varlen_bwd.register_fake
def _varlen_bwd_fake(do, q, k, v, cu_seqlens, o, lse, max_seqlen, dropout_p, seed):
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    return dq, torch.empty_like(dq), torch.empty_like(dq)


def _varlen_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens, *output, seed)
    ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p


def _varlen_backward(ctx, do, _dlse):
    q, k, v, cu_seqlens, o, lse, seed = ctx.saved_tensors
    dq, dk, dv = _varlen_bwd(do, q, k, v, cu_seqlens, o, lse, ctx.max_seqlen, ctx.dropout_p, seed)
    return dq, dk, dv, None, None, None, None


_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


def varlen_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, dropout_p: float = 0.0,
                            seqlens: Sequence[int] | None = None) -> torch.Tensor:
    """Triton FlashAttention on packed (T, nh, hd) tokens; differentiable in q, k, v. ``dropout_p > 0`` draws the
    call's Philox seed from torch's default CPU generator (:mod:`.dropout`). ``seqlens`` is accepted for the twin's
    signature and not needed: the kernels read ``cu_seqlens`` on the device."""
    dropout_p = check_dropout_p(dropout_p, "varlen attention backend 'triton'")
    _check(q, k, v, cu_seqlens, max_seqlen)
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise BadInput(f"varlen attention backend 'triton' needs q, k, v of one dtype among fp32/fp16/bf16, got "
                       f"{q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] not in SUPPORTED_HEAD_DIMS:
        raise BadInput(f"varlen attention backend 'triton' supports head_dim in {SUPPORTED_HEAD_DIMS}, "
                       f"got {q.shape[2]}")
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    return _varlen_fwd(q, k, v, cu, max_seqlen, dropout_p, dropout_seed_tensor(dropout_p))[0]
