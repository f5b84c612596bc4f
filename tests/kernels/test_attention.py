"""Triton FlashAttention against the SDPA twin, forward and backward, with key padding."""

from __future__ import annotations

import pytest
import torch

from bert_ds.kernels import attention
from bert_ds.kernels.attention import attention_torch
from tests.helpers.kernels import assert_matches_twin, grads_of

# Reference: the SDPA twin in fp32 on the same (upcast) inputs, compared on real-token query rows
# only (padded query rows may hold anything finite). fp32 elementwise (measured at most 2% of this bound); bf16 and
# fp16 by the eps rule of tests.helpers.kernels.assert_within_rounding (bf16 rounds P and dS before the matmuls, as on
# the GPU).
FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}
HEAD_DIM = 64


def _padding_mask(lengths: list[int], seq: int) -> torch.Tensor:
    return torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]  # (B, S), True = real token


def _check(batch_lengths, seq, heads, dtype, layout="bhsd"):
    gen = torch.Generator().manual_seed(seq * 1000 + len(batch_lengths))
    batch = len(batch_lengths)
    shape = (batch, heads, seq, HEAD_DIM)
    if layout == "bshd":  # as produced by splitting heads out of a (B, S, hidden) projection
        q, k, v = (torch.randn(batch, seq, heads, HEAD_DIM, generator=gen).to(dtype).transpose(1, 2) for _ in range(3))
    else:
        q, k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    mask = _padding_mask(batch_lengths, seq)
    do = torch.randn(shape, generator=gen).to(dtype)

    out, grads = grads_of(lambda q, k, v: attention(q, k, v, mask, backend="triton"), [q, k, v], do)
    ref, ref_grads = grads_of(lambda q, k, v: attention_torch(q, k, v, mask), [q.float(), k.float(), v.float()],
                              do.float())
    assert out.dtype == dtype and out.shape == shape
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    real = mask[:, None, :, None].expand(shape)  # compare real-token query rows
    assert_matches_twin(out.float()[real], ref[real], dtype, FP32_TOL, "out")
    # Padded query rows still send gradient to keys/values through dO, identically in both; dq of a
    # padded row is compared too, since its softmax over the real keys is well defined.
    has_real_key = torch.tensor([n > 0 for n in batch_lengths])[:, None, None, None].expand(shape)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert g.dtype == dtype
        assert_matches_twin(g.float()[has_real_key], rg[has_real_key], dtype, FP32_TOL, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_attention_seq128_mixed_lengths(dtype):
    _check([128, 77, 5], seq=128, heads=2, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_seq_not_multiple_of_block(dtype):
    _check([100, 31], seq=100, heads=3, dtype=dtype)  # partial query and key blocks


def test_attention_seq512_bf16():
    _check([512, 300], seq=512, heads=1, dtype=torch.bfloat16)


def test_attention_head_split_layout():
    _check([64, 40], seq=64, heads=2, dtype=torch.float32, layout="bshd")  # non-contiguous q, k, v


def test_attention_no_mask_and_all_padding_sequence():
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 64, HEAD_DIM, generator=gen) for _ in range(3))
    torch.testing.assert_close(attention(q, k, v, backend="triton"), attention_torch(q, k, v), **FP32_TOL)
    # A sequence with no real token has no softmax at all: the kernel must stay finite, not NaN.
    mask = _padding_mask([64, 0], 64)
    out = attention(q, k, v, mask, backend="triton")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], attention_torch(q, k, v, mask)[0], **FP32_TOL)


def test_attention_triton_rejects_mixed_dtypes():
    q = torch.randn(1, 1, 16, HEAD_DIM)
    with pytest.raises(ValueError, match="dtype"):
        attention(q, q.bfloat16(), q, backend="triton")


def test_attention_triton_dropout_zero_is_the_undropped_kernel():
    # dropout_p=0 builds DROPOUT=False: the same function as the twin without dropout (tests/kernels/
    # test_attention_dropout.py covers p > 0).
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 40, HEAD_DIM, generator=gen) for _ in range(3))
    torch.testing.assert_close(attention(q, k, v, dropout_p=0.0, backend="triton"), attention_torch(q, k, v),
                               **FP32_TOL)
