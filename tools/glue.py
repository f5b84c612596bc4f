#!/usr/bin/env python
"""The GLUE suite: thin CLI over ``bert_ds.downstream.suite.main`` (installed as ``bert-ds-glue``).

    python tools/glue.py --model hf_model --data-dir glue_data --out glue_results [--seeds 5] \\
        [--lr-grid 5e-5,4e-5,3e-5,2e-5] [--mnli-transfer]
"""

import sys

from bert_ds.downstream.suite import main

if __name__ == "__main__":
    sys.exit(main())
