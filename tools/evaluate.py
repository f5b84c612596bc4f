#!/usr/bin/env python
"""Evaluate a bert_ds training checkpoint on a held-out shard set.

    python tools/evaluate.py --checkpoint runs/large/checkpoints --data data/eval_512 [--tag phase2-step001563]

Prints one JSON line on stdout (mlm_accuracy, nsp_accuracy, mlm_loss, nsp_loss, samples, masked_tokens, checkpoint,
tag); everything else goes to stderr. Exit status 2 for a missing or incompatible checkpoint or data directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True,
                        help="DeepSpeed save dir ('latest', tag folders, model_config.json, tokenizer/)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    parser.add_argument("--data", required=True, help="shard directory with index.json")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per forward pass (default: 32)")
    parser.add_argument("--max-batches", type=int, default=None, help="stop after this many batches (default: all)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--num-workers", type=int, default=0, help="data-loader worker processes (default: 0)")
    parser.add_argument("--kernels", default="auto", help="fused-op backend: auto, triton, torch, apex")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_batches is not None and args.max_batches < 1:
        parser.error(f"--max-batches must be >= 1, got {args.max_batches}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stdout = sys.stdout
    # DeepSpeed and zero_to_fp32 print to stdout; keep stdout for the one JSON line.
    with contextlib.redirect_stdout(sys.stderr):
        from bert_ds.evaluate import evaluate_checkpoint

        try:
            metrics = evaluate_checkpoint(args.checkpoint, args.data, tag=args.tag, batch_size=args.batch_size,
                                          max_batches=args.max_batches, device=args.device,
                                          num_workers=args.num_workers, kernels=args.kernels)
        except (FileNotFoundError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(metrics), file=stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
