"""Attention dropout inside the Triton kernels (interpreter): the kernels drop exactly the pairs of
:func:`dropout_keep_mask`, match the torch twins given that mask (forward and backward, padded and varlen), keep
1 - p of the probabilities, and draw their key from torch's RNG (same seed, same mask)."""

from __future__ import annotations

import math

import pytest
import torch

import bert_ds.kernels as kernels
from bert_ds.kernels import attention, varlen_attention
from bert_ds.kernels.attention import attention_torch
from bert_ds.kernels.attention_varlen import varlen_attention_torch
from bert_ds.kernels.dropout import draw_dropout_seed, dropout_keep_mask
from tests.helpers.kernels import assert_matches_twin, grads_of

# As tests/kernels/test_attention.py: the twin runs in fp32 on the upcast inputs; fp32 elementwise, bf16 by the eps
# rule of tests.helpers.kernels.assert_within_rounding.
FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}
SIGMAS = 5  # binomial bounds: a correct generator fails one of these checks with probability ~6e-7 each


def _padding_mask(lengths: list[int], seq: int) -> torch.Tensor:
    return torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]  # (B, S), True = real token


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _mask_for(torch_seed: int, p: float, batch: int, heads: int, seq: int) -> torch.Tensor:
    """The mask a kernel call right after ``torch.manual_seed(torch_seed)`` draws."""
    torch.manual_seed(torch_seed)
    return dropout_keep_mask(draw_dropout_seed(), p, batch, heads, seq)


# --- the kernels drop exactly the helper's pairs -------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kernels_drop_exactly_the_pairs_of_the_helper_mask(p):
    """q = k = 0 gives uniform attention 1/L and v = identity makes the output the dropped attention matrix itself:
    out[i, j] * L * (1 - p) is the keep-mask, read straight out of each kernel (no twin involved). Padded and varlen
    must both equal the helper's mask for the seed the call drew, on partial blocks too (L = 100, 37)."""
    lengths, heads, seq, head_dim = [100, 37], 2, 100, 128
    batch = len(lengths)
    want = _mask_for(11, p, batch, heads, seq)
    zeros = torch.zeros(batch, heads, seq, head_dim)
    eye = torch.eye(seq, head_dim).expand(batch, heads, seq, head_dim)
    torch.manual_seed(11)
    padded = attention(zeros, zeros, eye, _padding_mask(lengths, seq), dropout_p=p, backend="triton")
    for b, length in enumerate(lengths):
        got = padded[b, :, :length, :length] * length * (1 - p)  # real query rows, real keys
        assert set(got.round(decimals=4).unique().tolist()) <= {0.0, 1.0}
        assert torch.equal(got.round() == 1, want[b, :, :length, :length]), f"padded, sequence {b}"

    packed = torch.cat([eye[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])  # (T, nh, hd)
    zeros = torch.zeros_like(packed)
    torch.manual_seed(11)
    out = varlen_attention(zeros, zeros, packed, _cu(lengths), max(lengths), dropout_p=p, backend="triton")
    for b, rows in enumerate(out.split(lengths)):
        length = lengths[b]
        got = rows.transpose(0, 1)[:, :, :length] * length * (1 - p)  # (nh, L, L)
        assert torch.equal(got.round() == 1, want[b, :, :length, :length]), f"varlen, sequence {b}"


# --- kernel vs twin given the same mask -----------------------------------------------------------------------------

@pytest.mark.parametrize(("lengths", "seq", "dtype"), [
    ([128, 77, 5], 128, torch.float32),
    ([128, 77, 5], 128, torch.bfloat16),
    ([100, 31], 100, torch.float32),  # partial query and key blocks
    ([64, 0], 64, torch.float32),  # a sequence without any real token
], ids=["seq128-fp32", "seq128-bf16", "seq100-partial-fp32", "empty-sequence-fp32"])
def test_padded_kernel_matches_twin_with_the_same_mask(lengths, seq, dtype):
    p, heads, head_dim = 0.1, 2, 64
    batch = len(lengths)
    gen = torch.Generator().manual_seed(seq + batch)
    q, k, v, do = (torch.randn(batch, heads, seq, head_dim, generator=gen).to(dtype) for _ in range(4))
    kpm = _padding_mask(lengths, seq)
    torch.manual_seed(3)
    out, grads = grads_of(lambda q, k, v: attention(q, k, v, kpm, dropout_p=p, backend="triton"), [q, k, v], do)
    keep = _mask_for(3, p, batch, heads, seq)
    ref, ref_grads = grads_of(lambda q, k, v: attention_torch(q, k, v, kpm, p, dropout_mask=keep),
                              [q.float(), k.float(), v.float()], do.float())
    assert out.dtype == dtype and torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    real = kpm[:, None, :, None].expand(out.shape)  # real query rows (padded rows are arbitrary but finite)
    assert_matches_twin(out.float()[real], ref[real], dtype, FP32_TOL, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_matches_twin(g.float(), rg, dtype, FP32_TOL, name)
    # The twin with another mask is far from the kernel: the comparison above sees the mask.
    other = _mask_for(4, p, batch, heads, seq)
    wrong = attention_torch(q.float(), k.float(), v.float(), kpm, p, other)[real]
    with pytest.raises(AssertionError):
        assert_matches_twin(wrong, ref[real], dtype, FP32_TOL, "another mask")


@pytest.mark.parametrize(("lengths", "dtype"), [
    ([128, 77, 5, 1], torch.float32),
    ([100, 31, 64, 33], torch.float32),  # partial blocks
    ([128, 77, 5, 1], torch.bfloat16),
    ([300, 129], torch.float32),  # the seq-512 bucket's block sizes
], ids=["seq128-fp32", "partial-fp32", "seq128-bf16", "bucket512-fp32"])
def test_varlen_kernel_matches_twin_with_the_same_mask(lengths, dtype):
    p, heads, head_dim = 0.1, 2, 64
    gen = torch.Generator().manual_seed(sum(lengths))
    q, k, v, do = (torch.randn(sum(lengths), heads, head_dim, generator=gen).to(dtype) for _ in range(4))
    cu, longest = _cu(lengths), max(lengths)
    torch.manual_seed(5)
    out, grads = grads_of(lambda q, k, v: varlen_attention(q, k, v, cu, longest, p, backend="triton"), [q, k, v], do)
    keep = _mask_for(5, p, len(lengths), heads, longest)
    ref, ref_grads = grads_of(lambda q, k, v: varlen_attention_torch(q, k, v, cu, longest, p, dropout_mask=keep),
                              [q.float(), k.float(), v.float()], do.float())
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert_matches_twin(out.float(), ref, dtype, FP32_TOL, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_matches_twin(g.float(), rg, dtype, FP32_TOL, name)


def test_twin_with_an_all_kept_mask_is_the_undropped_attention_scaled():
    """The explicit-mask twin is the definition: keeping everything gives SDPA's attention times 1/(1-p)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    kpm = _padding_mask([24, 9], 24)
    keep = torch.ones(2, 2, 24, 24, dtype=torch.bool)
    torch.testing.assert_close(attention_torch(q, k, v, kpm, 0.25, keep), attention_torch(q, k, v, kpm) / 0.75)


# --- the generator --------------------------------------------------------------------------------------------------

def _within(observed: float, expected: float, n: int) -> bool:
    return abs(observed - expected) <= SIGMAS * math.sqrt(expected * (1 - expected) / n)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_is_one_minus_p_within_binomial_bounds(p):
    """Over n = 2 x 4 x 128 x 128 = 131,072 draws the kept fraction is within 5 sigma of 1 - p (sigma =
    sqrt(p (1 - p) / n): 8.3e-4 at p = 0.1); so is every (sequence, head) slice (16,384 draws), and two heads'
    masks agree as often as independent draws do (p^2 + (1 - p)^2), as do neighbouring query rows. A counter that
    ignored the head or the row, or a comparison the wrong way round (keep rate p), fails."""
    keep = dropout_keep_mask((123456789, 987654321), p, 2, 4, 128)
    assert _within(keep.float().mean().item(), 1 - p, keep.numel())
    slices = keep.flatten(2).float()  # (B, nh, S * S)
    for rate in slices.mean(-1).flatten().tolist():
        assert _within(rate, 1 - p, slices.shape[-1])
    agree = (keep[:, 0] == keep[:, 1]).float().mean().item()
    assert _within(agree, p * p + (1 - p) ** 2, keep[:, 0].numel())
    rows = keep[0, 0, 0::2] == keep[0, 0, 1::2]  # disjoint pairs of neighbouring query rows: independent draws
    assert _within(rows.float().mean().item(), p * p + (1 - p) ** 2, rows.numel())


def test_same_seed_same_mask_other_seed_other_mask():
    base = dropout_keep_mask((7, 8), 0.1, 2, 2, 64)
    assert torch.equal(base, dropout_keep_mask((7, 8), 0.1, 2, 2, 64))
    # Either half of the key changes the mask: about 2 p (1 - p) = 18% of the pairs differ.
    for other in ((7, 9), (8, 8)):
        assert _within((base != dropout_keep_mask(other, 0.1, 2, 2, 64)).float().mean().item(), 0.18, base.numel())
    # Coordinates, not offsets: a sub-grid of a larger call is the smaller call's mask.
    assert torch.equal(dropout_keep_mask((7, 8), 0.1, 3, 2, 100)[:2, :, :64, :64], base)


def test_kernel_seed_follows_torch_rng():
    """The key comes from torch's default generator: the same torch seed gives bit-identical outputs and grads,
    another gives others; dropout 0 draws nothing (the RNG stream of a run without attention dropout is as
    before)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, 2, 48, 64, generator=gen) for _ in range(4))

    def run(seed):
        torch.manual_seed(seed)
        return grads_of(lambda q, k, v: attention(q, k, v, dropout_p=0.1, backend="triton"), [q, k, v], do)

    (out_a, grads_a), (out_b, grads_b), (out_c, _) = run(0), run(0), run(1)
    assert torch.equal(out_a, out_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert not torch.allclose(out_a, out_c)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    attention(q, k, v, dropout_p=0.0, backend="triton")
    varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), _cu([48]), 48,
                     backend="triton")
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("p", [1.0, -0.1, 1.5])
def test_dropout_probability_out_of_range_is_refused(p):
    q = torch.randn(1, 1, 16, 64)
    with pytest.raises(ValueError, match="dropout_p"):
        attention(q, q, q, dropout_p=p, backend="triton")
    with pytest.raises(ValueError, match="dropout_p"):
        varlen_attention(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), _cu([16]), 16,
                         dropout_p=p, backend="triton")


def test_auto_keeps_the_triton_attention_with_dropout(monkeypatch, recwarn, fresh_warnings):
    """On CUDA ``auto`` resolves to Triton; with dropout it must stay there (no SDPA fallback, no warning)."""
    monkeypatch.setattr(kernels, "resolve_backend", lambda op, requested, device, dtype=None: "triton")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 32, 64, generator=gen) for _ in range(3))
    torch.manual_seed(0)
    got = attention(q, k, v, dropout_p=0.1)
    want = attention_torch(q, k, v, dropout_p=0.1, dropout_mask=_mask_for(0, 0.1, 1, 2, 32))
    torch.testing.assert_close(got, want, **FP32_TOL)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    torch.manual_seed(0)
    got = varlen_attention(*packed, _cu([32]), 32, dropout_p=0.1)
    torch.testing.assert_close(got, want[0].transpose(0, 1), **FP32_TOL)  # same pairs as padded
    assert not [w for w in recwarn if "dropout" in str(w.message)]
