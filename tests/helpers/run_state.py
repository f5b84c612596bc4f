"""A complete :class:`bert_ds.checkpoint.RunState` for tests that write a checkpoint's ``run_state.json`` by hand
(a fake tag for pre-flight, pruning or export): every field the trainer writes, the ones a test cares about given."""

from __future__ import annotations

from pathlib import Path

from bert_ds.checkpoint import RunState
from bert_ds.data.tokenizer import vocab_sha256
from bert_ds.recipe import Recipe
from tests.helpers.runs import SMALL_RECIPE


def fake_run_state(*, tokenizer_dir: str | Path | None = None, recipe: dict | None = None, phase: int = 0,
                   step: int = 1, phase_done: bool = False, loader: dict | None = None, world_size: int = 1,
                   zero_stage: int = 0, precision: str = "fp32", lowercase: bool = True) -> RunState:
    """``tokenizer_dir``: the vocabulary the tag claims it was trained with (else a sha256 no tokenizer has)."""
    sha = vocab_sha256(Path(tokenizer_dir) / "vocab.txt") if tokenizer_dir is not None else "0" * 64
    recipe = recipe if recipe is not None else Recipe.from_dict(SMALL_RECIPE).to_dict()
    return RunState(recipe=recipe, phase=phase, step=step, phase_done=phase_done, global_step=step,
                    consumed_samples=0, loader=loader if loader is not None else {}, world_size=world_size,
                    zero_stage=zero_stage, precision=precision, vocab_sha256=sha, lowercase=lowercase)
