"""One training step (forward + backward, dropout on, fp32) of bert_ds against transformers' BertForPreTraining on the
same real batches: the batches come from a shard set through bert_ds's loader, so their lengths, padding and masked
positions are those of real text at that sequence length.

Both models hold the same weights (bert_ds's exported to Hugging Face names) at the chosen preset's shape; the shard
ids index the first rows of the vocabulary. transformers runs its default (SDPA) attention and computes its MLM logits
over every position (its API takes dense labels); bert_ds runs as a recipe trains it: unpadded encoder, MLM head on
the masked positions only, last layer on the rows the heads read. Each repeat times one step of each model, in turn,
on the same batch; a different batch per repeat.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch

from bert_ds.config import IGNORE_INDEX, model_preset
from bert_ds.data.batch import MODEL_INPUTS
from bert_ds.data.loader import build_loader
from bert_ds.devtools.benchmarks.timing import alternate, paired_ratio, summary
from bert_ds.errors import BadInput
from bert_ds.model import BertForPreTraining

__all__ = ["FIELDS", "dense_labels", "real_batches", "step_benchmark"]

FIELDS = MODEL_INPUTS
"""The model's inputs in its argument order (:data:`bert_ds.data.batch.MODEL_INPUTS`)."""


def real_batches(data_dir: Path, batch_size: int, count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` training micro batches of ``batch_size`` from ``data_dir`` (static masks, shuffled)."""
    loader = build_loader(data_dir, global_batch_size=batch_size, micro_batch_size=batch_size, num_workers=0,
                          seed=seed)
    return [batch for _, batch in zip(range(count), loader, strict=False)]


def dense_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' label layout: (B, S), the original id at each masked position, IGNORE_INDEX elsewhere."""
    ids, positions = batch["masked_lm_ids"], batch["masked_lm_positions"]
    dense = torch.full_like(batch["input_ids"], IGNORE_INDEX)
    valid = ids != IGNORE_INDEX
    rows = torch.arange(ids.shape[0])[:, None].expand_as(ids)
    dense[rows[valid], positions[valid]] = ids[valid]
    return dense


def _models(preset: str, vocab_size: int) -> tuple[BertForPreTraining, torch.nn.Module]:
    import transformers

    from bert_ds.export import hf_config_dict, to_hf_state_dict

    config = model_preset(preset)
    if vocab_size > config.vocab_size:
        raise BadInput(f"shard ids reach {vocab_size - 1}, beyond BERT-{preset}'s vocabulary of {config.vocab_size}")
    torch.manual_seed(0)
    ours = BertForPreTraining(config, kernels="torch").train()
    with contextlib.redirect_stderr(io.StringIO()):
        theirs = transformers.BertForPreTraining(transformers.BertConfig(**hf_config_dict(config),
                                                                         attn_implementation="sdpa"))
    theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), config), strict=True)
    return ours, theirs.train()


def step_benchmark(data_dir: Path, *, preset: str = "base", batch_size: int = 8, repeats: int = 5,
                   seed: int = 0) -> dict:
    """Time ``repeats`` alternating steps of each model after one warm-up round; returns the figures as a dict."""
    batches = real_batches(data_dir, batch_size, repeats + 1, seed)
    seq_len = batches[0]["input_ids"].shape[1]
    vocab_needed = max(int(b["input_ids"].max()) for b in batches) + 1
    ours, theirs = _models(preset, vocab_needed)
    dense = [dense_labels(b) for b in batches]

    def step_ours(i: int) -> None:
        b = batches[i]
        ours(*(b[k] for k in FIELDS)).loss.backward()
        ours.zero_grad(set_to_none=True)

    def step_theirs(i: int) -> None:
        b = batches[i]
        theirs(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"],
               labels=dense[i], next_sentence_label=b["next_sentence_label"]).loss.backward()
        theirs.zero_grad(set_to_none=True)

    times = alternate({"bert_ds": step_ours, "transformers": step_theirs}, repeats)
    timed = batches[1:]
    real = sum(int(b["attention_mask"].sum()) for b in timed)
    masked = sum(int((b["masked_lm_ids"] != IGNORE_INDEX).sum()) for b in timed)
    slots = sum(b["attention_mask"].numel() for b in timed)
    return {
        "preset": preset, "seq_len": seq_len, "batch_size": batch_size, "threads": torch.get_num_threads(),
        "data_dir": str(data_dir), "fill": real / slots,
        "masked_per_sequence": masked / (len(timed) * batch_size),
        "bert_ds": summary(times["bert_ds"]), "transformers": summary(times["transformers"]),
        "speedup": paired_ratio(times["transformers"], times["bert_ds"]),
        "bert_ds_sequences_per_s": batch_size / summary(times["bert_ds"])["median_s"],
        "transformers_sequences_per_s": batch_size / summary(times["transformers"])["median_s"],
    }
