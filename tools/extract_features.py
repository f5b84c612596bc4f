#!/usr/bin/env python
"""Fixed BERT features of a text file (the BERT paper's feature-based approach, §5.3): thin CLI over
``bert_ds.downstream.features.main`` (installed as ``bert-ds-extract-features``).

    python tools/extract_features.py --model hf_model --input sentences.txt --out features.npy \\
        [--layers -1,-2,-3,-4] [--combine concat|sum|mean] [--pooling tokens|cls|mean]

Writes features.npy (float32) and features.json (shape, layers, pooling, each line's WordPieces).
"""

import sys

from bert_ds.downstream.features import main

if __name__ == "__main__":
    sys.exit(main())
