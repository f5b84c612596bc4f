"""One BERT pre-training step on one device without DeepSpeed: what gpu-check times, profiles and resumes.

:class:`BenchStep` holds the model in the step dtype, fp32 master weights and a
:class:`~bert_ds.optim.lamb.ZeroAwareLamb` (weight decay 0.01 except biases and LayerNorm), as the engine's DeepSpeed
bf16 mode does on one rank: forward + backward in the model dtype, gradients into the masters, a LAMB step, weights
back. :func:`synthetic_batch` makes a batch of full-length sequences with the host counts the trainer computes before
a batch reaches the device (``bert_ds.runtime.trainer``), so no step pays the forward's device-to-host copy.
``state_dict`` / ``load_state_dict`` carry everything a resumed step needs (model, masters, optimizer moments and
step counts): the golden-resume item saves and restores through them.
"""

from __future__ import annotations

import torch

from bert_ds.config import BertConfig
from bert_ds.model.unpad import host_counts

__all__ = ["PREDICTIONS", "BenchStep", "predictions_for", "synthetic_batch"]

PREDICTIONS = {128: 20, 512: 80}  # max_predictions_per_seq (Google/NVIDIA)


def predictions_for(seq: int) -> int:
    """Masked positions per sequence: the recipes' values at 128 and 512, else one in seven tokens."""
    return PREDICTIONS.get(seq, max(1, seq // 7))


def synthetic_batch(config: BertConfig, batch: int, seq: int, predictions: int, device: torch.device,
                    seed: int = 0) -> dict:
    """A pre-training batch of full-length sequences: random tokens, ``predictions`` masked positions each, NSP
    labels, and ``counts`` (:func:`bert_ds.model.unpad.host_counts`, taken on the host as the trainer does). Every
    position is a real token, so the analytic FLOP count is exactly the work done."""
    gen = torch.Generator().manual_seed(seed)
    low = min(1000, config.vocab_size // 2)  # above the special tokens of a BERT vocabulary
    positions = torch.stack([torch.randperm(seq - 2, generator=gen)[:predictions] + 1 for _ in range(batch)])
    tensors = dict(
        input_ids=torch.randint(low, config.vocab_size, (batch, seq), generator=gen),
        token_type_ids=(torch.arange(seq) >= seq // 2).long().repeat(batch, 1),
        attention_mask=torch.ones(batch, seq, dtype=torch.long),
        masked_lm_positions=positions.sort(dim=1).values,
        masked_lm_ids=torch.randint(low, config.vocab_size, (batch, predictions), generator=gen),
        next_sentence_label=torch.randint(0, 2, (batch,), generator=gen),
    )
    counts = host_counts(tensors["attention_mask"], tensors["masked_lm_ids"])
    return {**{k: v.to(device) for k, v in tensors.items()}, "counts": counts}


class BenchStep:
    """BERT pre-training state on one device: ``forward_backward(batch)`` then ``optimizer_step()`` is one step."""

    def __init__(self, config: BertConfig, device: torch.device, dtype: torch.dtype, kernels: str = "auto",
                 lr: float = 1e-3, seed: int = 0) -> None:
        from bert_ds.model import BertForPreTraining
        from bert_ds.optim.factory import no_decay
        from bert_ds.optim.lamb import ZeroAwareLamb

        torch.manual_seed(seed)
        self.config, self.device, self.dtype = config, device, dtype
        self.model = BertForPreTraining(config, kernels=kernels).to(device=device, dtype=dtype).train()
        self.named = list(self.model.named_parameters())
        self.masters = [p for _, p in self.named] if dtype == torch.float32 else [
            p.detach().float().clone() for _, p in self.named]
        pairs = list(zip(self.named, self.masters, strict=True))
        groups = [{"params": [m for (n, p), m in pairs if not no_decay(n, p)], "weight_decay": 0.01},
                  {"params": [m for (n, p), m in pairs if no_decay(n, p)], "weight_decay": 0.0}]
        self.optimizer = ZeroAwareLamb([g for g in groups if g["params"]], lr=lr, eps=1e-6)

    def forward_backward(self, batch: dict) -> torch.Tensor:
        """Forward and backward of one micro batch; the loss, detached (no host sync)."""
        loss = self.model(**batch).loss
        loss.backward()
        return loss.detach()

    @torch.no_grad()
    def optimizer_step(self) -> None:
        """Gradients into the fp32 masters (bf16 models), the LAMB step, weights back into the model."""
        for (_, p), m in zip(self.named, self.masters, strict=True):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for (_, p), m in zip(self.named, self.masters, strict=True):
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "masters": [m.detach().clone() for m in self.masters],
                "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        for m, saved in zip(self.masters, state["masters"], strict=True):
            m.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
