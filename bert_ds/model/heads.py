"""Pre-training heads: masked LM (transform + tied decoder + output bias) and next-sentence prediction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bert_ds import kernels
from bert_ds.config import BertConfig
from bert_ds.model.layers import non_layer_norm_backend

__all__ = ["BertLMPredictionHead", "BertPreTrainingHeads"]


class BertPredictionHeadTransform(nn.Module):
    """dense -> GELU -> LayerNorm, applied before the tied decoder (Google's modeling.py `transform`)."""

    def __init__(self, config: BertConfig, backend: str) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = kernels.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, backend=backend)
        self.backend = non_layer_norm_backend(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(kernels.bias_gelu(F.linear(x, self.dense.weight), self.dense.bias, backend=self.backend))


class BertLMPredictionHead(nn.Module):
    """Masked-LM head. The decoder has no parameter of its own: it is the word-embedding matrix (tied, paper §A.2
    via Google's code), plus this output-only ``bias``. Both carry ``padded_vocab_size`` rows; only the first
    ``vocab_size`` are ever used, so padding rows can never be predicted."""

    def __init__(self, config: BertConfig, backend: str) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config, backend)
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))
        self.vocab_size = config.vocab_size

    def forward(self, x: torch.Tensor, decoder_weight: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., vocab_size) logits over the real vocabulary."""
        v = self.vocab_size
        if decoder_weight.shape[0] == v:
            # No padding: no slice either, whose backward would zero-fill and copy a whole (V, H) gradient.
            return F.linear(self.transform(x), decoder_weight, self.bias)
        # Slicing the rows (a view) skips the padding rows' matmul work as well as their logits.
        return F.linear(self.transform(x), decoder_weight[:v], self.bias[:v])


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig, backend: str) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config, backend)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)
