"""A real English corpus in BERT layout, built from text present on any Debian machine (no download).

Sources, read where they are installed and never shipped with bert_ds:

* ``/usr/share/common-licenses/*`` (Debian's ``base-files``): the texts of the GPL, LGPL, Apache-2.0, Artistic, MPL
  and other licences, one document each. Their own terms allow verbatim copies; the corpus only reads them.
* The docstrings of the Python standard library's top-level modules (module, class and function docstrings, in source
  order; code examples dropped), one document per module, under the Python Software Foundation License.

Used by the test suite (its masking and NSP statistics depend on this exact text: change nothing here without
regenerating them) and by ``tools/bench_create.py``.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

from bert_ds.data.text import split_sentences

__all__ = ["LICENSES", "CORPUS_CHARS", "build_english_corpus", "build_corpus_by_kind"]

LICENSES = Path("/usr/share/common-licenses")
CORPUS_CHARS = 700_000  # ~6k sentences: enough for masking/NSP statistics, small enough to build in seconds


def _license_documents() -> list[list[str]]:
    docs, seen = [], set()
    for path in sorted(LICENSES.glob("*")) if LICENSES.is_dir() else []:
        real = path.resolve()
        if real in seen or not real.is_file():  # several names link to one text (GPL -> GPL-3)
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


def build_english_corpus(path: str | Path, max_chars: int = CORPUS_CHARS) -> Path:
    """Write the corpus to ``path`` in BERT layout (one sentence per line, blank line between documents): licence
    texts first, then standard-library docstrings, until ``max_chars`` characters of sentences; returns ``path``."""
    return _write_documents(path, _license_documents() + _stdlib_documents(), max_chars)


def build_corpus_by_kind(directory: str | Path, max_chars: int = CORPUS_CHARS) -> dict[str, Path]:
    """Two corpora of different text, one per document kind (for mixes of sources): ``licenses`` (every licence
    text) and ``stdlib`` (standard-library docstrings, up to ``max_chars``), written in BERT layout under
    ``directory``; returns name -> file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return {"licenses": _write_documents(directory / "licenses.txt", _license_documents(), max_chars),
            "stdlib": _write_documents(directory / "stdlib.txt", _stdlib_documents(), max_chars)}


def _write_documents(path: str | Path, documents: list[list[str]], max_chars: int) -> Path:
    path = Path(path)
    chars = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in documents:
            doc = [s.replace("\n", " ") for s in doc if s.strip()]
            if len(doc) < 2:
                continue
            f.write("\n".join(doc) + "\n\n")
            chars += sum(map(len, doc))
            if chars >= max_chars:
                break
    return path
