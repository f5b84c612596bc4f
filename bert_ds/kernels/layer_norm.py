"""LayerNorm over the last dim, optionally fused with a residual add: ``LN(x + residual)``.

Twins: :func:`layer_norm_torch` (``F.layer_norm``, the reference and CPU path),
:func:`layer_norm_triton` (one program per row forward; backward recomputes ``x + residual`` from
the inputs and writes per-program partial sums for the weight/bias gradients, reduced in torch, so
no atomics), and :func:`layer_norm_apex` (NVIDIA apex ``fused_layer_norm_affine``).
Statistics and arithmetic are fp32 inside the kernels; outputs take the input dtype.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .jit import LateJIT, late_jit

__all__ = ["LAYER_NORM_CONFIGS", "apex_available", "layer_norm_apex", "layer_norm_torch", "layer_norm_triton"]

# Launch settings shipped for the Triton kernels; tools/kernel_report.py compiles what the runtime launches with them.
# Rows per backward program: enough that the (programs, N) partial-sum buffer stays small.
# Load width: BLOCK_N = 1024 over 4 warps gives each thread 8 contiguous elements, one 128-bit access in bf16, and the
# accesses compile to 128-bit LDG/STG when N and the row strides are multiples of 16 (the JIT marks such integers
# 16-divisible; BERT's 768 and 1024 are); other N take 16-bit accesses (tests/kernels/test_sass.py).
LAYER_NORM_CONFIGS = {
    "fwd": {"num_warps": 4},
    "bwd": {"ROWS_PER_PROGRAM": 16, "num_warps": 4},
}


def layer_norm_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: ``F.layer_norm(x + residual)`` over the last dim."""
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def apex_available() -> bool:
    """True when NVIDIA apex's fused LayerNorm (and its CUDA extension) imports.

    The unrelated PyPI package named ``apex`` has no ``apex.normalization``, so it reads as absent.
    """
    try:
        importlib.import_module("apex.normalization.fused_layer_norm")
        importlib.import_module("fused_layer_norm_cuda")
    except ImportError:
        return False
    return True


def layer_norm_apex(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """NVIDIA apex fused LayerNorm; the residual add (if any) is a separate torch op."""
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine

    if residual is not None:
        x = x + residual
    return fused_layer_norm_affine(x, weight, bias, (x.shape[-1],), eps)


@LateJIT
def _layer_norm_fwd_kernel(
    X, R, Y, W, B, Mean, Rstd,
    stride_x, stride_r, stride_y, N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w + b
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


# The row count M changes from step to step (unpadded tokens, masked positions) and only masks whole rows, so it is
# not specialised: one binary for every M, instead of a recompile whenever M happens to be a multiple of 16.
@late_jit(do_not_specialize=["M"])
def _layer_norm_bwd_kernel(
    X, R, DY, DX, W, Mean, Rstd, DW_partial, DB_partial,
    stride_x, stride_r, stride_dy, stride_dx, M, N,
    HAS_RESIDUAL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dxhat = w * dy;  dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat));  d(residual) = dx.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(ROWS_PER_PROGRAM):
        row = pid.to(tl.int64) * ROWS_PER_PROGRAM + i
        # Rows past M are masked out column-wise (n_valid = 0) and read stats from row M-1.
        mask = cols < tl.where(row < M, N, 0)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + tl.minimum(row, M - 1))
        rstd = tl.load(Rstd + tl.minimum(row, M - 1))
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        dxhat = w * dy
        c1 = tl.sum(xhat * dxhat, axis=0) / N
        c2 = tl.sum(dxhat, axis=0) / N
        dx = (dxhat - (xhat * c1 + c2)) * rstd
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(DW_partial + pid * N + cols, dw, mask=col_mask)
    tl.store(DB_partial + pid * N + cols, db, mask=col_mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """(..., N) -> (M, N) with unit stride along N (copies only when needed)."""
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


# Custom ops (torch.library), not an autograd.Function, so that torch.compile keeps them as graph nodes.
@torch.library.custom_op("bert_ds::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y shaped like x, mean (M,), rstd (M,)) over the M rows of ``x + residual``."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    r2 = _rows(residual, n) if residual is not None else x2
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0:
        _layer_norm_fwd_kernel[(m,)](
            x2, r2, y, weight, bias, mean, rstd,
            x2.stride(0), r2.stride(0), y.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_N=triton.next_power_of_2(n), **LAYER_NORM_CONFIGS["fwd"],
        )
    return y.view(x.shape), mean, rstd


@_layer_norm_fwd.register_fake
def _layer_norm_fwd_fake(x, weight, bias, residual, eps):
    rows = x.numel() // x.shape[-1]
    return (x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32),
            x.new_empty((rows,), dtype=torch.float32))


@torch.library.custom_op("bert_ds::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
                    mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx shaped like x, dweight fp32, dbias fp32); the residual's gradient is dx."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    r2 = _rows(residual, n) if residual is not None else x2
    m = x2.shape[0]
    dy2 = _rows(dy, n)
    dx = torch.empty_like(x2)
    rows_per_program = LAYER_NORM_CONFIGS["bwd"]["ROWS_PER_PROGRAM"]
    programs = triton.cdiv(m, rows_per_program)
    dw_partial = torch.zeros((programs, n), dtype=torch.float32, device=x2.device)
    db_partial = torch.zeros((programs, n), dtype=torch.float32, device=x2.device)
    if m > 0:
        _layer_norm_bwd_kernel[(programs,)](
            x2, r2, dy2, dx, weight, mean, rstd, dw_partial, db_partial,
            x2.stride(0), r2.stride(0), dy2.stride(0), dx.stride(0), m, n,
            HAS_RESIDUAL=residual is not None, BLOCK_N=triton.next_power_of_2(n), **LAYER_NORM_CONFIGS["bwd"],
        )
    return dx.view(x.shape), dw_partial.sum(0), db_partial.sum(0)


@_layer_norm_bwd.register_fake
def _layer_norm_bwd_fake(dy, x, weight, residual, mean, rstd):
    n = x.shape[-1]
    return x.new_empty(x.shape), x.new_empty((n,), dtype=torch.float32), x.new_empty((n,), dtype=torch.float32)


def _layer_norm_setup_context(ctx, inputs, output) -> None:
    x, weight, bias, residual, _eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, residual, mean, rstd)
    ctx.bias_dtype = bias.dtype


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, residual, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_bwd(dy, x, weight, residual, mean, rstd)
    dres = dx.to(residual.dtype) if residual is not None else None
    return dx, dw.to(weight.dtype), db.to(ctx.bias_dtype), dres, None


_layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup_context)


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``LN(x + residual)``; differentiable in x, residual, weight and bias."""
    if x.shape[-1] != weight.shape[-1] or weight.shape != bias.shape or weight.dim() != 1:
        raise ValueError(f"layer_norm: weight/bias must be ({x.shape[-1]},), got {tuple(weight.shape)} "
                         f"and {tuple(bias.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"layer_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    return _layer_norm_fwd(x, weight.contiguous(), bias.contiguous(), residual, float(eps))[0]
