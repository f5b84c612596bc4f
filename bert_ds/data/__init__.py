"""Data path: text -> WordPiece tokenizer -> sentence pairs (NSP) -> masking -> tar shards (+index.json) -> loader."""
