"""Hugging Face export/import: one key map with named transforms, and a converter that verifies its output.

The run directory is read through :mod:`bert_ds.checkpoint`; nothing here imports deepspeed at import time (only the
consolidation of ZeRO partitions does, inside :func:`bert_ds.checkpoint.consolidated_state_dict`)."""

from bert_ds.export.convert import (
    VERIFY_ATOL,
    VERIFY_TEXT,
    CheckpointRef,
    VerificationError,
    apply_umask,
    consolidate_checkpoint,
    convert_checkpoint,
    find_checkpoint,
    verify_export,
    verify_tokenizer,
)
from bert_ds.export.hf import (
    bert_config_from_hf,
    export_model,
    hf_config_dict,
    load_hf_pretrained,
    load_training_tokenizer,
    read_hf_state_dict,
    write_tokenizer,
)
from bert_ds.export.keymap import ExportError, from_hf_state_dict, key_map, to_hf_state_dict

__all__ = ["VERIFY_ATOL", "VERIFY_TEXT", "CheckpointRef", "ExportError", "VerificationError", "apply_umask",
           "bert_config_from_hf",
           "consolidate_checkpoint", "convert_checkpoint", "export_model", "find_checkpoint", "from_hf_state_dict",
           "hf_config_dict", "key_map", "load_hf_pretrained", "load_training_tokenizer", "read_hf_state_dict",
           "to_hf_state_dict", "verify_export", "verify_tokenizer", "write_tokenizer"]
