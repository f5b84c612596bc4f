#!/usr/bin/env python
"""Fine-tune an exported model with transformers' Trainer: thin CLI over ``bert_ds.downstream.finetune.main``
(installed as ``bert-ds-finetune``).

    python tools/finetune.py --model hf_model --train train.csv --validation dev.csv --out finetuned \\
        [--task sequence|token] [--text-column text] [--text-pair-column text_b] [--label-column label]

Writes the fine-tuned model (labels in config.json's id2label), its tokenizer and finetune_metrics.json.
"""

import sys

from bert_ds.downstream.finetune import main

if __name__ == "__main__":
    sys.exit(main())
