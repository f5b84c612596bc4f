"""Writers of fine-tuning files in their official layouts, filled with real English sentences: a GLUE data directory
(every task, train / dev / test), SQuAD v1.1 / v2.0 JSON, SWAG CSV and CoNLL-2003 column files. Shared by the reader
tests and by any test that needs a small GLUE-layout directory. Each writer returns what it wrote, as the records
``bert_ds.downstream.readers.read_split`` should give back.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

from bert_ds.downstream.tasks import CONLL_NER_TAGS, GLUE_TASKS, MNLI_DEV_HEADER

__all__ = ["real_sentences", "write_glue_dir", "write_squad", "write_swag", "write_conll"]


def real_sentences(corpus: Path, n: int | None = None, max_chars: int = 200) -> list[str]:
    """Sentences of the English corpus (no tabs, at most ``max_chars``), in corpus order. Some contain quotes."""
    out = [s.strip() for s in corpus.read_text(encoding="utf-8").splitlines()
           if 20 <= len(s.strip()) <= max_chars and "\t" not in s]
    return out if n is None else out[:n]


def _tsv(path: Path, header, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        if header is not None:
            f.write("\t".join(header) + "\n")
        for row in rows:
            f.write("\t".join(str(c) for c in row) + "\n")


def write_glue_dir(root: Path, sentences: list[str], n: int = 12, seed: int = 0) -> dict[str, dict[str, list[dict]]]:
    """A GLUE data directory with every task of ``GLUE_TASKS``: ``n`` examples per split (train, dev or MNLI's
    dev_matched / dev_mismatched, test files without labels). Returns ``{task: {split: expected records}}``."""
    rng = random.Random(seed)
    pick = iter(sentences * 50)
    expected: dict[str, dict[str, list[dict]]] = {}
    for name, spec in GLUE_TASKS.items():
        task_dir = root / spec.glue_dir
        expected[name] = {}
        for split, file_name in spec.splits.items():
            test = split.startswith("test")
            records, rows = [], []
            for i in range(n):
                a, b = next(pick), next(pick)
                label = None if test else (f"{rng.uniform(0, 5):.3f}" if name == "stsb" else rng.choice(spec.labels))
                row, idx = _glue_row(name, split, i, a, b, label, rng)
                rows.append(row)
                pair = None if name in ("cola", "sst2") else b
                value = float(label) if name == "stsb" and label is not None else label
                records.append({"text": a, "text_pair": pair, "label": value, "idx": idx})
            layout = spec.test_layout if test else spec.train_layout
            header = MNLI_DEV_HEADER if name == "mnli" and split.startswith("dev") else layout.header
            _tsv(task_dir / file_name, header, rows)
            expected[name][split] = records
    return expected


def _glue_row(name: str, split: str, i: int, a: str, b: str, label, rng: random.Random):
    """One line of task ``name``'s file, and the idx the reader should report (its id column, else the line)."""
    test = label is None
    line = i + 2  # header on line 1 (CoLA train/dev: no header, so line i + 1)
    if name == "cola":
        return (([i, a], str(i)) if test else
                ([f"gj{i:02d}", label, "" if label == "1" else "*", a], i + 1))
    if name == "sst2":
        return ([i, a], str(i)) if test else ([a, label], line)
    if name == "mrpc":
        ids = [rng.randrange(10**6), rng.randrange(10**6)]
        return ([i, *ids, a, b], str(i)) if test else ([label, *ids, a, b], line)
    if name == "qqp":
        return ([i, a, b], str(i)) if test else ([i, 2 * i, 2 * i + 1, a, b, label], str(i))
    if name == "stsb":
        front = [i, "main-captions", "MSRvid", "2012test", f"{i:04d}", "none", "none", a, b]
        return (front, str(i)) if test else (front + [label], str(i))
    if name == "mnli":
        pair_id = f"{1000 + i}{'e' if i % 2 else 'n'}"
        front = [i, 1000 + i, pair_id, "fiction", f"( {a} )", f"( {b} )", f"(ROOT {a})", f"(ROOT {b})", a, b]
        if test:
            return front, pair_id
        annotators = [label] * (5 if split.startswith("dev") else 1)
        return front + annotators + [label], pair_id
    # qnli, rte, wnli: index, two texts, label
    return ([i, a, b], str(i)) if test else ([i, a, b, label], str(i))


def write_squad(path: Path, sentences: list[str], n: int, version: int, seed: int = 0) -> list[dict]:
    """A SQuAD file: paragraphs of three real sentences, questions whose answers are spans of them (v2.0: every
    third question unanswerable, with a plausible answer as the release has)."""
    rng = random.Random(seed)
    data, expected = [{"title": "English_corpus", "paragraphs": []}], []
    for i in range(n):
        context = " ".join(sentences[3 * i:3 * i + 3])
        words = context.split(" ")
        start_word = rng.randrange(len(words) - 3)
        answer = " ".join(words[start_word:start_word + rng.randint(1, 3)])
        start = context.index(answer)
        impossible = version == 2 and i % 3 == 2
        qa = {"id": f"q{i:04d}", "question": f"Which words follow {words[max(0, start_word - 1)]!r}?"}
        if version == 2:
            qa["is_impossible"] = impossible
            qa["answers"] = [] if impossible else [{"text": answer, "answer_start": start}]
            if impossible:
                qa["plausible_answers"] = [{"text": answer, "answer_start": start}]
        else:
            qa["answers"] = [{"text": answer, "answer_start": start}, {"text": answer, "answer_start": start}]
        data[0]["paragraphs"].append({"context": context, "qas": [qa]})
        texts = [a["text"] for a in qa["answers"]]
        expected.append({"id": qa["id"], "title": "English_corpus", "question": qa["question"], "context": context,
                         "answers": {"text": texts, "answer_start": [a["answer_start"] for a in qa["answers"]]},
                         "is_impossible": not texts})
    path.write_text(json.dumps({"version": "v2.0" if version == 2 else "1.1", "data": data}, indent=1),
                    encoding="utf-8")
    return expected


SWAG_HEADER = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source", "ending0", "ending1",
               "ending2", "ending3", "label"]


def write_swag(path: Path, sentences: list[str], n: int, labelled: bool = True, seed: int = 0) -> list[dict]:
    """SWAG's CSV layout (pandas index column first, standard CSV quoting); test files lack ``label``."""
    rng = random.Random(seed)
    header = SWAG_HEADER if labelled else SWAG_HEADER[:-1]
    expected = []
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for i in range(n):
            sent1, rest = sentences[6 * i], sentences[6 * i + 1]
            words = rest.split(" ")
            sent2 = " ".join(words[:2])
            endings = [sentences[6 * i + 2 + k] for k in range(4)]
            label = rng.randrange(4)
            row = [i, f"lsmdc{i:04d}", str(5000 + i), f"{sent1} {sent2}", sent1, sent2, "gold", *endings]
            writer.writerow(row + [label] if labelled else row)
            expected.append({"context": sent1, "endings": [f"{sent2} {e}" for e in endings],
                             "label": label if labelled else None, "idx": str(5000 + i)})
    return expected


def write_conll(path: Path, sentences: list[str], n: int, seed: int = 0) -> list[dict]:
    """CoNLL-2003 layout: ``-DOCSTART- -X- -X- O`` then a blank line per document, ``token POS chunk NER`` lines,
    a blank line after each sentence. Tags are valid IOB2 over the nine CoNLL tags."""
    rng = random.Random(seed)
    types = sorted({t[2:] for t in CONLL_NER_TAGS if t != "O"})
    lines, expected = [], []
    for i in range(n):
        if i % 4 == 0:
            lines += ["-DOCSTART- -X- -X- O", ""]
        tokens = sentences[i].split()
        tags, inside = [], None
        for _ in tokens:
            roll = rng.random()
            if roll < 0.15:
                inside = rng.choice(types)
                tags.append(f"B-{inside}")
            elif roll < 0.3 and inside:
                tags.append(f"I-{inside}")
            else:
                inside = None
                tags.append("O")
        start = len(lines) + 1
        lines += [f"{tok} NNP {'I-NP' if tag != 'O' else 'O'} {tag}" for tok, tag in zip(tokens, tags, strict=True)]
        lines.append("")
        expected.append({"tokens": tokens, "tags": tags, "idx": start})
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return expected
