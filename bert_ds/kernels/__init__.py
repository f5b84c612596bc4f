"""Fused kernels for BERT, each beside its plain-torch twin, behind a small backend registry.

``layer_norm`` (optionally with the residual add), ``bias_gelu`` (erf GELU), ``attention``
(FlashAttention-style, key-padding mask) and ``varlen_attention`` (the same on unpadded tokens) take
``backend`` in :data:`BACKENDS`: ``auto`` picks Triton on CUDA tensors where it was measured faster than the twin
(:data:`.registry.AUTO_TRITON_ON_CUDA`: varlen attention in bf16/fp16) and torch elsewhere (one warning off CUDA),
``triton``/``torch``/``apex`` are explicit and raise when they cannot run.
``TRITON_INTERPRET=1`` lets explicit ``triton`` run on CPU tensors (how the tests check the kernels).
Both Triton attentions apply attention dropout in the kernels (Philox keep-mask keyed by torch's RNG,
:mod:`.dropout`), so dropout never changes the choice.
"""

from __future__ import annotations

import torch
from torch import nn

from bert_ds.errors import BadInput

from .attention import attention_torch, attention_triton
from .attention_varlen import varlen_attention_torch, varlen_attention_triton
from .bias_gelu import bias_gelu_torch, bias_gelu_triton
from .layer_norm import layer_norm_apex, layer_norm_torch, layer_norm_triton
from .registry import BACKENDS, resolve_backend

__all__ = ["BACKENDS", "LayerNorm", "attention", "bias_gelu", "layer_norm", "resolve_backend",
           "varlen_attention"]

_LAYER_NORM = {"triton": layer_norm_triton, "torch": layer_norm_torch, "apex": layer_norm_apex}
_BIAS_GELU = {"triton": bias_gelu_triton, "torch": bias_gelu_torch}
_ATTENTION = {"triton": attention_triton, "torch": attention_torch}
_VARLEN_ATTENTION = {"triton": varlen_attention_triton, "torch": varlen_attention_torch}


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """``LayerNorm(x + residual)`` over the last dim (residual optional)."""
    return _LAYER_NORM[resolve_backend("layer_norm", backend, x.device, x.dtype)](x, weight, bias, eps, residual)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Exact (erf) GELU of ``x + bias``; x (..., N), bias (N,)."""
    return _BIAS_GELU[resolve_backend("bias_gelu", backend, x.device, x.dtype)](x, bias)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, backend: str = "auto") -> torch.Tensor:
    """Softmax attention, scale 1/sqrt(hd): q, k, v (B, nh, S, hd) -> (B, nh, S, hd).

    ``key_padding_mask`` (B, S) bool, True = real token. Padded query rows are finite but arbitrary.
    """
    return _ATTENTION[resolve_backend("attention", backend, q.device, q.dtype)](q, k, v, key_padding_mask, dropout_p)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     dropout_p: float = 0.0, backend: str = "auto", seqlens=None) -> torch.Tensor:
    """Softmax attention within each sequence of packed tokens: q, k, v (T, nh, hd) -> (T, nh, hd).

    ``cu_seqlens`` (B + 1,) int: sequence b owns rows cu_seqlens[b]:cu_seqlens[b + 1]; ``max_seqlen`` >= the
    longest; ``seqlens`` optional host copy of the lengths (the torch path then runs per sequence). See
    :mod:`.attention_varlen`.
    """
    chosen = resolve_backend("varlen_attention", backend, q.device, q.dtype)
    return _VARLEN_ATTENTION[chosen](q, k, v, cu_seqlens, max_seqlen, dropout_p, seqlens)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with an optional fused residual; state_dict matches ``nn.LayerNorm``."""

    def __init__(self, hidden_size: int, eps: float = 1e-12, backend: str = "auto") -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise BadInput(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.backend = backend
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, residual, self.backend)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}, backend={self.backend!r}"
