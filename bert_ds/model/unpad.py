"""Unpadding: the encoder computes on the batch's real tokens only (MosaicBERT; FlashAttention-2's varlen layout).

A (B, S) batch with an attention mask becomes T packed token rows, one sequence after another in batch order; every
per-token op (embeddings, projections, LayerNorm, feed-forward) then costs T rows instead of B * S, and attention
runs per sequence through :func:`bert_ds.kernels.varlen_attention`. Each token keeps its own position id (its
column in the padded batch) and segment id, and attends exactly to the real tokens of its own row, as the key-padding
mask makes it do in the padded layout; so the unpadded model computes the same function (tests/model/test_unpad.py).

The sequence lengths must be known on the host to size the packed tensors and the launch grid, and to let the CPU
attention run per sequence; :func:`host_counts` reads them with the label counts, and :func:`plan` builds everything
else without a sync (``torch.nonzero_static``). The trainer calls :func:`host_counts` on the loader's CPU batch
before it moves to the device, so a training step adds no device-to-host sync at all; a caller that passes device
tensors alone gets one copy per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bert_ds.config import IGNORE_INDEX

__all__ = ["HostCounts", "Unpadding", "host_counts", "plan"]


@dataclass(frozen=True)
class Unpadding:
    """Where the real tokens of a (B, S) batch sit, and their packed layout."""

    indices: torch.Tensor
    """(T,) int64: flat positions (b * S + s) of the real tokens, row-major."""
    cu_seqlens: torch.Tensor
    """(B + 1,) int32: sequence b owns packed rows cu_seqlens[b]:cu_seqlens[b + 1]."""
    max_seqlen: int
    """Real tokens in the longest row (at least 1, even when every row is empty)."""
    seqlens: tuple[int, ...]
    """Real tokens per row, on the host."""
    row_of_position: torch.Tensor
    """(B * S,) int64: the packed row of each padded position (-1 at padding)."""
    seq_len: int
    """S, the padded length."""

    @property
    def total(self) -> int:
        return int(self.indices.numel())

    def positions(self) -> torch.Tensor:
        """(T,) position ids: each token's column in the padded batch."""
        return self.indices % self.seq_len

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (T, ...): the real tokens' entries."""
        return t.reshape(-1, *t.shape[2:]).index_select(0, self.indices)

    def rows_at(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, Q) padded positions (each a real token) -> (B, Q) packed row indices."""
        flat = positions + torch.arange(positions.shape[0], device=positions.device)[:, None] * self.seq_len
        return self.row_of_position[flat]


@dataclass(frozen=True)
class HostCounts:
    """What the unpadded forward must know on the host about a batch."""

    seqlens: tuple[int, ...]
    """Real tokens per row."""
    num_valid: int
    """Masked-LM labels that are not IGNORE_INDEX."""
    width: int
    """Prediction slots up to the last valid label of any row: slots after it are padding in every row."""


def host_counts(attention_mask: torch.Tensor, masked_lm_ids: torch.Tensor,
                ignore_index: int = IGNORE_INDEX) -> HostCounts:
    """The batch's :class:`HostCounts` in one device-to-host copy (none for CPU tensors)."""
    lengths = attention_mask.bool().sum(1)
    valid = masked_lm_ids != ignore_index
    slots = torch.arange(1, valid.shape[1] + 1, device=valid.device)
    last = (valid * slots).max() if valid.numel() else torch.zeros((), dtype=torch.long, device=valid.device)
    values = torch.cat([lengths, valid.sum().reshape(1).to(lengths.dtype), last.reshape(1).to(lengths.dtype)])
    values = values.tolist()
    return HostCounts(seqlens=tuple(values[:-2]), num_valid=values[-2], width=values[-1])


def plan(attention_mask: torch.Tensor, seqlens: tuple[int, ...] | list[int]) -> Unpadding:
    """The packed layout of ``attention_mask`` (B, S), given its row lengths from :func:`host_counts`."""
    mask = attention_mask.bool()
    flat = mask.reshape(-1)
    indices = torch.nonzero_static(flat, size=sum(seqlens)).squeeze(1)
    cu_seqlens = F.pad(mask.sum(1).cumsum(0), (1, 0)).to(torch.int32)
    row_of_position = torch.where(flat, flat.long().cumsum(0) - 1, -1)
    return Unpadding(indices=indices, cu_seqlens=cu_seqlens, max_seqlen=max([1, *seqlens]),
                     seqlens=tuple(int(n) for n in seqlens), row_of_position=row_of_position, seq_len=mask.shape[1])
