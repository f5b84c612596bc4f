"""A small Hugging Face export made by the real converter, for the tests of what users do with an export
(fine-tuning, feature extraction): a randomly initialised tiny bert_ds model, saved as a ZeRO-0 checkpoint
(:func:`tests.helpers.ds_checkpoint.write_stage0_run`) and converted with verification."""

from __future__ import annotations

from pathlib import Path

import torch

from bert_ds.config import model_preset
from bert_ds.data.tokenizer import load_tokenizer
from bert_ds.export import convert_checkpoint
from bert_ds.model import BertForPreTraining
from tests.helpers.ds_checkpoint import write_stage0_run


def random_tiny_export(tokenizer_dir: Path, root: Path, seed: int = 0, **overrides) -> Path:
    """Export a ``tiny`` model (2 layers, hidden 128, 128 positions unless ``overrides`` say otherwise) over
    ``tokenizer_dir``'s vocabulary to ``root/hf``."""
    torch.manual_seed(seed)
    config = model_preset("tiny", **{"vocab_size": load_tokenizer(tokenizer_dir).vocab_size,
                                     "max_position_embeddings": 128, **overrides})
    ckpt = write_stage0_run(root / "run", BertForPreTraining(config, kernels="torch"), tokenizer_dir)
    convert_checkpoint(ckpt, root / "hf")
    return root / "hf"
