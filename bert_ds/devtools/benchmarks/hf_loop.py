"""The baseline of the time-to-accuracy benchmark: a plain transformers + PyTorch pre-training loop, as a user would
write it without bert_ds, on the same shards and with the same model size.

transformers' ``BertForPreTraining`` (its default SDPA attention; MLM logits over every position, as its API
computes them), ``torch.optim.AdamW`` with linear warm-up and decay (transformers' ``get_linear_schedule_with_warmup``),
gradient clipping at 1.0, one process using every core. Batches come from bert_ds's loader with the same order,
global batch and dynamic masking as the bert_ds run, so the two differ only in the training code. Every
``--eval-interval`` steps it prints ``eval step N | mlm_accuracy A | ...`` over the held-out shards, the masked-LM
accuracy bert_ds's trainer prints (correct / valid masked positions).

    python -m bert_ds.devtools.benchmarks.hf_loop --data D --eval-data E --tokenizer T --steps 1200 --lr 1e-3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time

import torch

from bert_ds.config import IGNORE_INDEX
from bert_ds.devtools.benchmarks.step import dense_labels

__all__ = ["main"]


@torch.no_grad()
def _evaluate(model, loader) -> tuple[float, int]:
    model.eval()
    correct = total = 0
    for batch in loader:
        logits = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                       attention_mask=batch["attention_mask"]).prediction_logits
        labels = dense_labels(batch)
        chosen = labels != IGNORE_INDEX
        correct += int((logits[chosen].argmax(-1) == labels[chosen]).sum())
        total += int(chosen.sum())
    model.train()
    return correct / max(total, 1), total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-fraction", type=float, default=0.05)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--target", type=float, default=None, help="stop once the eval accuracy reaches this")
    args = parser.parse_args(argv)

    import transformers

    from bert_ds.config import model_preset
    from bert_ds.data.loader import DynamicMasking, build_eval_loader, build_loader
    from bert_ds.data.tokenizer import read_vocab
    from bert_ds.export import hf_config_dict

    torch.manual_seed(args.seed)
    config = model_preset(args.preset, vocab_size=len(read_vocab(f"{args.tokenizer}/vocab.txt")))
    with contextlib.redirect_stderr(io.StringIO()):
        model = transformers.BertForPreTraining(transformers.BertConfig(**hf_config_dict(config),
                                                                        attn_implementation="sdpa")).train()
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.999),
                                  eps=1e-6)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, int(args.warmup_fraction * args.steps),
                                                             args.steps)
    masking = DynamicMasking.from_tokenizer(args.tokenizer)
    loader = build_loader(args.data, global_batch_size=args.global_batch_size,
                          micro_batch_size=args.global_batch_size, num_workers=1, seed=args.seed,
                          dynamic_masking=masking)
    eval_loader = build_eval_loader(args.eval_data, micro_batch_size=64)
    start = time.perf_counter()
    for step, batch in zip(range(1, args.steps + 1), loader, strict=False):
        out = model(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                    attention_mask=batch["attention_mask"], labels=dense_labels(batch),
                    next_sentence_label=batch["next_sentence_label"])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            print(f"step {step} | loss {out.loss.item():.4f} | {time.perf_counter() - start:.1f} s", flush=True)
        if step % args.eval_interval == 0 or step == args.steps:
            accuracy, positions = _evaluate(model, eval_loader)
            print(f"eval step {step} | mlm_accuracy {accuracy:.4f} | masked_tokens {positions}", flush=True)
            if args.target is not None and accuracy >= args.target:
                break
    return 0


if __name__ == "__main__":
    sys.exit(main())
