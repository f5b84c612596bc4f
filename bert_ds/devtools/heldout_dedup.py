"""Held-out text that shares no sentence with the training text: what the demo evaluates on.

Holding out whole documents is not enough on the demo's corpus: GFDL-1.2 (held out) is a near twin of GFDL-1.3
(trained on), and standard-library modules repeat each other's docstrings ("Return self."). So after the split,
:func:`deduplicate` removes from the held-out documents

1. every document whose word 5-grams are mostly (``twin_share``) in the training text: a near twin of a trained
   document, dropped whole (its few edited sentences are still paraphrases of trained ones);
2. every sentence equal to a training sentence once case, whitespace and punctuation are dropped (exact);
3. every sentence of at least ``ngram`` words with ``near_share`` or more of its word n-grams in the training text
   (near: a word or two edited, or a trained sentence split or joined differently).

The training text's n-grams run across sentence boundaries within a document, so a held-out sentence that a trained
document splits in two is still found. A sentence whose edits are spread over it (a copyright line with other years)
keeps most 5-grams new and passes rule 3: in a twin document rule 1 takes it. :func:`leaks` applies the same rule as
a check, for tests and for the demo.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bert_ds.errors import BadInput

__all__ = ["DedupRule", "DedupReport", "normalise", "deduplicate", "leaks", "read_documents", "write_documents",
           "deduplicate_file"]

Document = list[str]
_WORD = re.compile(r"[^\W_]+")  # letters and digits of any script; case, punctuation and spacing are dropped


@dataclass(frozen=True)
class DedupRule:
    """What counts as a duplicate of the training text (recorded in the demo's ``data/inputs.json``)."""

    ngram: int = 5
    """Word n-gram length. 5 words is a phrase rather than a collocation ("return the number of bytes" is one)."""
    near_share: float = 0.5
    """A held-out sentence is a near duplicate when this share of its n-grams occurs in the training text. Measured
    on the demo's corpus: the sentences at 0.5 and above are edited copies ("Called when a return trap is
    set here." of "This function is called when ...") or stock phrases; below 0.3 they share a phrase, not a
    sentence."""
    twin_share: float = 0.5
    """A held-out document is a near twin when this share of its n-grams occurs in the training text (GFDL-1.2 vs the
    trained GFDL-1.3: 0.99; every other held-out document of the demo: 0.06 or less)."""

    def __post_init__(self) -> None:
        if self.ngram < 1:
            raise BadInput(f"ngram must be >= 1, got {self.ngram!r}")
        for name in ("near_share", "twin_share"):
            if not 0 < getattr(self, name) <= 1:
                raise BadInput(f"{name} must be in (0, 1], got {getattr(self, name)!r}")


@dataclass(frozen=True)
class DedupReport:
    """What :func:`deduplicate` removed from the held-out text, in sentences."""

    sentences: int
    """Held-out sentences before."""
    twin_documents: int
    twin_sentences: int
    """Sentences of the near-twin documents (dropped whole)."""
    exact: int
    near: int

    @property
    def kept(self) -> int:
        return self.sentences - self.twin_sentences - self.exact - self.near

    def line(self) -> str:
        return (f"held-out: {self.sentences} sentences, removed {self.exact} exact and {self.near} near duplicates of "
                f"training text and the {self.twin_sentences} sentences of {self.twin_documents} near-twin "
                f"document(s); {self.kept} kept")


def normalise(sentence: str) -> tuple[str, ...]:
    """The sentence's words, lower-cased, without punctuation: what exact duplicates are compared on."""
    return tuple(_WORD.findall(sentence.lower()))


def _ngrams(words: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _share(grams: set[tuple[str, ...]], seen: set[tuple[str, ...]]) -> float:
    return len(grams & seen) / len(grams) if grams else 0.0


class _Training:
    """The training text's normalised sentences and its n-grams (across sentence boundaries, within a document)."""

    def __init__(self, docs: Iterable[Document], n: int) -> None:
        self.sentences: set[tuple[str, ...]] = set()
        self.grams: set[tuple[str, ...]] = set()
        for doc in docs:
            words = [normalise(s) for s in doc]
            self.sentences.update(words)
            self.grams |= _ngrams([w for sentence in words for w in sentence], n)

    def verdict(self, sentence: str, rule: DedupRule) -> str | None:
        """"exact", "near" or None (kept)."""
        words = normalise(sentence)
        if words in self.sentences:
            return "exact"
        if len(words) >= rule.ngram and _share(_ngrams(words, rule.ngram), self.grams) >= rule.near_share:
            return "near"
        return None

    def twin(self, doc: Document, rule: DedupRule) -> bool:
        words = [w for s in doc for w in normalise(s)]
        return _share(_ngrams(words, rule.ngram), self.grams) >= rule.twin_share


def deduplicate(train: Sequence[Document], heldout: Sequence[Document],
                rule: DedupRule = DedupRule()) -> tuple[list[Document], DedupReport]:
    """The held-out documents without near-twin documents and without exact or near duplicates of training
    sentences (documents left empty are dropped), and the counts. Pure: nothing is read or written."""
    training = _Training(train, rule.ngram)
    kept_docs: list[Document] = []
    twins = twin_sentences = exact = near = 0
    for doc in heldout:
        if training.twin(doc, rule):
            twins, twin_sentences = twins + 1, twin_sentences + len(doc)
            continue
        kept = []
        for sentence in doc:
            verdict = training.verdict(sentence, rule)
            exact, near = exact + (verdict == "exact"), near + (verdict == "near")
            if verdict is None:
                kept.append(sentence)
        if kept:
            kept_docs.append(kept)
    report = DedupReport(sum(map(len, heldout)), twins, twin_sentences, exact, near)
    return kept_docs, report


def leaks(train: Sequence[Document], heldout: Sequence[Document],
          rule: DedupRule = DedupRule()) -> list[tuple[str, str]]:
    """(held-out sentence, "exact" | "near" | "twin document") for every held-out sentence the rule says the training
    text already holds; empty when the held-out text is clean."""
    training = _Training(train, rule.ngram)
    found = []
    for doc in heldout:
        if training.twin(doc, rule):
            found += [(s, "twin document") for s in doc]
            continue
        found += [(s, v) for s in doc if (v := training.verdict(s, rule)) is not None]
    return found


def read_documents(path: Path) -> list[Document]:
    """A BERT-layout file (one sentence a line, a blank line between documents) as lists of sentences."""
    return [d.splitlines() for d in path.read_text(encoding="utf-8").split("\n\n") if d.strip()]


def write_documents(path: Path, docs: Sequence[Document]) -> None:
    path.write_text("\n\n".join("\n".join(d) for d in docs) + "\n", encoding="utf-8")


def deduplicate_file(train: Path, heldout: Path, rule: DedupRule = DedupRule()) -> DedupReport:
    """:func:`deduplicate` on two BERT-layout files; ``heldout`` is rewritten with what is kept."""
    kept, report = deduplicate(read_documents(train), read_documents(heldout), rule)
    if not kept:
        raise BadInput(f"{heldout}: every held-out sentence duplicates the training text {train}")
    write_documents(heldout, kept)
    return report
