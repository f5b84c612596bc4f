"""The Triton launches each shipped recipe makes on a CUDA device, recorded on the CPU by running the model itself.

For every recipe in ``ds_configs/*.json`` (globbed when called, so a new or renamed recipe is covered without an
edit here) the model is built as :func:`bert_ds.runtime.engine.build_model` builds it (the recipe's preset and
overrides, its ``kernels`` setting, activation checkpointing), cast to the precision the engine resolves on a GPU
(:func:`~bert_ds.runtime.engine.resolve_precision` with ``"cuda"``), and run inside
:func:`bert_ds.kernels.jit.record_launches`, where the backend registry decides as on CUDA tensors and each Triton
launch is recorded instead of run. Per phase it runs what a GPU run does: a training micro batch (forward and
backward, dropout as configured), an evaluation forward (no dropout, no grad) and the trainer's finite-logits probe
(padded, 32 tokens; ``bert_ds.runtime.trainer._logits_finite``), once for every varlen block-size bucket the phase's
sequence length reaches. So the build list comes from the same code that picks kernels at run time.

Two kept approximations, neither of which changes a build: the model has 2 encoder layers (every layer but the last
is the same launch; the last attends from a few query rows with SDPA) and 2 sequences per batch (no kernel is
specialised on the batch size or the token count).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from bert_ds.kernels.attention_varlen import VARLEN_ATTENTION_CONFIGS
from bert_ds.kernels.jit import Launch, record_launches
from bert_ds.model import BertForPreTraining
from bert_ds.model.unpad import host_counts
from bert_ds.recipe import PhaseConfig, Recipe, load_recipe

__all__ = ["RECIPE_DIR", "Site", "bucket_lengths", "recipe_launches", "recipe_paths", "shipped_launches"]

RECIPE_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_PROBE_TOKENS = 32  # bert_ds.runtime.trainer._logits_finite: min(32, max_position_embeddings) tokens


@dataclass(frozen=True)
class Site:
    """Where a launch comes from: which recipe under which kernels setting, at which phase and step kind."""

    recipe: str
    kernels: str
    model: str
    dtype: str
    seq_len: int
    max_seqlen: int
    step: str  # "train", "eval" or "probe"

    @property
    def label(self) -> str:
        return f"{self.recipe}[{self.kernels},{self.dtype}] s{self.seq_len}/max{self.max_seqlen} {self.step}"

    @property
    def shape(self) -> str:
        return f"{self.model}-s{self.seq_len}"


def recipe_paths(root: Path = RECIPE_DIR) -> list[Path]:
    """Every shipped recipe, found on disk now."""
    return sorted(root.glob("*.json"))


def bucket_lengths(seq_len: int) -> list[int]:
    """One longest-sequence length per varlen block-size bucket that batches of ``seq_len`` reach: a seq-512 phase
    meets batches whose longest sequence is <= 128 too (bucket 128) and longer ones (bucket 512)."""
    out, low = [], 0
    for bound in sorted(VARLEN_ATTENTION_CONFIGS):
        if low < seq_len:
            out.append(min(bound, seq_len))
        low = bound
    if low < seq_len:  # longer than every bucket: the largest bucket's blocks
        out.append(seq_len)
    return out


def _batch(config, seq_len: int, longest: int, predictions: int, nsp: bool) -> dict:
    lengths = [longest, min(longest, 8)]  # the second row short: less CPU work, the same launches
    mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    slots = min(predictions, 6)
    positions = torch.stack([torch.arange(1, slots + 1) for _ in lengths])
    batch = dict(input_ids=torch.full((2, seq_len), 1000) * mask, token_type_ids=torch.zeros(2, seq_len).long(),
                 attention_mask=mask, masked_lm_positions=positions, masked_lm_ids=torch.full((2, slots), 1001))
    if nsp:
        batch["next_sentence_label"] = torch.zeros(2, dtype=torch.long)
    return batch


def _phase(model: BertForPreTraining, recipe: Recipe, phase: PhaseConfig, site: Site) -> list[tuple[Launch, Site]]:
    out = []
    for longest in bucket_lengths(phase.seq_len):
        batch = _batch(model.config, phase.seq_len, longest, phase.max_predictions, recipe.nsp)
        counts = host_counts(batch["attention_mask"], batch["masked_lm_ids"])
        here = dataclasses.replace(site, seq_len=phase.seq_len, max_seqlen=longest)
        with torch.enable_grad(), record_launches() as launches:
            model.train()
            model(**batch, counts=counts).loss.backward()
        out += [(launch, dataclasses.replace(here, step="train")) for launch in launches]
        with torch.no_grad(), record_launches() as launches:
            model.eval()
            model(**batch, counts=counts)
        out += [(launch, dataclasses.replace(here, step="eval")) for launch in launches]
    return out


def _probe(model: BertForPreTraining, site: Site) -> list[tuple[Launch, Site]]:
    n = min(_PROBE_TOKENS, model.config.max_position_embeddings)
    ids = (torch.arange(n) * 7919 % model.config.vocab_size).unsqueeze(0)
    with torch.no_grad(), record_launches() as launches:
        model.eval()
        model.logits(ids, torch.zeros_like(ids), torch.ones_like(ids))
    return [(launch, dataclasses.replace(site, seq_len=n, max_seqlen=n, step="probe")) for launch in launches]


def recipe_launches(path: Path, kernels: str | None = None) -> tuple[list[tuple[Launch, Site]], str | None]:
    """The launches of recipe ``path`` on a GPU, with ``kernels`` replacing the recipe's setting when given; and
    None, or the error the runtime raises for this setting (e.g. explicit ``triton`` attention in fp32): then no
    launch, since such a run stops at its first step."""
    from bert_ds.runtime.engine import resolve_precision  # engine imports deepspeed: only when called

    recipe = load_recipe(path)
    kernels = recipe.kernels if kernels is None else kernels
    precision = resolve_precision(recipe.deepspeed.precision, "cuda")
    config = dataclasses.replace(recipe.model_config(vocab_size=30522), num_hidden_layers=2)
    torch.manual_seed(recipe.seed)
    model = BertForPreTraining(config, kernels=kernels,
                               activation_checkpointing=recipe.deepspeed.activation_checkpointing)
    model = model.to(_DTYPES[precision])
    site = Site(recipe.name or path.stem, kernels, recipe.model, precision, 0, 0, "")
    out: list[tuple[Launch, Site]] = []
    try:
        for phase in recipe.phases:
            out += _phase(model, recipe, phase, site)
        out += _probe(model, site)
    except RuntimeError as exc:
        if "backend 'triton'" not in str(exc):
            raise
        return [], str(exc)
    return out, None


def shipped_launches(paths: list[Path] | None = None) -> tuple[list[tuple[Launch, Site]], dict[str, str]]:
    """Every recipe's launches as shipped and with explicit ``kernels: "triton"`` (the backend a user may choose):
    the launches with their sites, and the refusals by ``recipe[kernels]``."""
    launches, refused = [], {}
    for path in recipe_paths() if paths is None else paths:
        for kernels in dict.fromkeys((load_recipe(path).kernels, "triton")):
            found, error = recipe_launches(path, kernels)
            launches += found
            if error is not None:
                refused[f"{path.stem}[{kernels}]"] = error
    return launches, refused
