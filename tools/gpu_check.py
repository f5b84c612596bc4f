#!/usr/bin/env python
"""Check bert_ds on a CUDA GPU in minutes: kernels against their twins, their speed, BERT-large training throughput.
Thin CLI over ``bert_ds.devtools.gpu_check.main`` (installed as ``bert-ds-gpu-check``).

    python tools/gpu_check.py [--out gpu_check.json] [--steps 10] [--batch-128 64] [--batch-512 16]

Needs only PyTorch and Triton. Without a GPU it runs what it can (kernels under the Triton interpreter, a tiny-model
training step, the ahead-of-time machine-code checks), lists the GPU items as skipped and exits 0 when that passes.
Exit status 1 when an item fails. See bert_ds/devtools/gpu_check.py for what each item measures.
"""

from __future__ import annotations

import sys

from bert_ds.devtools.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
