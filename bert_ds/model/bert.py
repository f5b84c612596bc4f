"""BERT for pre-training (Devlin et al., 2019) on a single device.

``BertForPreTraining`` holds the encoder (``bert``) and the heads (``cls``) under Hugging Face's names. Its
``forward`` is the training contract: the MLM head runs only on the valid masked positions (gathered before the
transform, as NVIDIA's and DeepSpeed's BERT do), which saves the (B, S, vocab) logits that dominate the head's cost;
and the last encoder layer computes only the rows the heads read ([CLS] and the masked positions) once its keys and
values exist. The encoder runs on the real tokens only (``unpad``, :mod:`bert_ds.model.unpad`): no compute on
padding, attention per sequence. All three are exact: ``logits`` (all positions) and ``forward`` agree with
transformers to fp32 rounding, and ``forward`` unpadded with ``forward`` padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bert_ds.config import IGNORE_INDEX, BertConfig
from bert_ds.errors import BadInput
from bert_ds.kernels import BACKENDS
from bert_ds.model import unpad as unpad_
from bert_ds.model.heads import BertPreTrainingHeads
from bert_ds.model.layers import BertEmbeddings, BertEncoder, BertPooler
from bert_ds.model.unpad import HostCounts, Unpadding

__all__ = ["BertModel", "BertForPreTraining", "PretrainingOutput", "KERNEL_CHOICES"]

KERNEL_CHOICES = BACKENDS
"""``apex`` only exists for LayerNorm; with it, bias+GELU and attention run ``auto``."""


@dataclass
class PretrainingOutput(dict):
    """Losses, accuracies and the exact counts behind them (sum the counts to aggregate over batches/ranks).

    Also a ``dict`` of the same fields, kept in sync both ways (as HF's ``ModelOutput``): DeepSpeed ZeRO-3 finds a
    module's output tensors only in tensors, tuples, lists and dicts, and swaps them in place through
    ``__setitem__`` to attach its backward hooks."""

    loss: torch.Tensor
    """mlm_loss + nsp_loss (mlm_loss alone when there are no NSP labels)."""
    mlm_loss: torch.Tensor
    """Mean cross-entropy over the valid masked positions of the batch."""
    nsp_loss: torch.Tensor | None
    mlm_accuracy: torch.Tensor
    nsp_accuracy: torch.Tensor | None
    mlm_correct: torch.Tensor
    mlm_total: torch.Tensor
    nsp_correct: torch.Tensor
    """0 when there are no NSP labels."""
    nsp_total: torch.Tensor

    def __setitem__(self, key: str, value) -> None:
        dict.__setitem__(self, key, value)
        object.__setattr__(self, key, value)

    def __setattr__(self, key: str, value) -> None:
        object.__setattr__(self, key, value)
        dict.__setitem__(self, key, value)


class BertModel(nn.Module):
    """Embeddings -> L post-LN layers -> pooler. Named ``bert`` inside :class:`BertForPreTraining`."""

    def __init__(self, config: BertConfig, backend: str = "auto", activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config, backend)
        self.encoder = BertEncoder(config, backend, activation_checkpointing)
        self.pooler = BertPooler(config)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor,
                output_hidden_states: bool = False, last_layer_positions: torch.Tensor | None = None,
                unpadding: Unpadding | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the sequence output (B, S, H), or (B, Q, H) at ``last_layer_positions`` (B, Q), and, if asked,
        the L + 1 hidden states (embeddings first). With ``unpadding`` (:func:`bert_ds.model.unpad.plan` of
        ``attention_mask``) the encoder computes the real tokens only, and full outputs are (T, H) packed rows."""
        key_padding_mask = attention_mask.bool()  # (B, S) True = real token, may be attended to
        x = self.embeddings(input_ids, token_type_ids, unpadding)
        return self.encoder(x, key_padding_mask, output_hidden_states, last_layer_positions, unpadding)


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM and next-sentence heads.

    Args:
        config: model shape; ``padded_vocab_size`` rows for the word embeddings and the MLM output bias.
        kernels: fused-op backend for LayerNorm, bias+GELU and attention (``auto``, ``triton``, ``torch``, ``apex``);
            the parameters are the same whichever runs.
        activation_checkpointing: recompute each encoder layer in the backward pass (saves activation memory).
        unpad: ``forward`` computes the encoder on the real tokens only (same result; False keeps the padded
            layout, the reference the tests compare against).
    """

    def __init__(self, config: BertConfig, kernels: str = "auto", activation_checkpointing: bool = False,
                 unpad: bool = True) -> None:
        super().__init__()
        if kernels not in KERNEL_CHOICES:
            raise BadInput(f"kernels={kernels!r}: choose one of {KERNEL_CHOICES}")
        self.config = config
        self.unpad = unpad
        self.bert = BertModel(config, kernels, activation_checkpointing)
        self.cls = BertPreTrainingHeads(config, kernels)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """normal(0, initializer_range) weights as HF does (Google's TF code truncates at 2 sigma), zero biases,
        LayerNorm 1/0; the vocabulary padding rows are zero."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.normal_(0.0, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif hasattr(module, "weight") and hasattr(module, "bias") and module.weight.dim() == 1:
                module.weight.fill_(1.0)  # LayerNorm (any backend's module)
                module.bias.zero_()
        self.bert.embeddings.word_embeddings.weight[self.config.vocab_size:].zero_()  # padding rows: never used
        self.cls.predictions.bias.zero_()

    @property
    def activation_checkpointing(self) -> bool:
        return self.bert.encoder.activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, value: bool) -> None:
        self.bert.encoder.activation_checkpointing = bool(value)

    def _mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cls.predictions(hidden, self.bert.embeddings.word_embeddings.weight)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor,
                masked_lm_positions: torch.Tensor, masked_lm_ids: torch.Tensor,
                next_sentence_label: torch.Tensor | None = None, counts: HostCounts | None = None) -> PretrainingOutput:
        """Training/eval step. Shapes: ids/segments/mask (B, S); masked_lm_positions and masked_lm_ids (B, P),
        padded with position 0 / label IGNORE_INDEX; next_sentence_label (B,) or None for MLM-only recipes. ``counts``:
        :func:`bert_ds.model.unpad.host_counts` of the batch, computed before it moved to the device (saves the
        forward's one device-to-host copy); masked positions must be real tokens (the loader checks them)."""
        valid = masked_lm_ids != IGNORE_INDEX  # (B, P)
        # The heads read only [CLS] (pooler) and the masked positions, so the last layer computes just those rows
        # after its keys/values: (B, 1 + P, H). Padding slots point at position 0 and are dropped below.
        unpadding = None
        if self.unpad:
            if counts is None:  # one device-to-host copy: sizes of the packed tokens and of the labels
                counts = unpad_.host_counts(attention_mask, masked_lm_ids, IGNORE_INDEX)
            unpadding = unpad_.plan(attention_mask, counts.seqlens)
            # Slots after the last valid label in every row are padding in every row: not computed at all.
            width = counts.width
            masked_lm_positions, masked_lm_ids, valid = (t[:, :width] for t in (masked_lm_positions, masked_lm_ids,
                                                                                valid))
            chosen = torch.nonzero_static(valid.reshape(-1), size=counts.num_valid).squeeze(1)
        else:
            chosen = valid.reshape(-1).nonzero().squeeze(1)
        cls_position = torch.zeros_like(masked_lm_positions[:, :1])
        query_positions = torch.cat([cls_position, masked_lm_positions.masked_fill(~valid, 0)], dim=1)
        rows, _ = self.bert(input_ids, token_type_ids, attention_mask, last_layer_positions=query_positions,
                            unpadding=unpadding)

        # The MLM head runs on the valid masked positions only: (N, H), N = number of labels != IGNORE_INDEX.
        labels = masked_lm_ids.reshape(-1)[chosen]  # (N,)
        mlm_logits = self._mlm_logits(rows[:, 1:].reshape(-1, rows.shape[-1])[chosen])  # (N, vocab_size)

        mlm_total = valid.sum()
        # Sum / count rather than mean: an all-padding batch gives loss 0 (not NaN) and still back-propagates.
        mlm_loss = F.cross_entropy(mlm_logits.float(), labels, reduction="sum") / mlm_total.clamp(min=1)
        mlm_correct = (mlm_logits.argmax(-1) == labels).sum()
        mlm_accuracy = mlm_correct.float() / mlm_total.clamp(min=1)

        if next_sentence_label is None:
            zero = torch.zeros((), dtype=torch.long, device=input_ids.device)
            return PretrainingOutput(loss=mlm_loss, mlm_loss=mlm_loss, nsp_loss=None, mlm_accuracy=mlm_accuracy,
                                     nsp_accuracy=None, mlm_correct=mlm_correct, mlm_total=mlm_total,
                                     nsp_correct=zero, nsp_total=zero)

        nsp_logits = self.cls.seq_relationship(self.bert.pooler(rows))  # (B, 2): the pooler reads row 0, [CLS]
        nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label)
        nsp_correct = (nsp_logits.argmax(-1) == next_sentence_label).sum()
        nsp_total = torch.tensor(next_sentence_label.numel(), device=input_ids.device)
        return PretrainingOutput(loss=mlm_loss + nsp_loss, mlm_loss=mlm_loss, nsp_loss=nsp_loss,
                                 mlm_accuracy=mlm_accuracy, nsp_accuracy=nsp_correct.float() / nsp_total,
                                 mlm_correct=mlm_correct, mlm_total=mlm_total,
                                 nsp_correct=nsp_correct, nsp_total=nsp_total)

    def logits(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
               attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full logits for verification: MLM (B, S, vocab_size) over the real vocabulary and NSP (B, 2)."""
        sequence_output, _ = self.bert(input_ids, token_type_ids, attention_mask)
        return self._mlm_logits(sequence_output), self.cls.seq_relationship(self.bert.pooler(sequence_output))

    def hidden_states(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor,
                      layers: Sequence[int] = (-1, -2, -3, -4), concat: bool = True) -> torch.Tensor | list:
        """Feature-based use (paper §5.3): the chosen encoder outputs, indexed like HF's ``hidden_states``
        (0 = embeddings, -1 = last layer). ``concat`` joins them on the feature axis: (B, S, len(layers) * H),
        the paper's best NER feature with the default last four; otherwise a list of (B, S, H)."""
        _, states = self.bert(input_ids, token_type_ids, attention_mask, output_hidden_states=True)
        chosen = []
        for index in layers:
            if not -len(states) <= index < len(states):
                raise BadInput(f"layers: index {index} out of range for {len(states)} hidden states "
                               f"(embeddings + {len(states) - 1} layers)")
            chosen.append(states[index])
        return torch.cat(chosen, dim=-1) if concat else chosen
