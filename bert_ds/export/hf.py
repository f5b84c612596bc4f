"""Reading and writing Hugging Face BERT directories (config.json, weights, tokenizer).

Export writes ``BertForPreTraining``. Import for continued pre-training (``--init-from-hf``) also takes the layouts
the hub publishes most (``BertForMaskedLM``: no pooler, no NSP head; ``BertModel``: no heads, and keys often without
the ``bert.`` prefix): every tensor present is taken unchanged, the absent heads keep the model's normal init and one
log line names them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from bert_ds.config import BertConfig
from bert_ds.data.tokenizer import VOCAB_NAME, WordPieceTokenizer, load_tokenizer
from bert_ds.export.keymap import PADDED_VOCAB_KEYS, ExportError, key_map, pad_vocab, to_hf_state_dict, untie_decoder
from bert_ds.model import BertForPreTraining

__all__ = ["HF_ARCHITECTURE", "hf_config_dict", "bert_config_from_hf", "read_hf_state_dict", "save_hf_model",
           "load_training_tokenizer", "write_tokenizer", "load_hf_pretrained", "export_model",
           "IMPORTABLE_ARCHITECTURES", "HEAD_GROUPS", "hf_to_pretraining_state"]

log = logging.getLogger(__name__)

HF_ARCHITECTURE = "BertForPreTraining"
# The hub layouts continued pre-training starts from (bert-base-uncased lists BertForMaskedLM; sentence encoders
# such as all-MiniLM-L6-v2 list BertModel).
IMPORTABLE_ARCHITECTURES = ("BertForPreTraining", "BertForMaskedLM", "BertModel")
# bert_ds key prefix -> the group named in the log when a checkpoint lacks it (initialised as a fresh model would be).
HEAD_GROUPS: dict[str, str] = {
    "bert.pooler.": "pooler",
    "cls.seq_relationship.": "NSP head",
    "cls.predictions.transform.": "MLM transform",
    "cls.predictions.bias": "MLM output bias",
}

# BertConfig fields written to / read from config.json under the same name (all but the bert_ds-only padding).
_SHARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
                  "type_vocab_size", "initializer_range", "layer_norm_eps", "pad_token_id")


def hf_config_dict(config: BertConfig) -> dict:
    """The fields of HF ``config.json`` for this model (``transformers.BertConfig(**fields)``)."""
    fields = {name: getattr(config, name) for name in _SHARED_FIELDS}
    return {**fields, "model_type": "bert", "architectures": [HF_ARCHITECTURE],
            "position_embedding_type": "absolute", "tie_word_embeddings": True}


def bert_config_from_hf(hf_dir: str | Path, pad_vocab_to_multiple_of: int = 1, **overrides) -> BertConfig:
    """Read ``config.json`` of an HF BERT directory; refuse other model types and variants bert_ds cannot run."""
    path = Path(hf_dir) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path}: cannot read HF config: {exc}") from exc
    if data.get("model_type") != "bert":
        raise ExportError(f"{path}: model_type={data.get('model_type')!r}, expected 'bert'")
    architectures = data.get("architectures") or []
    if architectures and not set(architectures) & set(IMPORTABLE_ARCHITECTURES):
        raise ExportError(f"{path}: architectures={architectures}, expected one of {list(IMPORTABLE_ARCHITECTURES)} "
                          "(a task fine-tune's head cannot continue pre-training)")
    if data.get("position_embedding_type", "absolute") != "absolute":
        raise ExportError(f"{path}: position_embedding_type={data['position_embedding_type']!r}; "
                          "bert_ds supports 'absolute' only")
    if data.get("is_decoder", False):
        raise ExportError(f"{path}: is_decoder=true; bert_ds is a bidirectional encoder")
    if data.get("tie_word_embeddings", True) is False:
        raise ExportError(f"{path}: tie_word_embeddings=false; bert_ds ties the MLM decoder to the word embeddings")
    missing = [name for name in _SHARED_FIELDS if name not in data and name != "pad_token_id"]
    if missing:
        raise ExportError(f"{path}: missing field(s) {missing}")
    fields = {name: data[name] for name in _SHARED_FIELDS if name in data}
    fields.update(pad_vocab_to_multiple_of=pad_vocab_to_multiple_of, **overrides)
    try:
        return BertConfig(**fields)
    except ValueError as exc:
        raise ExportError(f"{path}: {exc}") from exc


def read_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Weights of an HF directory: ``model.safetensors``, a sharded safetensors index, or ``pytorch_model.bin``."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    single, index, legacy = hf_dir / "model.safetensors", hf_dir / "model.safetensors.index.json", \
        hf_dir / "pytorch_model.bin"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError, TypeError) as exc:
            raise ExportError(f"{index}: not a safetensors index with a 'weight_map' object: {exc!r}") from exc
        state = {}
        for shard in shards:
            state.update(load_file(hf_dir / shard))
        return state
    if legacy.is_file():
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise ExportError(f"{hf_dir}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def hf_to_pretraining_state(hf_state: dict[str, torch.Tensor], config: BertConfig,
                            source: str = "HF state dict") -> tuple[dict[str, torch.Tensor], list[str]]:
    """HF BERT weights of any importable layout -> (bert_ds tensors present, head groups absent).

    Encoder and embeddings must all be there; the heads in :data:`HEAD_GROUPS` may be absent as whole groups. A
    ``BertModel`` saved on its own names its keys without ``bert.`` (``embeddings.*``, ``encoder.*``, ``pooler.*``)."""
    if not any(k.startswith("bert.") for k in hf_state):
        hf_state = {f"bert.{k}": v for k, v in hf_state.items()}
    # Buffers of older versions and TF-era LayerNorm names (gamma/beta) are not weights of their own.
    hf_state = {k.replace(".LayerNorm.gamma", ".LayerNorm.weight").replace(".LayerNorm.beta", ".LayerNorm.bias"): v
                for k, v in hf_state.items() if not k.endswith((".position_ids", ".token_type_ids"))}
    if "cls.predictions.decoder.bias" in hf_state and "cls.predictions.bias" not in hf_state:
        hf_state["cls.predictions.bias"] = hf_state["cls.predictions.decoder.bias"]
    untie_decoder({k: v for k, v in hf_state.items()}, source)  # refuses an untied decoder; entries dropped below
    hf_state = {k: v for k, v in hf_state.items() if not k.startswith("cls.predictions.decoder.")}
    names = {theirs: ours for ours, theirs in key_map(config).items()}
    unexpected = sorted(set(hf_state) - set(names))
    absent = sorted(set(names) - set(hf_state))
    required = [k for k in absent if not k.startswith(tuple(HEAD_GROUPS))]
    partial = [group for prefix, group in HEAD_GROUPS.items()
               if any(k.startswith(prefix) for k in absent) and any(k.startswith(prefix) for k in hf_state)]
    if unexpected or required or partial:
        raise ExportError(f"{source}: weights do not match the config: missing {required[:8]}, unexpected "
                          f"{unexpected[:8]}, incomplete head group(s) {partial}")
    state = {}
    for theirs, tensor in hf_state.items():
        ours = names[theirs]
        tensor = tensor.detach().to(device="cpu", dtype=torch.float32)
        state[ours] = pad_vocab(tensor, config, f"{source}: {theirs}") if ours in PADDED_VOCAB_KEYS else tensor
    groups = [group for prefix, group in HEAD_GROUPS.items() if any(k.startswith(prefix) for k in absent)]
    return state, groups


def load_hf_pretrained(hf_dir: str | Path, kernels: str = "auto", activation_checkpointing: bool = False,
                       pad_vocab_to_multiple_of: int = 1, **config_overrides) -> BertForPreTraining:
    """A bert_ds :class:`~bert_ds.model.BertForPreTraining` initialised from an HF ``BertForPreTraining``,
    ``BertForMaskedLM`` or ``BertModel`` directory (continued pre-training). Heads the directory lacks keep the
    model's normal init (seeded by the caller) and are named in one log line. The HF import lives here, not on the
    model class: the model never imports ``export``.

    ``config_overrides`` replace config fields that do not change tensor shapes (e.g. dropout)."""
    config = bert_config_from_hf(hf_dir, pad_vocab_to_multiple_of, **config_overrides)
    state, absent = hf_to_pretraining_state(read_hf_state_dict(hf_dir), config, source=str(hf_dir))
    model = BertForPreTraining(config, kernels=kernels, activation_checkpointing=activation_checkpointing)
    model.load_state_dict(state, strict=False)
    # Every parameter is either loaded or in a named absent group (hf_to_pretraining_state checked the names).
    if absent:
        log.info("--init-from-hf %s: took %d tensors; initialised (not in the checkpoint): %s",
                          hf_dir, len(state), ", ".join(absent))
    else:
        log.info("--init-from-hf %s: took all %d tensors", hf_dir, len(state))
    return model


def save_hf_model(hf_state: dict[str, torch.Tensor], config: BertConfig, out_dir: str | Path) -> None:
    """Write ``config.json`` + ``model.safetensors`` through transformers itself, so the files are exactly what
    ``from_pretrained`` expects (tied decoder entries included)."""
    import transformers

    hf_config = transformers.BertConfig(**hf_config_dict(config))
    model = transformers.BertForPreTraining(hf_config)
    model.load_state_dict(hf_state, strict=True)
    model.save_pretrained(out_dir, safe_serialization=True)


def load_training_tokenizer(tokenizer_dir: str | Path) -> WordPieceTokenizer:
    """The tokenizer exactly as training read it: :func:`bert_ds.data.tokenizer.load_tokenizer` is the one reader of
    ``vocab.txt`` (its token count) and of the casing (``tokenizer_meta.json`` or ``tokenizer_config.json``)."""
    try:
        return load_tokenizer(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ExportError(f"{tokenizer_dir}: cannot load the training tokenizer: {exc}") from exc


def write_tokenizer(tokenizer_dir: str | Path, out_dir: str | Path, vocab_size: int) -> None:
    """Write the HF BERT WordPiece tokenizer training used: its vocabulary and its casing (``do_lower_case``, which
    also decides accent stripping in both pipelines), plus a clean ``vocab.txt`` for other tools."""
    import transformers

    tok = load_training_tokenizer(tokenizer_dir)
    if tok.vocab_size != vocab_size:
        raise ExportError(f"{tok.vocab_file}: {tok.vocab_size} tokens, but the model config has "
                          f"vocab_size={vocab_size}")
    vocab = {token: i for i, token in enumerate(tok.vocab)}
    hf_tokenizer = transformers.BertTokenizer(vocab=vocab, do_lower_case=tok.lowercase)
    if len(hf_tokenizer) != vocab_size:
        raise ExportError(f"{tok.vocab_file}: the HF tokenizer built from it has {len(hf_tokenizer)} tokens "
                          f"(duplicate lines?), the model config has vocab_size={vocab_size}")
    hf_tokenizer.save_pretrained(out_dir)
    # Written from the tokens training used (id = line number), not copied: the ids are exactly training's.
    (Path(out_dir) / VOCAB_NAME).write_text("".join(f"{token}\n" for token in tok.vocab), encoding="utf-8")


def export_model(state_dict: dict[str, torch.Tensor], config: BertConfig, out_dir: str | Path,
                 tokenizer_dir: str | Path | None = None, source: str = "bert_ds state dict") -> None:
    """bert_ds state dict -> an HF directory (``out_dir`` must exist; the caller handles atomicity)."""
    save_hf_model(to_hf_state_dict(state_dict, config, source), config, out_dir)
    if tokenizer_dir is not None:
        write_tokenizer(tokenizer_dir, out_dir, config.vocab_size)
