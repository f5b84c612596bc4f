"""Triton LayerNorm (+ residual) against the F.layer_norm twin, forward and backward."""

from __future__ import annotations

import zlib

import pytest
import torch

from bert_ds.kernels import layer_norm
from bert_ds.kernels.layer_norm import layer_norm_torch
from tests.helpers.kernels import assert_matches_twin, grads_of

# The reference is the torch twin in fp32 on the same (upcast) inputs. fp32 differs only in summation order
# (elementwise, measured at most 3% of this bound); bf16 outputs are rounded to bf16, checked by the eps rule of
# tests.helpers.kernels.assert_within_rounding.
FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}


def _check(shape, dtype, with_residual, eps=1e-12):
    # crc32, not hash(): str hashes are salted per process, and a failing case must come back on the next run
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, str(dtype), with_residual)).encode()))
    n = shape[-1]
    x = torch.randn(shape, generator=gen).to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=gen)).to(dtype)
    b = (0.5 * torch.randn(n, generator=gen)).to(dtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    inputs = [x, w, b] + ([torch.randn(shape, generator=gen).to(dtype)] if with_residual else [])

    def run_triton(x, w, b, r=None):
        return layer_norm(x, w, b, eps, residual=r, backend="triton")

    def run_twin(x, w, b, r=None):
        return layer_norm_torch(x, w, b, eps, r)

    out, grads = grads_of(run_triton, inputs, dy)
    ref, ref_grads = grads_of(run_twin, [t.float() for t in inputs], dy.float())
    assert out.dtype == dtype and out.shape == shape
    assert_matches_twin(out.float(), ref, dtype, FP32_TOL, "out")
    for name, g, rg in zip(("x", "weight", "bias", "residual")[: len(grads)], grads, ref_grads, strict=True):
        assert g.dtype == dtype, name
        assert_matches_twin(g.float(), rg, dtype, FP32_TOL, f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [768, 1024])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "plain"])
def test_layer_norm_matches_twin(hidden, dtype, with_residual):
    _check((3, 13, hidden), dtype, with_residual)  # 39 rows: not a power of two, not a multiple of 16


@pytest.mark.parametrize("rows", [1, 50])
def test_layer_norm_odd_rows_and_hidden(rows):
    _check((rows, 100), torch.float32, True)  # hidden 100 exercises the column mask (BLOCK_N = 128)


def test_layer_norm_eps_matters():
    # Constant rows have zero variance: the output is bias exactly when rstd = 1/sqrt(eps) is finite.
    x = torch.full((5, 768), 3.0)
    w, b = torch.ones(768), torch.linspace(-1, 1, 768)
    out = layer_norm(x, w, b, 1e-5, backend="triton")
    torch.testing.assert_close(out, b.expand(5, -1))
