"""``tools/finetune.py`` on an export made by the real converter, with small tasks built from real English text (the
``english_corpus`` fixture: licence texts, then Python stdlib docstrings):

* single sentence: does the sentence come from a licence or from a docstring;
* sentence pair: one licence sentence and one docstring sentence; which comes first (a label that depends on how
  the two segments are encoded, as MNLI's and QQP's do);
* tokens: tag each word as a number, punctuation, a function word or other.

The export is a randomly initialised tiny bert_ds model converted by the real converter (no pre-training: the test is
about the fine-tuning path, and these tasks are learnable from scratch in under a hundred CPU steps). NSP's own
question, "is B the sentence after A", is not: from a random start it stays at chance (measured: validation loss
0.693 -> 0.699 after 90 steps), and "are A and B from the same source" only memorises the training pairs (0.69 ->
0.92 after 160 steps). Each task must lower the validation loss and beat always answering the most frequent label.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import random
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from bert_ds.data.english_corpus import LICENSES
from bert_ds.downstream.finetune import METRICS_NAME
from tests.helpers import HANG_GUARD_S
from tests.helpers.hf_export import random_tiny_export

REPO = Path(__file__).resolve().parents[1]
FUNCTION_WORDS = frozenset("the a an of to in on for by with from at as or and that this these those is are be "
                           "was were it its not no".split())
SEED = 0


def _cli():
    spec = importlib.util.spec_from_file_location("tools_finetune", REPO / "tools" / "finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def export_dir(tokenizer_dir, tmp_path_factory) -> Path:
    """A random tiny bert_ds model over the corpus's WordPiece vocabulary, exported by the real converter."""
    return random_tiny_export(tokenizer_dir, tmp_path_factory.mktemp("finetune_export"), seed=SEED)


def _documents(corpus: Path) -> list[list[str]]:
    return [block.splitlines() for block in corpus.read_text(encoding="utf-8").split("\n\n") if block.strip()]


def _source_of(documents: list[list[str]]) -> list[str]:
    """``licence`` or ``docstring`` per document: a licence document's first sentence occurs in a licence file."""
    licences = " ".join(" ".join(p.read_text(encoding="utf-8", errors="replace").split())
                        for p in LICENSES.glob("*") if p.is_file())
    return ["licence" if " ".join(doc[0].split()) in licences else "docstring" for doc in documents]


def _usable(sentence: str) -> bool:
    return 6 <= len(sentence.split()) <= 40


@pytest.fixture(scope="module")
def documents(english_corpus) -> tuple[list[list[str]], list[str]]:
    docs = _documents(english_corpus)
    sources = _source_of(docs)
    assert {"licence", "docstring"} <= set(sources)
    return docs, sources


def _split(rows: list[dict], n_validation: int) -> tuple[list[dict], list[dict]]:
    random.Random(SEED).shuffle(rows)
    return rows[n_validation:], rows[:n_validation]


def single_sentence_rows(docs, sources, per_class: int) -> list[dict]:
    rows = []
    for label in ("licence", "docstring"):
        pool = [s for doc, src in zip(docs, sources, strict=True) if src == label for s in doc if _usable(s)]
        rows += [{"sentence": s, "source": label} for s in random.Random(SEED).sample(pool, per_class)]
    return rows


def licence_position_rows(docs, sources, count: int) -> list[dict]:
    pools = {label: [s for doc, src in zip(docs, sources, strict=True) if src == label for s in doc
                     if _usable(s) and len(s.split()) <= 20] for label in ("licence", "docstring")}
    rng = random.Random(SEED)
    rows = []
    for _ in range(count):
        licence, docstring = rng.choice(pools["licence"]), rng.choice(pools["docstring"])
        if rng.random() < 0.5:
            rows.append({"a": licence, "b": docstring, "first": "licence"})
        else:
            rows.append({"a": docstring, "b": licence, "first": "docstring"})
    return rows


def word_tag(word: str) -> str:
    if any(c.isdigit() for c in word):
        return "NUM"
    if not any(c.isalnum() for c in word):
        return "PUNCT"
    return "FUNC" if word.lower() in FUNCTION_WORDS else "O"


def token_rows(docs, count: int) -> list[dict]:
    sentences = [s for doc in docs for s in doc if _usable(s)]
    rows = []
    for sentence in random.Random(SEED).sample(sentences, count):
        words = re.findall(r"\w+|[^\w\s]", sentence)[:40]
        rows.append({"words": words, "tags": [word_tag(w) for w in words]})
    return rows


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _assert_learned(metrics: dict, margin: float) -> None:
    before, after, chance = metrics["before"], metrics["after"], metrics["majority_accuracy"]
    assert after["loss"] < before["loss"], metrics
    losses = [e["loss"] for e in metrics["train_loss_log"]]
    assert len(losses) >= 3 and min(losses[-2:]) < losses[0], losses
    assert after["accuracy"] >= chance + margin, metrics


@pytest.mark.slow  # in-process CPU fine-tuning, minutes: the whole suite only
def test_single_sentence_classification_learns(export_dir, documents, tmp_path, capsys):
    train, validation = _split(single_sentence_rows(*documents, per_class=240), 160)
    out = tmp_path / "model"
    code = _cli()(["--model", str(export_dir), "--train", str(write_csv(tmp_path / "train.csv", train)),
                   "--validation", str(write_csv(tmp_path / "dev.csv", validation)), "--out", str(out),
                   "--text-column", "sentence", "--label-column", "source", "--max-seq-length", "64",
                   "--epochs", "3", "--batch-size", "16", "--learning-rate", "5e-4", "--device", "cpu"])
    assert code == 0
    assert "validation: loss" in capsys.readouterr().out
    metrics = json.loads((out / METRICS_NAME).read_text())
    _assert_learned(metrics, margin=0.15)
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "docstring", "1": "licence"}
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o666 & ~umask  # not safetensors' 0600
    # The saved model answers with label names through a stock pipeline.
    classify = transformers.pipeline("text-classification", model=str(out), tokenizer=str(out), device="cpu")
    answers = classify([r["sentence"] for r in validation], batch_size=32)
    hits = [a["label"] == r["source"] for a, r in zip(answers, validation, strict=True)]
    assert sum(hits) / len(hits) == pytest.approx(metrics["after"]["accuracy"], abs=1e-6)


@pytest.mark.slow  # in-process CPU fine-tuning, minutes: the whole suite only
def test_sentence_pair_classification_learns(export_dir, documents, tmp_path):
    train, validation = _split(licence_position_rows(*documents, count=640), 160)
    out = tmp_path / "model"
    code = _cli()(["--model", str(export_dir), "--train", str(write_jsonl(tmp_path / "train.jsonl", train)),
                   "--validation", str(write_jsonl(tmp_path / "dev.jsonl", validation)), "--out", str(out),
                   "--text-column", "a", "--text-pair-column", "b", "--label-column", "first",
                   "--max-seq-length", "64", "--epochs", "3", "--batch-size", "16", "--learning-rate", "5e-4",
                   "--device", "cpu"])
    assert code == 0
    metrics = json.loads((out / METRICS_NAME).read_text())
    _assert_learned(metrics, margin=0.15)
    # The two texts reach the model as segments A and B: the saved tokenizer encodes a pair with both segment ids.
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert set(tokenizer(train[0]["a"], train[0]["b"])["token_type_ids"]) == {0, 1}


@pytest.mark.slow  # in-process CPU fine-tuning, minutes: the whole suite only
def test_token_classification_learns(export_dir, documents, tmp_path):
    docs, _ = documents
    train, validation = _split(token_rows(docs, 400), 100)
    out = tmp_path / "model"
    code = _cli()(["--model", str(export_dir), "--task", "token",
                   "--train", str(write_jsonl(tmp_path / "train.jsonl", train)),
                   "--validation", str(write_jsonl(tmp_path / "dev.jsonl", validation)), "--out", str(out),
                   "--text-column", "words", "--label-column", "tags", "--max-seq-length", "64", "--epochs", "3",
                   "--batch-size", "16", "--learning-rate", "5e-4", "--device", "cpu"])
    assert code == 0
    metrics = json.loads((out / METRICS_NAME).read_text())
    _assert_learned(metrics, margin=0.15)


def test_modules_do_not_import_deepspeed():
    # Fine-tuning and feature extraction need only the export. (accelerate, under Trainer, may still import
    # deepspeed when it is installed; that is its choice, not a dependency of these modules.)
    code = ("import sys, bert_ds.downstream.finetune, bert_ds.downstream.features; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("case, pattern", [
    ("unseen_label", "label 'neither' does not occur in the training file"),
    ("tag_count", "3 words in 'words' but 2 tags"),
    ("format", "unknown format '.txt'"),
    ("one_label", "only one distinct label"),
    ("out_not_empty", "already exists and is not an empty directory"),
])
def test_bad_input_exits_2_and_writes_nothing(export_dir, tmp_path, capsys, case, pattern):
    rows = [{"text": "first sentence here", "label": "a"}, {"text": "second one", "label": "b"}]
    train, validation, extra = write_jsonl(tmp_path / "train.jsonl", rows), None, []
    if case == "unseen_label":
        validation = write_jsonl(tmp_path / "dev.jsonl", [{"text": "third", "label": "neither"}])
    elif case == "tag_count":
        train = write_jsonl(tmp_path / "train.jsonl", [{"words": ["a", "b", "c"], "tags": ["X", "Y"]}])
        extra = ["--task", "token", "--text-column", "words"]
    elif case == "format":
        train = tmp_path / "train.txt"
        train.write_text("first sentence here\n")
    elif case == "one_label":
        train = write_jsonl(tmp_path / "train.jsonl", [{**r, "label": "a"} for r in rows])
    out = tmp_path / "out"
    if case == "out_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("x")
    args = ["--model", str(export_dir), "--train", str(train), "--out", str(out), "--device", "cpu", *extra]
    code = _cli()(args + (["--validation", str(validation)] if validation else []))
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bert-ds-finetune: error: ") and pattern in err[-1], err[-1]
    if case == "out_not_empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
