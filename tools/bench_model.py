#!/usr/bin/env python
"""One training step (forward + backward) of bert_ds next to transformers' BertForPreTraining on the same batch.

    python tools/bench_model.py [--preset base] [--batch 8] [--seq 128] [--predictions 20] [--steps 5]

Both models hold the same weights, run in train mode (dropout on) in fp32 on the CPU, and are timed alternately
in the same process; tokens/s counts every position of the (batch, seq) input. Wall-clock and process CPU time are
both recorded: on a machine shared with other jobs the CPU time (and the best of the wall times) is the least
disturbed figure. The bert_ds levers are the MLM head on the masked positions only (HF computes (B, S, vocab)
logits and their softmax) and SDPA attention.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from bert_ds.config import model_preset
from bert_ds.export import hf_config_dict, to_hf_state_dict
from bert_ds.model import BertForPreTraining


def make_batch(vocab_size: int, batch: int, seq: int, predictions: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1000, vocab_size, (batch, seq), generator=gen)
    positions = torch.stack([torch.randperm(seq - 2, generator=gen)[:predictions] + 1 for _ in range(batch)])
    positions = positions.sort(dim=1).values
    ids = torch.randint(1000, vocab_size, (batch, predictions), generator=gen)
    dense_labels = torch.full((batch, seq), -100).scatter(1, positions, ids)
    return dict(input_ids=input_ids, token_type_ids=(torch.arange(seq) >= seq // 2).long().repeat(batch, 1),
                attention_mask=torch.ones(batch, seq, dtype=torch.long), masked_lm_positions=positions,
                masked_lm_ids=ids, dense_labels=dense_labels, next_sentence_label=torch.randint(0, 2, (batch,),
                                                                                                generator=gen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--predictions", type=int, default=20, help="masked positions per sequence")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model (after one warm-up step)")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = model_preset(args.preset)
    ours = BertForPreTraining(config, kernels=args.kernels).train()
    theirs = transformers.BertForPreTraining(transformers.BertConfig(**hf_config_dict(config))).train()
    theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), config), strict=True)
    b = make_batch(config.vocab_size, args.batch, args.seq, args.predictions)

    def step_ours() -> None:
        ours(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_lm_positions"], b["masked_lm_ids"],
             b["next_sentence_label"]).loss.backward()
        ours.zero_grad(set_to_none=True)

    def step_theirs() -> None:
        theirs(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"],
               labels=b["dense_labels"], next_sentence_label=b["next_sentence_label"]).loss.backward()
        theirs.zero_grad(set_to_none=True)

    wall: dict[str, list[float]] = {"bert_ds": [], "transformers": []}
    cpu: dict[str, list[float]] = {"bert_ds": [], "transformers": []}
    for step in range(args.steps + 1):
        for name, fn in (("bert_ds", step_ours), ("transformers", step_theirs)):
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            if step:  # step 0 warms up allocators and kernels
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)

    tokens = args.batch * args.seq
    print(f"BERT-{args.preset} fp32 CPU ({torch.get_num_threads()} threads), batch {args.batch} x seq {args.seq}, "
          f"{args.predictions} masked positions/seq, forward+backward, {args.steps} timed steps each")
    for name in wall:
        best, median, best_cpu = min(wall[name]), statistics.median(wall[name]), min(cpu[name])
        print(f"  {name:<13} wall best {best * 1000:6.0f} ms = {tokens / best:6.1f} tokens/s, "
              f"median {median * 1000:6.0f} ms = {tokens / median:6.1f} tokens/s; "
              f"CPU time best {best_cpu * 1000:6.0f} ms")
    pairs = statistics.median(t / o for o, t in zip(wall["bert_ds"], wall["transformers"], strict=True))
    print(f"  speed-up bert_ds / transformers: {min(wall['transformers']) / min(wall['bert_ds']):.2f}x (best wall), "
          f"{pairs:.2f}x (median per-step pair), {min(cpu['transformers']) / min(cpu['bert_ds']):.2f}x (best CPU time)")

if __name__ == "__main__":
    main()
