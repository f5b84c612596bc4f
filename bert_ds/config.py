"""Typed configuration. The model config uses Hugging Face ``BertConfig`` field names so ``config.json`` is written
field for field."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from bert_ds.errors import BadInput

__all__ = ["IGNORE_INDEX", "BertConfig", "MODEL_PRESETS", "model_preset"]

IGNORE_INDEX = -100
"""Label of a prediction slot without a prediction (an unused masked-LM slot, a token-tagging WordPiece after a word's
first): ``torch.nn.CrossEntropyLoss``'s default ``ignore_index``, which transformers' losses use too. The one
definition, below both data and model: the loader's batches, the model's loss and the fine-tuning labels import it
from here."""


@dataclass
class BertConfig:
    vocab_size: int = 30522
    """Real vocabulary size (the tokenizer's). Never padded: padding lives in ``padded_vocab_size``."""
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    """BERT uses the erf form of GELU (paper, Google's modeling.py)."""
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    pad_vocab_to_multiple_of: int = 1
    """Pad the word-embedding/decoder rows to a multiple of this (64 for tensor cores). Trimmed on export."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size", "pad_vocab_to_multiple_of"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise BadInput(f"BertConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise BadInput(f"BertConfig.hidden_size={self.hidden_size} is not divisible by "
                           f"num_attention_heads={self.num_attention_heads}")
        if self.hidden_act != "gelu":
            raise BadInput(f"BertConfig.hidden_act={self.hidden_act!r}: only 'gelu' (erf form, as BERT) is supported")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise BadInput(f"BertConfig.{name} must be in [0, 1), got {value!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise BadInput(f"BertConfig.pad_token_id={self.pad_token_id} outside the vocabulary ({self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_to_multiple_of
        return (self.vocab_size + m - 1) // m * m

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "config") -> BertConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise BadInput(f"{source}: unknown BertConfig field(s) {unknown}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> BertConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BadInput(f"{path}: cannot read model config: {exc}") from exc
        return cls.from_dict(data, source=str(path))


# Paper Table/§3: base L12 H768 A12, large L24 H1024 A16; intermediate = 4H. `tiny` exists for tests and the demo.
MODEL_PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def model_preset(name: str, **overrides) -> BertConfig:
    """A preset by name (``tiny``, ``base``, ``large``) with field overrides, e.g. ``vocab_size``."""
    if name not in MODEL_PRESETS:
        raise BadInput(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return BertConfig(**{**MODEL_PRESETS[name], **overrides})
