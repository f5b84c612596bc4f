"""The BERT encoder stack: embeddings, post-LN transformer layers, pooler.

Module and parameter names follow Hugging Face ``BertForPreTraining`` exactly, so a state dict exports with an
identity name map. Fused ops come from :mod:`bert_ds.kernels` and keep the stock parameter layout: a fused op only
changes how ``weight``/``bias`` are consumed, never what they are called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from bert_ds import kernels
from bert_ds.config import BertConfig
from bert_ds.model.unpad import Unpadding

__all__ = ["BertEmbeddings", "BertLayer", "BertEncoder", "BertPooler", "non_layer_norm_backend"]


def non_layer_norm_backend(backend: str) -> str:
    """The backend for bias+GELU and attention: ``apex`` only has a LayerNorm, so those ops use ``auto`` then."""
    return "auto" if backend == "apex" else backend


class BertEmbeddings(nn.Module):
    """word + learned position + segment embeddings, then LayerNorm and dropout (paper §3, Figure 2)."""

    def __init__(self, config: BertConfig, backend: str) -> None:
        super().__init__()
        # Padded rows (``padded_vocab_size - vocab_size``) are never looked up and are trimmed on export.
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = kernels.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, backend=backend)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                unpadding: Unpadding | None = None) -> torch.Tensor:
        """(B, S, H); with ``unpadding``, (T, H) for the real tokens only, each at its own position id."""
        if unpadding is not None:
            x = self.word_embeddings(unpadding.gather(input_ids)) + self.token_type_embeddings(
                unpadding.gather(token_type_ids))
            return self.dropout(self.LayerNorm(x + self.position_embeddings(unpadding.positions())))
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(seq_len, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)  # (B, S, H)
        x = x + self.position_embeddings(position_ids)  # (S, H) broadcast over the batch
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig, backend: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.dropout_p = config.attention_probs_dropout_prob
        self.backend = non_layer_norm_backend(backend)
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor, queries: torch.Tensor | None = None,
                unpadding: Unpadding | None = None) -> torch.Tensor:
        """x (B, S, H) -> (B, S, H); with ``queries`` (B, Q, H), rows of x, only those rows attend: (B, Q, H).
        With ``unpadding``, x is the (T, H) packed real tokens: (T, H) out, or (B, Q, H) for ``queries``."""
        if unpadding is not None:
            return self._forward_unpadded(x, key_padding_mask, queries, unpadding)
        B, S, H = x.shape
        queries = x if queries is None else queries
        Q = queries.shape[1]
        # Three matmuls rather than one on concatenated weights: measured no faster on CPU, and the concatenation
        # would copy all three weights every step.
        q = self.query(queries).view(B, Q, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, Q, hd)
        k, v = (proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, S, hd)
                for proj in (self.key, self.value))
        # The Triton kernel needs as many queries as keys; a query subset runs the torch twin (SDPA).
        backend = self.backend if Q == S and queries is x else "torch"
        out = kernels.attention(q, k, v, key_padding_mask=key_padding_mask,
                                dropout_p=self.dropout_p if self.training else 0.0, backend=backend)
        return out.transpose(1, 2).reshape(B, Q, H)  # (B, nh, Q, hd) -> (B, Q, H)

    def _forward_unpadded(self, x: torch.Tensor, key_padding_mask: torch.Tensor, queries: torch.Tensor | None,
                          unpadding: Unpadding) -> torch.Tensor:
        T, H = x.shape
        dropout_p = self.dropout_p if self.training else 0.0
        k, v = (proj(x).view(T, self.num_heads, self.head_dim) for proj in (self.key, self.value))
        if queries is None:
            q = self.query(x).view(T, self.num_heads, self.head_dim)
            out = kernels.varlen_attention(q, k, v, unpadding.cu_seqlens, unpadding.max_seqlen, dropout_p,
                                           backend=self.backend, seqlens=unpadding.seqlens)
            return out.reshape(T, H)
        # A few query rows per sequence (the last layer) against their own sequence's keys: the packed keys and values
        # are put back in the padded layout and one masked SDPA serves the batch (a loop over sequences cost ~27
        # launches per sequence, more than the 24 layers at micro batch 64: bert_ds.devtools.launch_count).
        B, Q, _ = queries.shape
        S = unpadding.seq_len
        q = self.query(queries).view(B, Q, self.num_heads, self.head_dim).transpose(1, 2)  # (B, nh, Q, hd)
        k, v = (x.new_zeros(B * S, self.num_heads, self.head_dim).index_copy(0, unpadding.indices, t)
                .view(B, S, self.num_heads, self.head_dim).transpose(1, 2) for t in (k, v))  # (B, nh, S, hd)
        # A row without a real token attends to its all-zero padding: zeros out, as the padded path, not SDPA's NaN.
        mask = key_padding_mask | ~key_padding_mask.any(1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], dropout_p=dropout_p)
        return out.transpose(1, 2).reshape(B, Q, H)


class BertSelfOutput(nn.Module):
    """dense -> dropout -> LayerNorm(x + residual): the post-LN sublayer output (paper follows Vaswani et al.)."""

    def __init__(self, config: BertConfig, in_features: int, backend: str) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = kernels.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, backend=backend)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)), residual=residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig, backend: str) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, backend)
        self.output = BertSelfOutput(config, config.hidden_size, backend)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor, query_positions: torch.Tensor | None = None,
                unpadding: Unpadding | None = None) -> torch.Tensor:
        """``query_positions`` (B, Q) index x's rows: padded positions, or packed rows with ``unpadding``."""
        if query_positions is None:
            return self.output(self.self(x, key_padding_mask, unpadding=unpadding), x)
        if unpadding is not None:
            rows = x[query_positions]  # (B, Q, H) from the packed (T, H)
        else:
            rows = x.gather(1, query_positions.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, Q, H)
        return self.output(self.self(x, key_padding_mask, rows, unpadding), rows)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig, backend: str) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.backend = non_layer_norm_backend(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added inside the fused GELU: `dense` keeps its stock `weight`/`bias`.
        return kernels.bias_gelu(F.linear(x, self.dense.weight), self.dense.bias, backend=self.backend)


class BertLayer(nn.Module):
    """One post-LN transformer block: x = LN(x + Attn(x)); x = LN(x + FFN(x)).

    With ``query_positions`` (B, Q) only those positions are computed past the keys and values: every op after the
    attention is per token, so the rows are exactly the full layer's rows at those positions."""

    def __init__(self, config: BertConfig, backend: str) -> None:
        super().__init__()
        self.attention = BertAttention(config, backend)
        self.intermediate = BertIntermediate(config, backend)
        # HF calls the FFN output sublayer `output` (same structure as the attention output).
        self.output = BertSelfOutput(config, config.intermediate_size, backend)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor, query_positions: torch.Tensor | None = None,
                unpadding: Unpadding | None = None) -> torch.Tensor:
        x = self.attention(x, key_padding_mask, query_positions, unpadding)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, backend: str, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, backend) for _ in range(config.num_hidden_layers))
        self.activation_checkpointing = activation_checkpointing

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor, output_hidden_states: bool = False,
                last_layer_positions: torch.Tensor | None = None,
                unpadding: Unpadding | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the last hidden state and, if asked, all L + 1 hidden states (embeddings first, as HF).

        ``last_layer_positions`` (B, Q): the last layer computes only these positions (each a real token); its
        output is then (B, Q, H). With ``unpadding``, x and the hidden states are (T, H) packed real tokens.
        """
        if output_hidden_states and last_layer_positions is not None:
            raise ValueError("output_hidden_states needs every position of the last layer")
        if unpadding is not None and last_layer_positions is not None:
            last_layer_positions = unpadding.rows_at(last_layer_positions)
        hidden_states = [x] if output_hidden_states else []
        checkpointing = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        last = len(self.layer) - 1
        for index, layer in enumerate(self.layer):
            positions = last_layer_positions if index == last else None
            if checkpointing:
                # Non-reentrant checkpointing replays dropout with the saved RNG state: same grads as without.
                x = torch.utils.checkpoint.checkpoint(layer, x, key_padding_mask, positions, unpadding,
                                                      use_reentrant=False)
            else:
                x = layer(x, key_padding_mask, positions, unpadding)
            if output_hidden_states:
                hidden_states.append(x)
        return x, hidden_states


class BertPooler(nn.Module):
    """tanh(dense(h_[CLS])): the sentence representation the NSP head reads (paper §3.1)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, sequence_output: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(sequence_output[:, 0]))
