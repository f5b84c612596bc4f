"""Phase 1 of any recipe through bert_ds's real engine (``build_engine``: its optimizer, ZeRO stage, overlap_comm,
schedule), one DeepSpeed CPU rank (gloo) per process; spawned by ``tests/optim/test_adamw_engine.py``
through ``tests.helpers.lamb_harness.run_ranks``. Not a test module.

Runs ``--steps`` optimizer steps of phase 1 of ``--recipe`` on ``--data`` and, on rank 0, writes ``<out>/params.pt``
(fp64 copies of the final weights) and ``<out>/losses.json`` (each step's loss, averaged over micro batches and
ranks).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from bert_ds.data.batch import MODEL_INPUTS


def main() -> None:
    import deepspeed.comm as dist

    from bert_ds.data.index import vocab_sha256
    from bert_ds.data.loader import build_loader
    from bert_ds.recipe import load_recipe
    from bert_ds.runtime.engine import build_engine, build_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", type=Path, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--data", type=Path, required=True, help="a seq-128 shard set")
    ap.add_argument("--vocab", type=Path, required=True, help="the shard set's vocab.txt")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from bert_ds.runtime.distributed import join_gloo_group

    join_gloo_group()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    recipe = load_recipe(args.recipe)
    phase = recipe.phases[0]
    vocab_size = sum(1 for line in args.vocab.read_text(encoding="utf-8").splitlines() if line)
    te = build_engine(recipe, 0, build_model(recipe, recipe.model_config(vocab_size)), world)
    loader = build_loader(args.data, global_batch_size=phase.global_batch_size, micro_batch_size=phase.micro_batch_size,
                          rank=rank, world_size=world, seed=recipe.seed, num_workers=0,
                          expected_seq_len=phase.seq_len, expected_vocab_sha256=vocab_sha256(args.vocab),
                          max_predictions=phase.max_predictions)
    batches = iter(loader)
    losses = []
    for _ in range(args.steps):
        total = torch.zeros((), dtype=torch.float64)
        for _ in range(te.accumulation):
            batch = next(batches)
            loss = te.engine(**{k: batch[k] for k in MODEL_INPUTS}).loss
            te.engine.backward(loss)
            te.engine.step()
            total += loss.detach().double()
        dist.all_reduce(total)
        losses.append(total.item() / (te.accumulation * world))
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({n: p.detach().double().clone() for n, p in te.engine.module.named_parameters()},
                   args.out / "params.pt")
        (args.out / "losses.json").write_text(json.dumps(losses))
    te.engine.destroy()


if __name__ == "__main__":
    from bert_ds.lifecycle.rank_exit import end_process

    main()
    end_process(0)  # a DeepSpeed rank: no C++ teardown of gloo's threads (see rank_exit)
