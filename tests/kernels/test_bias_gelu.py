"""Triton bias + erf-GELU against the F.gelu twin, forward and backward."""

from __future__ import annotations

import pytest
import torch

from bert_ds.kernels import bias_gelu
from bert_ds.kernels.bias_gelu import bias_gelu_torch
from tests.helpers.kernels import assert_matches_twin, grads_of

# Reference: the torch twin in fp32 on the same (upcast) inputs. fp32 elementwise: 3e-5, 23x the largest difference
# measured (1.3e-6 relative, dbias summing up to 41 rows) and 15x under the tanh approximation's 4.7e-4 error; bf16 by
# the eps rule of tests.helpers.kernels.assert_within_rounding.
FP32_TOL = {"atol": 3e-5, "rtol": 3e-5}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 13, 768), (41, 1024), (2, 7, 3072), (5, 100)])
def test_bias_gelu_matches_twin(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (2 * torch.randn(shape, generator=gen)).to(dtype)
    bias = torch.randn(shape[-1], generator=gen).to(dtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    out, (dx, db) = grads_of(lambda x, b: bias_gelu(x, b, backend="triton"), [x, bias], dy)
    ref, (rdx, rdb) = grads_of(bias_gelu_torch, [x.float(), bias.float()], dy.float())
    assert out.dtype == dtype and dx.dtype == dtype and db.dtype == dtype
    assert_matches_twin(out.float(), ref, dtype, FP32_TOL, "out")
    assert_matches_twin(dx.float(), rdx, dtype, FP32_TOL, "dx")
    assert_matches_twin(db.float(), rdb, dtype, FP32_TOL, "dbias")


def test_bias_gelu_is_erf_form():
    # erf GELU(1) = Phi(1) = 0.8413447..., the tanh approximation gives 0.8411920...
    out = bias_gelu(torch.zeros(1, 16), torch.ones(16), backend="triton")
    torch.testing.assert_close(out, torch.full((1, 16), 0.8413447460685429), atol=1e-6, rtol=0)
