#!/usr/bin/env python
"""Convert a bert_ds DeepSpeed checkpoint to a verified Hugging Face BertForPreTraining directory: thin CLI over
``bert_ds.export.convert.main`` (installed as ``bert-ds-convert-checkpoint``).

    python tools/convert_checkpoint.py --checkpoint RUN_DIR/checkpoints --out hf_model [--tag TAG] [--no-verify]

Exit codes: 0 ok, 1 the reloaded model or tokenizer does not reproduce bert_ds's logits or token ids, 2 bad input.
"""

import sys

from bert_ds.export.convert import main

if __name__ == "__main__":
    sys.exit(main())
