"""bert_ds: BERT pre-training from raw text with DeepSpeed ZeRO, exact sharded LAMB and a verified HF export."""

__version__ = "0.1.0"
