"""Variable-length attention on packed tokens: the Triton kernels (interpreter) against the torch twin, and the twin
against per-sequence attention computed independently, forward and backward."""

from __future__ import annotations

import pytest
import torch

from bert_ds.kernels import varlen_attention
from bert_ds.kernels.attention_varlen import varlen_attention_torch, varlen_block_config
from tests.helpers.kernels import assert_matches_twin, grads_of, rounding_error

# The twin in fp32 on the upcast inputs; fp32 elementwise, bf16/fp16 by the eps rule of
# tests.helpers.kernels.assert_within_rounding.
FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}
HEAD_DIM = 64


def _packed(lengths: list[int], heads: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v, do = (torch.randn(total, heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(4))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, do, cu


def _per_sequence(q, k, v, cu):
    """Independent reference: plain softmax(q k^T / sqrt(d)) v for each sequence on its own, no padding anywhere."""
    outs = []
    for b in range(cu.numel() - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))  # (nh, L, hd)
        probs = torch.softmax(qs @ ks.transpose(1, 2) / HEAD_DIM ** 0.5, dim=-1)
        outs.append((probs @ vs).transpose(0, 1))
    return torch.cat(outs)


def test_torch_twin_equals_per_sequence_attention_forward_and_backward():
    lengths = [128, 77, 5, 1, 100]
    q, k, v, do, cu = _packed(lengths, heads=2, dtype=torch.float64, seed=1)
    out, grads = grads_of(lambda q, k, v: varlen_attention_torch(q, k, v, cu, max(lengths)), [q, k, v], do)
    ref, ref_grads = grads_of(lambda q, k, v: _per_sequence(q, k, v, cu), [q, k, v], do)
    torch.testing.assert_close(out, ref)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_torch_twin_per_sequence_path_equals_the_padded_path(dropout):
    """With host lengths the twin runs SDPA per sequence (no padding work); same function as the padded SDPA.
    With dropout the two draw different masks, so only the no-dropout case compares values."""
    lengths = [50, 0, 128, 7]
    q, k, v, do, cu = _packed(lengths, heads=2, dtype=torch.float64, seed=2)
    out, grads = grads_of(lambda q, k, v: varlen_attention_torch(q, k, v, cu, 128, dropout, seqlens=lengths),
                          [q, k, v], do)
    assert out.shape == q.shape and torch.isfinite(out).all()
    if dropout == 0.0:
        ref, ref_grads = grads_of(lambda q, k, v: varlen_attention_torch(q, k, v, cu, 128), [q, k, v], do)
        torch.testing.assert_close(out, ref)
        for g, rg in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, rg)
    with pytest.raises(ValueError, match="seqlens"):
        varlen_attention_torch(q, k, v, cu, 128, seqlens=[50, 0, 128, 6])


@pytest.mark.parametrize("host_lengths", [False, True], ids=["padded", "per-sequence"])
def test_torch_twin_tokens_do_not_see_other_sequences(host_lengths):
    q, k, v, _, cu = _packed([10, 20], heads=1, dtype=torch.float32)
    seqlens = [10, 20] if host_lengths else None
    base = varlen_attention_torch(q, k, v, cu, 20, seqlens=seqlens)
    k2, v2 = k.clone(), v.clone()
    k2[10:] += 5.0  # change only the second sequence's keys and values
    v2[10:] -= 3.0
    changed = varlen_attention_torch(q, k2, v2, cu, 20, seqlens=seqlens)
    torch.testing.assert_close(changed[:10], base[:10], rtol=0, atol=0)
    assert not torch.allclose(changed[10:], base[10:])


def test_torch_twin_matches_padded_sdpa_with_a_larger_max_seqlen():
    """max_seqlen may exceed the longest sequence (a fixed bucket): same result."""
    q, k, v, _, cu = _packed([30, 7], heads=2, dtype=torch.float32)
    torch.testing.assert_close(varlen_attention_torch(q, k, v, cu, 30), varlen_attention_torch(q, k, v, cu, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("lengths", [[128, 77, 5, 1], [100, 31, 64, 33]], ids=["seq128-mixed", "partial-blocks"])
def test_triton_matches_twin(dtype, lengths):
    q, k, v, do, cu = _packed(lengths, heads=2, dtype=dtype, seed=len(lengths) + lengths[1])
    out, grads = grads_of(lambda q, k, v: varlen_attention(q, k, v, cu, max(lengths), backend="triton"), [q, k, v], do)
    ref, ref_grads = grads_of(lambda q, k, v: varlen_attention_torch(q, k, v, cu, max(lengths)),
                              [q.float(), k.float(), v.float()], do.float())
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    assert_matches_twin(out.float(), ref, dtype, FP32_TOL, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert g.dtype == dtype
        assert_matches_twin(g.float(), rg, dtype, FP32_TOL, name)


def test_triton_seq512_bucket_bf16():
    lengths = [512, 300, 129]
    assert varlen_block_config(512) is not varlen_block_config(128)
    q, k, v, do, cu = _packed(lengths, heads=1, dtype=torch.bfloat16, seed=5)
    out, grads = grads_of(lambda q, k, v: varlen_attention(q, k, v, cu, 512, backend="triton"), [q, k, v], do)
    ref, ref_grads = grads_of(lambda q, k, v: varlen_attention_torch(q, k, v, cu, 512),
                              [q.float(), k.float(), v.float()], do.float())
    assert_matches_twin(out.float(), ref, torch.bfloat16, FP32_TOL, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert_matches_twin(g.float(), rg, torch.bfloat16, FP32_TOL, name)


def test_triton_head_split_layout_and_empty_sequence():
    """q, k, v as views out of a (T, 3, nh, hd) projection (non-contiguous), and a zero-length sequence."""
    gen = torch.Generator().manual_seed(3)
    lengths = [40, 0, 17]
    qkv = torch.randn(sum(lengths), 3, 2, HEAD_DIM, generator=gen)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, 40, 40, 57], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, 40, backend="triton")
    torch.testing.assert_close(out, varlen_attention_torch(q, k, v, cu, 40), **FP32_TOL)


def test_torch_twin_with_dropout_runs():
    q, k, v, _, cu = _packed([8, 4], heads=1, dtype=torch.float32)
    torch.manual_seed(0)
    got = varlen_attention(q, k, v, cu, 8, dropout_p=0.5, backend="torch")
    assert got.shape == q.shape and torch.isfinite(got).all()


def test_bad_shapes_are_refused_with_the_shapes_named():
    q, k, v, _, cu = _packed([8, 4], heads=1, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\(T, nh, hd\)"):
        varlen_attention_torch(q, k[:5], v, cu, 8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention_torch(q, k, v, cu.float(), 8)



def test_block_size_buckets_change_only_rounding(monkeypatch):
    """The per-length block sizes are a speed choice: every bucket's configuration gives the same result (fp32) on
    the same batch, forward and backward."""
    import bert_ds.kernels.attention_varlen as varlen

    lengths = [100, 31, 64]
    q, k, v, do, cu = _packed(lengths, heads=2, dtype=torch.float32, seed=11)
    results = []
    for bucket, config in varlen.VARLEN_ATTENTION_CONFIGS.items():
        monkeypatch.setattr(varlen, "varlen_block_config", lambda max_seqlen, config=config: config)
        results.append((bucket, *grads_of(lambda q, k, v: varlen_attention(q, k, v, cu, 100, backend="triton"),
                                          [q, k, v], do)))
    (_, out0, grads0), *others = results
    # Block sizes change the order of fp32 sums over at most max(lengths) = 100 keys: a rounding difference of order
    # eps * sqrt(100) of each tensor's scale. Bound: 10x that, per tensor (measured 3.3 eps normwise, 5.5 eps at the
    # largest element, 2026-11-25; elementwise 1e-5 tolerances had been at 96% of their bound). A configuration that
    # loses or repeats a block changes whole rows: O(1) relative, ~1e5x beyond.
    bound = 10 * max(lengths) ** 0.5
    for bucket, out, grads in others:
        for name, g, g0 in zip(("out", "dq", "dk", "dv"), (out, *grads), (out0, *grads0), strict=True):
            norm, peak = rounding_error(g, g0, torch.float32)
            assert norm <= bound and peak <= bound, f"bucket {bucket} {name}: {norm:.1f}, {peak:.1f} eps > {bound}"
    assert len(results) == len(varlen.VARLEN_ATTENTION_CONFIGS) >= 2
