#!/usr/bin/env python
"""Evaluate a bert_ds training checkpoint on a held-out shard set: thin CLI over ``bert_ds.evaluate.main``
(installed as ``bert-ds-evaluate``).

    python tools/evaluate.py --checkpoint runs/large/checkpoints --data data/eval_512 [--tag phase2-step001563]

Prints one JSON line on stdout (mlm_accuracy, nsp_accuracy, mlm_loss, nsp_loss, samples, masked_tokens, checkpoint,
tag); everything else goes to stderr. The fused-op backend is the run's (RUN_DIR/recipe.json) unless --kernels is
given. Exit status 2 for a missing or incompatible checkpoint or data directory.
"""

import sys

from bert_ds.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
