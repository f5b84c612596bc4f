"""bert_ds <-> Hugging Face ``BertForPreTraining`` state dicts: one declarative name table plus named transforms.

The bert_ds model is built with HF's module names, so the table is the identity; it still earns its place as the
single list of every tensor both sides must have (a renamed module shows up here, not as a silent missing key).
The transforms are the only real differences:

* ``trim_padded_vocab`` / ``pad_vocab``: bert_ds may pad the word embeddings and the MLM output bias to
  ``padded_vocab_size`` rows; HF holds exactly ``vocab_size``.
* ``tie_decoder`` / ``untie_decoder``: bert_ds has no decoder parameter (it multiplies by the word embeddings);
  HF lists ``cls.predictions.decoder.{weight,bias}`` as tied copies of the word embeddings and ``cls.predictions.bias``.
"""

from __future__ import annotations

import torch

from bert_ds.config import BertConfig
from bert_ds.errors import BadInput

__all__ = ["ExportError", "KEY_MAP", "LAYER_KEY_MAP", "TIED_KEYS", "PADDED_VOCAB_KEYS", "key_map",
           "to_hf_state_dict", "from_hf_state_dict"]


class ExportError(BadInput):
    """Bad input to the exporter/importer; the message names the path or field at fault."""


# bert_ds name -> HF name, outside the encoder layers.
KEY_MAP: dict[str, str] = {
    "bert.embeddings.word_embeddings.weight": "bert.embeddings.word_embeddings.weight",
    "bert.embeddings.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "bert.embeddings.token_type_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
    "bert.embeddings.LayerNorm.weight": "bert.embeddings.LayerNorm.weight",
    "bert.embeddings.LayerNorm.bias": "bert.embeddings.LayerNorm.bias",
    "bert.pooler.dense.weight": "bert.pooler.dense.weight",
    "bert.pooler.dense.bias": "bert.pooler.dense.bias",
    "cls.predictions.transform.dense.weight": "cls.predictions.transform.dense.weight",
    "cls.predictions.transform.dense.bias": "cls.predictions.transform.dense.bias",
    "cls.predictions.transform.LayerNorm.weight": "cls.predictions.transform.LayerNorm.weight",
    "cls.predictions.transform.LayerNorm.bias": "cls.predictions.transform.LayerNorm.bias",
    "cls.predictions.bias": "cls.predictions.bias",
    "cls.seq_relationship.weight": "cls.seq_relationship.weight",
    "cls.seq_relationship.bias": "cls.seq_relationship.bias",
}

# Per encoder layer, relative to ``bert.encoder.layer.{i}.`` on both sides.
LAYER_KEY_MAP: dict[str, str] = {
    name: name
    for module in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                   "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")
    for name in (f"{module}.weight", f"{module}.bias")
}

# HF key -> the HF key it is tied to (written as a copy on export, checked and dropped on import).
TIED_KEYS: dict[str, str] = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}

# Tensors whose first dimension is the vocabulary (padded in bert_ds, exact in HF).
PADDED_VOCAB_KEYS: tuple[str, ...] = ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias")

# Keys without parameters that HF checkpoints may carry (buffers of older versions).
_IGNORED_HF_KEYS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")


def key_map(config: BertConfig) -> dict[str, str]:
    """The full bert_ds -> HF name map for a model with ``config.num_hidden_layers`` layers."""
    names = dict(KEY_MAP)
    for i in range(config.num_hidden_layers):
        prefix = f"bert.encoder.layer.{i}."
        names.update({prefix + ours: prefix + theirs for ours, theirs in LAYER_KEY_MAP.items()})
    return names


def _check_keys(have: set[str], want: set[str], source: str) -> None:
    missing, unexpected = sorted(want - have), sorted(have - want)
    if missing or unexpected:
        raise ExportError(f"{source}: state dict does not match the model config: "
                          f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                          f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")


def trim_padded_vocab(tensor: torch.Tensor, config: BertConfig, name: str) -> torch.Tensor:
    if tensor.shape[0] != config.padded_vocab_size:
        raise ExportError(f"{name}: {tensor.shape[0]} vocabulary rows, the model config says padded_vocab_size="
                          f"{config.padded_vocab_size} (vocab_size={config.vocab_size})")
    return tensor[: config.vocab_size]


def pad_vocab(tensor: torch.Tensor, config: BertConfig, name: str) -> torch.Tensor:
    if tensor.shape[0] != config.vocab_size:
        raise ExportError(f"{name}: {tensor.shape[0]} vocabulary rows, config vocab_size={config.vocab_size}")
    extra = config.padded_vocab_size - config.vocab_size
    return torch.cat([tensor, tensor.new_zeros((extra, *tensor.shape[1:]))]) if extra else tensor


def tie_decoder(hf_state: dict[str, torch.Tensor]) -> None:
    for tied, source in TIED_KEYS.items():
        hf_state[tied] = hf_state[source]


def untie_decoder(hf_state: dict[str, torch.Tensor], source: str) -> None:
    """Drop HF's tied decoder entries, refusing a checkpoint whose decoder was trained untied."""
    for tied, origin in TIED_KEYS.items():
        if tied in hf_state:
            value = hf_state.pop(tied)
            if value.shape != hf_state[origin].shape or not torch.equal(value, hf_state[origin]):
                raise ExportError(f"{source}: {tied} differs from {origin}; bert_ds ties the MLM decoder to the word "
                                  "embeddings and cannot represent an untied decoder")


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], config: BertConfig,
                     source: str = "bert_ds state dict") -> dict[str, torch.Tensor]:
    """bert_ds (padded vocab, no decoder keys) -> HF ``BertForPreTraining`` (exact vocab, tied decoder keys), fp32."""
    names = key_map(config)
    state_dict = {k.removeprefix("module."): v for k, v in state_dict.items()}
    _check_keys(set(state_dict), set(names), source)
    hf_state = {}
    for ours, theirs in names.items():
        tensor = state_dict[ours].detach().to(device="cpu", dtype=torch.float32)
        if ours in PADDED_VOCAB_KEYS:
            tensor = trim_padded_vocab(tensor, config, f"{source}: {ours}")
        hf_state[theirs] = tensor.contiguous()
    tie_decoder(hf_state)
    return hf_state


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], config: BertConfig,
                       source: str = "HF state dict") -> dict[str, torch.Tensor]:
    """HF ``BertForPreTraining`` -> bert_ds (vocab padded to ``padded_vocab_size`` with zero rows)."""
    hf_state = {_modern_layer_norm_name(k): v for k, v in hf_state.items() if k not in _IGNORED_HF_KEYS}
    required = (("cls.predictions.bias", "MLM head"), ("cls.seq_relationship.weight", "NSP head"),
                ("bert.pooler.dense.weight", "pooler"))
    absent = [what for key, what in required if key not in hf_state]
    if absent:
        raise ExportError(f"{source}: no {', '.join(absent)} weights: not a BertForPreTraining checkpoint "
                          "(BertModel / BertForMaskedLM checkpoints lack the NSP head and pre-training needs it; "
                          "start from a BertForPreTraining checkpoint or from scratch)")
    untie_decoder(hf_state, source)
    names = {theirs: ours for ours, theirs in key_map(config).items()}
    _check_keys(set(hf_state), set(names), source)
    state = {}
    for theirs, ours in names.items():
        tensor = hf_state[theirs].detach().to(device="cpu", dtype=torch.float32)
        if ours in PADDED_VOCAB_KEYS:
            tensor = pad_vocab(tensor, config, f"{source}: {theirs}")
        state[ours] = tensor
    return state


def _modern_layer_norm_name(key: str) -> str:
    # TF-converted checkpoints (e.g. the original Google release via old transformers) use gamma/beta.
    if ".LayerNorm." in key:
        return key.replace(".LayerNorm.gamma", ".LayerNorm.weight").replace(".LayerNorm.beta", ".LayerNorm.bias")
    return key
