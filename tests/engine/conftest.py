"""Fixtures for the engine tests: synthetic shard sets and one uninterrupted reference run (helpers in
``tests.helpers.runs``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.runs import run_pretrain, write_recipe
from tests.helpers.shared import built_once

_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # bert_ds's special-token order
_SPECIAL_IDS = {"cls_id": 2, "sep_id": 3, "mask_id": 4}


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory) -> tuple[Path, Path]:
    """Synthetic seq-128 and seq-512 shard sets (vocab 12,000) and, beside them, a ``tokenizer/`` whose vocab.txt
    has that size and hash, with bert_ds's special-token order ([MASK] = 4)."""
    from bert_ds.data.synthetic import write_synthetic_shards
    from bert_ds.data.tokenizer import vocab_sha256

    def build(root: Path) -> None:
        (root / "tokenizer").mkdir()
        vocab = root / "tokenizer" / "vocab.txt"
        vocab.write_text("\n".join(_SPECIALS + [f"tok{i}" for i in range(12000 - len(_SPECIALS))]) + "\n")
        sha = vocab_sha256(vocab)
        write_synthetic_shards(root / "s128", num_samples=400, samples_per_shard=100, seq_len=128, max_predictions=20,
                               vocab_size=12000, seed=1, vocab_sha256=sha, **_SPECIAL_IDS)
        write_synthetic_shards(root / "s512", num_samples=200, samples_per_shard=50, seq_len=512, max_predictions=80,
                               vocab_size=12000, seed=2, vocab_sha256=sha, **_SPECIAL_IDS)

    root = built_once(tmp_path_factory, "engine_shards", build)
    return root / "s128", root / "s512"


@pytest.fixture(scope="session")
def reference_run(synthetic_data, tmp_path_factory) -> Path:
    """The uninterrupted 2-rank ZeRO-2 run of ``SMALL_RECIPE`` through both phases."""
    def build(root: Path) -> None:
        recipe = write_recipe(root / "recipe.json")
        run_pretrain(["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--output", str(root / "run")],
                     nprocs=2)

    return built_once(tmp_path_factory, "engine_reference", build) / "run"
