"""Runs the fault tables share (the uninterrupted one, ``fault_reference_run``, is in ``tests/conftest.py``: the
launcher tests compare with it too): the table's recipe (``tests.helpers.faults.fault_recipe``: the shipped ``tiny_cpu``
cut to 6 + 2 steps, dropout 0.1) on 2 real DeepSpeed CPU ranks, trained once per test session
(``tests.helpers.shared.built_once``: whichever worker asks first) and read, never written, by the cases (a case
that resumes or damages one works on its own copy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.faults import train_fault_run
from tests.helpers.shared import built_once


@pytest.fixture(scope="session")
def trained_run(shards_128, shards_512, tokenizer_dir, tmp_path_factory) -> Path:
    """The run stopped after 2 steps (``phase1-step000002``): copied by the cases that resume, corrupt or read it."""
    return built_once(tmp_path_factory, "fault_trained", lambda root: train_fault_run(
        root, shards_128, shards_512, tokenizer_dir, "--max-steps", "2")) / "run"
