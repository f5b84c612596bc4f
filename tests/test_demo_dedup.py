"""The demo's held-out text shares no sentence with its training text (``bert_ds.devtools.heldout_dedup``): proven on
the real GFDL pair and the demo's own split, and shown to catch planted duplicates."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from bert_ds.data.english_corpus import LICENSES, build_english_corpus
from bert_ds.data.text import split_sentences
from bert_ds.devtools.demo import DemoSettings, data_inputs, split_corpus
from bert_ds.devtools.heldout_dedup import (
    DedupRule,
    deduplicate,
    deduplicate_file,
    leaks,
    normalise,
    read_documents,
)

GFDL_12, GFDL_13 = LICENSES / "GFDL-1.2", LICENSES / "GFDL-1.3"


def _licence(path: Path) -> list[str]:
    return [s.replace("\n", " ") for s in split_sentences(path.read_text(encoding="utf-8")) if s.strip()]


def _similar(a: str, b: str) -> float:
    """An independent measure of the rule's target: difflib's word-sequence similarity of two sentences."""
    return difflib.SequenceMatcher(None, normalise(a), normalise(b), autojunk=False).ratio()


@pytest.mark.skipif(not GFDL_12.is_file() or not GFDL_13.is_file(), reason="Debian's base-files licence texts")
def test_gfdl_12_held_out_against_gfdl_13_trained_leaves_no_shared_sentence():
    trained, held = _licence(GFDL_13), _licence(GFDL_12)
    # The leak the split alone left: most of GFDL-1.2 is GFDL-1.3 verbatim.
    assert sum(normalise(s) in {normalise(t) for t in trained} for s in held) > 0.8 * len(held)
    kept, report = deduplicate([trained], [held])
    assert kept == [] and (report.twin_documents, report.twin_sentences, report.kept) == (1, len(held), 0)
    # Sentence by sentence (twin detection off): a handful survive, none equal to or a close edit of a GFDL-1.3
    # sentence, measured by difflib rather than by the rule's own n-grams. The closest are the title and the copyright
    # line, which differ in version and years (0.74 and 0.79 with base-files 12.4): why twins are dropped whole.
    by_sentence = DedupRule(twin_share=1.0)
    kept, report = deduplicate([trained], [held], by_sentence)
    survivors = [s for doc in kept for s in doc]
    assert report.twin_documents == 0 and report.exact > 0.8 * len(held) and report.near > 0
    assert len(survivors) == report.kept <= 5 and leaks([trained], kept, by_sentence) == []
    worst = max((_similar(s, t), s, t) for s in survivors for t in trained)
    assert worst[0] < 0.8, worst


def test_planted_duplicates_are_caught_and_new_sentences_kept():
    train = [["The quick brown fox jumps over the lazy dog near the river bank.",
              "Every archive member is extracted to the current working directory by default."]]
    new = ["A socket timeout raises an error that names the host and the port.",
           "Each worker reads its own shard and skips the records another rank owns.",
           "The parser stops at the first blank line and returns the headers it has read so far."]
    planted = ["the QUICK brown fox -- jumps over the lazy dog, near the river bank",  # exact after normalising
               "Every archive member is extracted to the current working directory unless told otherwise.",  # near
               *new]
    assert leaks(train, [planted]) == [(planted[0], "exact"), (planted[1], "near")]
    kept, report = deduplicate(train, [planted])
    assert kept == [new] and (report.exact, report.near, report.twin_documents, report.kept) == (1, 1, 0, 3)
    assert leaks(train, kept) == []
    # A near twin of a trained document is dropped whole, its one new sentence with it.
    twin = train[0] + ["This one sentence is new."]
    kept, report = deduplicate(train, [twin, new])
    assert kept == [new] and (report.twin_documents, report.twin_sentences) == (1, 3)
    assert [v for _, v in leaks(train, [twin])] == ["twin document"] * 3


def test_the_demo_split_is_clean_after_deduplication_and_leaked_before(tmp_path):
    corpus = build_english_corpus(tmp_path / "english.txt", max_chars=10**9)  # all of it, as the demo builds it
    train, held = tmp_path / "train.txt", tmp_path / "heldout.txt"
    split_corpus(corpus, train, held, DemoSettings().heldout_every)
    before = leaks(read_documents(train), read_documents(held))
    assert any(v == "twin document" for _, v in before) and any(v == "exact" for _, v in before)
    report = deduplicate_file(train, held)
    assert report.kept == sum(map(len, read_documents(held))) and report.twin_documents >= 1
    assert report.exact + report.near + report.twin_sentences == len(before)
    assert leaks(read_documents(train), read_documents(held)) == []
    trained = {normalise(s) for doc in read_documents(train) for s in doc}
    assert not [s for doc in read_documents(held) for s in doc if normalise(s) in trained]


def test_changing_the_dedup_rule_invalidates_the_demo_data():
    base = data_inputs("0" * 64, DemoSettings())
    assert base == data_inputs("0" * 64, DemoSettings())
    assert base["settings"]["dedup"] == {"ngram": 5, "near_share": 0.5, "twin_share": 0.5}
    assert len(base["dedup_code_sha256"]) == 64  # the rule's code itself, not only its parameters
    for rule in (DedupRule(ngram=4), DedupRule(near_share=0.6), DedupRule(twin_share=0.9)):
        assert data_inputs("0" * 64, DemoSettings(dedup=rule)) != base


@pytest.mark.parametrize("field,value", [("ngram", 0), ("near_share", 0.0), ("twin_share", 1.5)])
def test_dedup_rule_refuses_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        DedupRule(**{field: value})
