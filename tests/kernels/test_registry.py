"""Backend registry: auto fallback warns once, explicit impossible requests raise, stock LayerNorm layout."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from bert_ds.kernels import BACKENDS, LayerNorm, attention, bias_gelu, layer_norm, resolve_backend
from bert_ds.kernels.layer_norm import apex_available

CPU = torch.device("cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_listed_backend_is_understood(backend):
    # Each name the registry advertises either resolves to a concrete implementation or is refused as unavailable
    # here (RuntimeError) — never as an unknown name (ValueError).
    try:
        resolved = resolve_backend("layer_norm", backend, CPU)
    except RuntimeError:
        return
    assert resolved in ("triton", "torch", "apex")


@pytest.mark.parametrize("version", ["3.8.0", "3.10.0", "4.0.1", "garbage"])
def test_unsupported_triton_is_refused_explicitly_and_auto_falls_back(version, monkeypatch, fresh_warnings):
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    with pytest.raises(RuntimeError, match=r"triton.*3\.9"):
        resolve_backend("attention", "triton", CPU)
    with pytest.warns(RuntimeWarning, match="falls back"):
        assert resolve_backend("varlen_attention", "auto", torch.device("cuda"), torch.bfloat16) == "torch"


def test_supported_triton_version_passes():
    from bert_ds.kernels.jit import triton_version_problem

    assert triton_version_problem() is None  # the installed one (setup.cfg pins the supported range)
    assert triton_version_problem("3.9.7") is None
    assert "3.9" in triton_version_problem("3.11.0")


@pytest.mark.parametrize("op", ["layer_norm", "bias_gelu", "attention"])
def test_auto_falls_back_on_cpu_with_exactly_one_warning(op, fresh_warnings):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert [resolve_backend(op, "auto", CPU) for _ in range(3)] == ["torch"] * 3
    fallback = [w for w in record if issubclass(w.category, RuntimeWarning) and op in str(w.message)]
    assert len(fallback) == 1


def test_auto_ops_run_on_cpu_and_match_the_definitions(fresh_warnings):
    # On CPU "auto" resolves to the torch twin, so comparing it with backend="torch" would compare a function with
    # itself. Compare with the definitions instead, written out here in float64: LayerNorm (biased variance), exact
    # (erf) GELU of x + b, softmax(q k^T / sqrt(d)) v.
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=g) for shape in ((4, 8), (8,), (8,)))
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    xd = x.double()
    mean, var = xd.mean(-1, keepdim=True), xd.var(-1, unbiased=False, keepdim=True)
    want_ln = (xd - mean) / torch.sqrt(var + 1e-12) * w.double() + b.double()
    h = xd + b.double()
    want_gelu = 0.5 * h * (1 + torch.erf(h / 2**0.5))
    scores = q.double() @ k.double().transpose(-1, -2) / 8**0.5
    want_attn = torch.softmax(scores, dim=-1) @ v.double()
    with pytest.warns(RuntimeWarning):
        got_ln, got_gelu, got_attn = layer_norm(x, w, b, 1e-12), bias_gelu(x, b), attention(q, k, v)
    for got, want in ((got_ln, want_ln), (got_gelu, want_gelu), (got_attn, want_attn)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


CUDA = torch.device("cuda")


def test_auto_on_cuda_picks_triton_only_where_it_was_measured_faster(recwarn, fresh_warnings):
    # AUTO_TRITON_ON_CUDA: varlen attention in bf16/fp16 (1.7-1.85x its twin on an H100); padded attention, LayerNorm
    # and bias-GELU were slower than their twins (0.40-0.90x), so auto gives them the twin, without a warning.
    for dtype in (torch.bfloat16, torch.float16):
        assert resolve_backend("varlen_attention", "auto", CUDA, dtype) == "triton"
        for op in ("layer_norm", "bias_gelu", "attention"):
            assert resolve_backend(op, "auto", CUDA, dtype) == "torch"
            assert resolve_backend(op, "triton", CUDA, dtype) == "triton"  # explicit still runs Triton
    assert resolve_backend("layer_norm", "auto", CUDA, torch.float32) == "torch"
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("op", ["attention", "varlen_attention"])
def test_fp32_attention_on_cuda_is_sdpa_under_auto_and_refused_under_triton(op, fresh_warnings):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert [resolve_backend(op, "auto", CUDA, torch.float32) for _ in range(3)] == ["torch"] * 3
    assert len([w for w in record if "IEEE fp32" in str(w.message)]) == 1
    with pytest.raises(RuntimeError, match="fp32 CUDA tensors.*no tensor cores"):
        resolve_backend(op, "triton", CUDA, torch.float32)
    # The fp32 layer norm and bias-GELU builds do not spill (bert-ds-kernel-report): explicit Triton runs them.
    assert resolve_backend("layer_norm", "triton", CUDA, torch.float32) == "triton"


def test_recorded_launches_resolve_as_on_cuda(fresh_warnings):
    # bert_ds.kernels.aot records what a GPU would launch: inside record_launches CPU tensors count as CUDA ones.
    from bert_ds.kernels.jit import record_launches

    with record_launches():
        assert resolve_backend("varlen_attention", "auto", CPU, torch.bfloat16) == "triton"
        assert resolve_backend("attention", "auto", CPU, torch.bfloat16) == "torch"
        with pytest.raises(RuntimeError, match="fp32 CUDA"):
            resolve_backend("attention", "triton", CPU, torch.float32)


def test_explicit_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        resolve_backend("layer_norm", "triton", CPU)


def test_explicit_triton_on_cpu_with_interpreter_resolves(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("bias_gelu", "triton", CPU) == "triton"


@pytest.mark.skipif(apex_available(), reason="NVIDIA apex is installed here")
def test_explicit_apex_missing_raises():
    with pytest.raises(RuntimeError, match="apex"):
        resolve_backend("layer_norm", "apex", torch.device("cuda"))
    with pytest.raises(RuntimeError, match="apex"):
        layer_norm(torch.randn(2, 8), torch.ones(8), torch.zeros(8), 1e-12, backend="apex")


@pytest.mark.parametrize("op", ["bias_gelu", "attention"])
def test_apex_only_for_layer_norm(op):
    with pytest.raises(ValueError, match="only available for layer_norm"):
        resolve_backend(op, "apex", torch.device("cuda"))


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("layer_norm", "cudnn", CPU)
    with pytest.raises(ValueError, match="op"):
        resolve_backend("softmax", "auto", CPU)
    with pytest.raises(ValueError, match="backend"):
        LayerNorm(8, backend="fast")


def test_layer_norm_module_has_stock_state_dict():
    ours, stock = LayerNorm(768, eps=1e-12, backend="torch"), nn.LayerNorm(768, eps=1e-12)
    assert list(ours.state_dict()) == list(stock.state_dict()) == ["weight", "bias"]
    nn.init.normal_(stock.weight)
    nn.init.normal_(stock.bias)
    ours.load_state_dict(stock.state_dict())
    x, r = torch.randn(3, 5, 768), torch.randn(3, 5, 768)
    torch.testing.assert_close(ours(x), stock(x))
    torch.testing.assert_close(ours(x, residual=r), stock(x + r))


def test_layer_norm_module_triton_backend_under_interpreter():
    ours, stock = LayerNorm(96, backend="triton"), nn.LayerNorm(96, eps=1e-12)
    x = torch.randn(2, 7, 96)
    torch.testing.assert_close(ours(x), stock(x), atol=1e-5, rtol=1e-5)
