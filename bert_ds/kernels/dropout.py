"""Attention dropout inside the Triton attention kernels: a Philox keep-mask that is regenerated, never stored.

Element (b, h, i, j) of the attention probabilities (sequence b of the batch, head h, query i and key j counted from
the start of the sequence) is kept when Philox4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2,
3"; ``tl.philox``) with key ``seed`` and counter (i, j, b, h) gives a uniform >= p; kept probabilities are scaled by
1/(1-p). A counter-based generator lets any program recompute any element, so the backward regenerates the forward's
mask from the seed and nothing of size S x S is stored (FlashAttention-2 does the same). The counter holds coordinates,
not memory offsets: the mask does not depend on block sizes, padding, ``max_seqlen`` or the packing of tokens, and the
padded and varlen kernels drop the same pairs.

Seed, and why resume stays exact: every attention call with dropout draws its 62-bit key (two 31-bit integers) from
torch's default CPU generator (:func:`draw_dropout_seed`). The trainer seeds that generator before each micro batch
from (seed, phase, step, micro batch) (``bert_ds.runtime.trainer.DropoutKey``, the key ``nn.Dropout`` already uses)
and the layers call attention in a fixed order, so layer l of micro batch k gets the same key in every run, resumed or
not, on any number of ranks. Non-reentrant activation checkpointing restores the CPU RNG state before it recomputes a
layer, so the recomputed forward draws the same key. A CPU draw is host-only: no device synchronisation.
:func:`dropout_keep_mask` materialises the mask for a key with the same Philox, so the torch twins can be given it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .jit import late_jit

__all__ = ["check_dropout_p", "draw_dropout_seed", "dropout_keep", "dropout_keep_mask", "dropout_seed_tensor"]

_SEED_BOUND = 2**31 - 1  # each half fits an i32 kernel argument: one binary for every seed (no i64 re-specialisation)


def check_dropout_p(dropout_p: float, op: str) -> float:
    """``dropout_p`` as a float in [0, 1), or ``ValueError`` naming ``op`` and the value."""
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1) for the Triton kernels, got {dropout_p!r}")
    return p


def dropout_seed_tensor(dropout_p: float) -> torch.Tensor:
    """(2,) int64 CPU tensor: the Philox key of one attention call, two draws from torch's default CPU generator
    (see module doc); zeros, with no draw, when ``dropout_p`` is 0. A tensor, not ints, so that under
    ``torch.compile`` the draw is a graph op feeding the attention custom op (reading ints would break the graph)."""
    return _draw() if dropout_p > 0.0 else torch.zeros(2, dtype=torch.int64)


def draw_dropout_seed() -> tuple[int, int]:
    """The key :func:`dropout_seed_tensor` draws, as two ints (what the kernels take)."""
    lo, hi = _draw().tolist()
    return int(lo), int(hi)


def _draw() -> torch.Tensor:
    return torch.randint(0, _SEED_BOUND, (2,), dtype=torch.int64)


@triton.jit
def dropout_keep(seed_lo, seed_hi, dropout_p, b, h, rows, cols):
    """(len(rows), len(cols)) bool: True where element (b, h, row, col) is kept. rows, cols: int32 index vectors."""
    zero = (rows[:, None] + cols[None, :]) * 0
    c0 = (rows[:, None] + zero).to(tl.uint32, bitcast=True)
    c1 = (cols[None, :] + zero).to(tl.uint32, bitcast=True)
    c2 = (b.to(tl.int32) + zero).to(tl.uint32, bitcast=True)
    c3 = (h.to(tl.int32) + zero).to(tl.uint32, bitcast=True)
    r, _, _, _ = tl.philox_impl(c0, c1, c2, c3, seed_lo.to(tl.uint32), seed_hi.to(tl.uint32))
    return tl.uint_to_uniform_float(r) >= dropout_p


@late_jit(do_not_specialize=["seed_lo", "seed_hi"])
def _dropout_mask_kernel(Out, seed_lo, seed_hi, dropout_p, H, SQ, SK,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = dropout_keep(seed_lo, seed_hi, dropout_p, bh // H, bh % H, rows, cols)
    ok = (rows < SQ)[:, None] & (cols < SK)[None, :]
    tl.store(Out + bh.to(tl.int64) * SQ * SK + rows[:, None] * SK + cols[None, :], keep.to(tl.int8), mask=ok)


def dropout_keep_mask(seed: tuple[int, int], dropout_p: float, batch: int, heads: int, seq_q: int,
                      seq_k: int | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """(batch, heads, seq_q, seq_k) bool, True = kept: the mask the attention kernels draw for ``seed``.

    On CPU tensors this runs under the Triton interpreter (``TRITON_INTERPRET=1``), on CUDA compiled."""
    seq_k = seq_q if seq_k is None else seq_k
    dropout_p = check_dropout_p(dropout_p, "dropout_keep_mask")
    out = torch.empty((batch, heads, seq_q, seq_k), dtype=torch.int8, device=device)
    if out.numel():
        block = 32
        grid = (triton.cdiv(seq_q, block), triton.cdiv(seq_k, block), batch * heads)
        _dropout_mask_kernel[grid](out, seed[0], seed[1], dropout_p, heads, seq_q, seq_k, BLOCK_M=block, BLOCK_N=block)
    return out.bool()
