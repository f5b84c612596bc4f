"""Bias add fused with exact (erf) GELU: ``gelu(x + bias)``, as in BERT's intermediate layer.

Twins: :func:`bias_gelu_torch` (``F.gelu(x + bias, approximate="none")``) and
:func:`bias_gelu_triton`. The Triton kernels work on (BLOCK_M, BLOCK_N) tiles of the (rows, N)
view; the backward writes ``dx`` and per-tile-row fp32 column sums for ``dbias`` (reduced in torch,
so no atomics). Arithmetic is fp32 inside the kernels; outputs take the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .jit import late_jit

__all__ = ["BIAS_GELU_CONFIGS", "bias_gelu_torch", "bias_gelu_triton"]

# Each thread owns 8 contiguous columns of a tile row: 128-bit LDG/STG in bf16 when N and the row strides are multiples
# of 16 (the JIT marks them 16-divisible; BERT's 3072 and 4096 are), 16-bit accesses otherwise.
BIAS_GELU_CONFIGS = {
    "fwd": {"BLOCK_M": 16, "BLOCK_N": 256, "num_warps": 4},
    "bwd": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4},
}


def bias_gelu_torch(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Reference: exact GELU of ``x + bias`` (bias broadcast over the last dim)."""
    return F.gelu(x + bias, approximate="none")


# The row count M changes from step to step (unpadded tokens, masked positions) and only masks whole rows, so it is
# not specialised: one binary for every M, instead of a recompile whenever M happens to be a multiple of 16.
@late_jit(do_not_specialize=["M"])
def _bias_gelu_fwd_kernel(X, B, Y, M, N, stride_x, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
    z = x + b[None, :]
    y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))  # 1/sqrt(2)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@late_jit(do_not_specialize=["M"])  # as the forward
def _bias_gelu_bwd_kernel(
    X, B, DY, DX, DB_partial, M, N, stride_x, stride_dy, stride_dx,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # d/dz [z * Phi(z)] = Phi(z) + z * phi(z), Phi the normal CDF, phi its density.
    pid_m = tl.program_id(0)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
    z = x + b[None, :]
    cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
    pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327  # 1/sqrt(2*pi)
    dz = tl.where(mask, dy * (cdf + z * pdf), 0.0)
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dz.to(DX.dtype.element_ty), mask=mask)
    tl.store(DB_partial + pid_m * N + cols, tl.sum(dz, axis=0), mask=cols < N)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


# Custom ops (torch.library), not an autograd.Function, so that torch.compile keeps them as graph nodes.
@torch.library.custom_op("bert_ds::bias_gelu_fwd", mutates_args=())
def _bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    x2 = _rows(x, n)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = BIAS_GELU_CONFIGS["fwd"]
    if m > 0:
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        _bias_gelu_fwd_kernel[grid](x2, bias, y, m, n, x2.stride(0), y.stride(0), **cfg)
    return y.view(x.shape)


@_bias_gelu_fwd.register_fake
def _bias_gelu_fwd_fake(x, bias):
    return x.new_empty(x.shape)


@torch.library.custom_op("bert_ds::bias_gelu_bwd", mutates_args=())
def _bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx shaped like x, dbias fp32)."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    m = x2.shape[0]
    dy2 = _rows(dy, n)
    dx = torch.empty_like(x2)
    cfg = BIAS_GELU_CONFIGS["bwd"]
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    db_partial = torch.zeros((grid[0], n), dtype=torch.float32, device=x2.device)
    if m > 0:
        _bias_gelu_bwd_kernel[grid](x2, bias, dy2, dx, db_partial, m, n, x2.stride(0), dy2.stride(0),
                                    dx.stride(0), **cfg)
    return dx.view(x.shape), db_partial.sum(0)


@_bias_gelu_bwd.register_fake
def _bias_gelu_bwd_fake(dy, x, bias):
    return x.new_empty(x.shape), x.new_empty((x.shape[-1],), dtype=torch.float32)


def _bias_gelu_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _bias_gelu_backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, db = _bias_gelu_bwd(dy, x, bias)
    return dx, db.to(bias.dtype)


_bias_gelu_fwd.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup_context)


def bias_gelu_triton(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Triton ``gelu_erf(x + bias)``; differentiable in x and bias."""
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"bias_gelu: bias must be ({x.shape[-1]},), got {tuple(bias.shape)}")
    return _bias_gelu_fwd(x, bias.contiguous())
