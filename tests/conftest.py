"""Session fixtures shared by all bert_ds tests: a real English corpus built from text on every Debian machine, a
WordPiece vocabulary trained on it, and small shard sets at sequence length 128 and 512. No network."""

from __future__ import annotations

import os

# Triton fixes interpreter mode at its first import, and the model (imported by several test dirs) imports it: the
# kernel tests run the Triton kernels on the CPU only if this is set before anything else is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import ast
import sysconfig
from pathlib import Path

import pytest

from bert_ds.data.text import split_sentences

LICENSES = Path("/usr/share/common-licenses")
CORPUS_CHARS = 700_000  # ~6k sentences: enough for masking/NSP statistics, small enough to build in seconds


def _license_documents() -> list[list[str]]:
    docs, seen = [], set()
    for path in sorted(LICENSES.glob("*")) if LICENSES.is_dir() else []:
        real = path.resolve()
        if real in seen or not real.is_file():
            continue
        seen.add(real)
        docs.append(split_sentences(real.read_text(encoding="utf-8", errors="replace")))
    return docs


def _prose(doc: str) -> str:
    # Docstring paragraphs that are code examples (doctest prompts, indented blocks) are not prose.
    paras = [p for p in doc.split("\n\n") if ">>>" not in p and not p.startswith((" ", "\t"))]
    return "\n\n".join(paras)


def _stdlib_documents() -> list[list[str]]:
    """One document per standard-library module: its module, class and function docstrings, in source order."""
    docs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        texts = [ast.get_docstring(node, clean=True) for node in ast.walk(tree)
                 if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)]
        sentences = [s for t in texts if t for s in split_sentences(_prose(t))]
        docs.append(sentences)
    return docs


def build_english_corpus(path: Path, max_chars: int = CORPUS_CHARS) -> Path:
    """Write the corpus in BERT layout (one sentence per line, blank line between documents)."""
    chars = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in _license_documents() + _stdlib_documents():
            doc = [s.replace("\n", " ") for s in doc if s.strip()]
            if len(doc) < 2:
                continue
            f.write("\n".join(doc) + "\n\n")
            chars += sum(map(len, doc))
            if chars >= max_chars:
                break
    return path


@pytest.fixture(scope="session")
def english_corpus(tmp_path_factory) -> Path:
    """Path to a real English corpus (GPL/Apache/... license texts + Python stdlib docstrings) in BERT layout."""
    return build_english_corpus(tmp_path_factory.mktemp("corpus") / "english.txt")


@pytest.fixture(scope="session")
def tokenizer_dir(english_corpus, tmp_path_factory) -> Path:
    """An uncased WordPiece vocabulary (4,000 tokens) trained on ``english_corpus``."""
    from bert_ds.data.tokenizer import train_tokenizer

    return train_tokenizer([english_corpus], tmp_path_factory.mktemp("tokenizer"), vocab_size=4000)


@pytest.fixture(scope="session")
def shards_128(english_corpus, tokenizer_dir, tmp_path_factory) -> Path:
    """A seq-128 shard set (seed 1234, dupe factor 2, several shards of ~1,000 samples) with its index.json."""
    from bert_ds.data.create import create_shards

    out = tmp_path_factory.mktemp("shards_128")
    create_shards([english_corpus], tokenizer_dir, out, seq_len=128, dupe_factor=2, seed=1234,
                  samples_per_shard=1000, progress=False)
    return out


@pytest.fixture(scope="session")
def shards_512(english_corpus, tokenizer_dir, tmp_path_factory) -> Path:
    """A seq-512 shard set (seed 1234, dupe factor 2, several shards of ~250 samples) with its index.json."""
    from bert_ds.data.create import create_shards

    out = tmp_path_factory.mktemp("shards_512")
    create_shards([english_corpus], tokenizer_dir, out, seq_len=512, dupe_factor=2, seed=1234,
                  samples_per_shard=250, progress=False)
    return out


def read_shard_set(directory: Path) -> list[tuple[str, str, object]]:
    """Every sample of a shard set as (shard name, member name, ``Sample``), in index order."""
    import tarfile

    import numpy as np

    from bert_ds.data.format import decode_sample
    from bert_ds.data.index import ShardIndex

    index = ShardIndex.load(directory)
    dtype = np.dtype(index.id_dtype)
    out = []
    for shard in index.shards:
        with tarfile.open(Path(directory) / shard.name) as tar:
            for member in tar:
                data = tar.extractfile(member).read()
                out.append((shard.name, member.name, decode_sample(data, dtype, where=f"{shard.name}/{member.name}")))
    return out


@pytest.fixture(scope="session")
def shard_reader():
    """``read_shard_set``: a function reading every (shard, member, Sample) of a shard directory."""
    return read_shard_set
