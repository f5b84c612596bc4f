"""The batch contract: the one definition of what a training or eval micro batch holds.

The loader produces it (:mod:`bert_ds.data.collate`), the trainer, evaluation, the benchmarks and the tests consume
it; all of them take the field names, shapes and dtype from here. Every field is an int64 tensor whose shape is
written in three sizes: ``B`` rows, ``S`` = the shard set's ``seq_len``, ``P`` = prediction slots per row
(``max_predictions``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from bert_ds.config import IGNORE_INDEX  # the label of unused prediction slots, part of this contract

__all__ = ["BATCH_DTYPE", "BATCH_FIELDS", "BATCH_KEYS", "IGNORE_INDEX", "MODEL_INPUTS", "check_batch"]

BATCH_FIELDS: dict[str, tuple[str, ...]] = {
    "input_ids": ("B", "S"),  # token ids, 0 after the pair's length
    "token_type_ids": ("B", "S"),  # 0 for [CLS] A [SEP], 1 for B [SEP], 0 on padding
    "attention_mask": ("B", "S"),  # 1 on the pair's tokens
    "masked_lm_positions": ("B", "P"),  # positions of the predicted tokens, ascending, 0 on unused slots
    "masked_lm_ids": ("B", "P"),  # their original ids, IGNORE_INDEX on unused slots
    "next_sentence_label": ("B",),  # 0 IsNext, 1 NotNext
    "lengths": ("B",),  # the pair's true length
}
"""Field -> shape, in the order the collator packs them."""

BATCH_KEYS = tuple(BATCH_FIELDS)
MODEL_INPUTS = tuple(k for k in BATCH_KEYS if k != "lengths")
"""What :class:`bert_ds.model.BertForPreTraining` takes, in its argument order (``lengths`` is the loader's)."""
BATCH_DTYPE = torch.int64


def check_batch(batch: Mapping[str, torch.Tensor], *, seq_len: int | None = None,
                max_predictions: int | None = None) -> dict[str, int]:
    """Check ``batch`` against the contract (every field, nothing else, int64, shapes agreeing on B, S, P, and S and P
    equal to ``seq_len`` / ``max_predictions`` when given); returns the sizes ``{"B": .., "S": .., "P": ..}``.
    A ValueError names the first field that breaks it."""
    if set(batch) != set(BATCH_FIELDS):
        raise ValueError(f"batch: fields {sorted(batch)}, expected {sorted(BATCH_FIELDS)}")
    sizes: dict[str, int] = {}
    if seq_len is not None:
        sizes["S"] = seq_len
    if max_predictions is not None:
        sizes["P"] = max_predictions
    for name, dims in BATCH_FIELDS.items():
        value = batch[name]
        if not isinstance(value, torch.Tensor) or value.dtype != BATCH_DTYPE:
            raise ValueError(f"batch field '{name}': {getattr(value, 'dtype', type(value).__name__)}, expected "
                             f"{BATCH_DTYPE}")
        if value.dim() != len(dims):
            raise ValueError(f"batch field '{name}': shape {tuple(value.shape)}, expected ({', '.join(dims)})")
        for dim, size in zip(dims, value.shape, strict=True):
            if sizes.setdefault(dim, int(size)) != size:
                raise ValueError(f"batch field '{name}': shape {tuple(value.shape)}, expected ({', '.join(dims)}) "
                                 f"with {dim}={sizes[dim]}")
    return sizes
