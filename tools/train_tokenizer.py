"""Train a BERT WordPiece vocabulary: thin CLI over ``bert_ds.data.tokenizer.train_tokenizer``."""

import sys

from bert_ds.data.tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
