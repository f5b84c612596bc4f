"""Regenerates tests/assets/squad/official_outputs.json: crafted SQuAD v1.1 / v2.0 cases scored by the official
evaluation scripts (``evaluate-v1.1.py`` and ``evaluate-v2.0.py`` from the SQuAD site; not shipped with bert_ds).

    python tests/downstream/make_squad_golden.py --v1 /path/evaluate-v1.1.py --v2 /path/evaluate-v2.0.py

Each case holds the dataset (SQuAD JSON ``data``), the predictions, the no-answer probabilities and threshold, and the
official script's JSON output; tests/downstream/test_metrics.py checks bert_ds.downstream.metrics against them.
Crafted cases hit the normalisation's corner cases; random cases draw contexts from the real English corpus the test
suite uses and predictions from spans near the gold answers.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "assets" / "squad" / "official_outputs.json"

# (gold answers, prediction): each hits one rule of the normalisation or of the scoring.
V1_CRAFTED = [
    (["the Eiffel Tower"], "Eiffel Tower"),              # article dropped
    (["An apple a day"], "apple day"),                   # a / an dropped, case
    (["U.S.A."], "USA"),                                 # ASCII punctuation removed inside a word
    (["Denver Broncos", "the Broncos", "Broncos"], "Broncos team"),  # max over several gold answers
    (["Denver Broncos", "Carolina Panthers"], "Panthers of Carolina"),
    (["Paris"], ""),                                     # empty prediction
    (["«Paris»"], "Paris"),                              # non-ASCII punctuation is kept
    (["1914—1918"], "1914 1918"),                        # em dash kept: one token against two
    (["“quoted”"], "quoted"),                            # curly quotes kept
    (["New York"], "  New   York\n"),                    # whitespace collapsed
    (["NEW YORK CITY"], "new york"),                     # partial overlap
    (["Plan A"], "Plan B"),                              # the letter "a" is an article
    (["theater"], "ater"),                               # "the" inside a word stays
    (["the the cat cat"], "cat cat cat"),                # repeated tokens: multiset overlap
    (["1,000"], "1000"),                                 # comma removed
    (["don't"], "dont"),                                 # apostrophe removed
    (["Café"], "CAFÉ"),                                  # unicode lower-casing
    (["a"], "the"),                                      # both normalise to empty: v1.1 F1 0, EM 1
    (["in 1066."], "In 1066"),
    (["the"], "an answer"),
]

# (gold answers ([] = unanswerable), prediction, no-answer probability)
V2_CRAFTED = [
    ([], "", 0.9),                      # unanswerable, abstains: right
    ([], "something", 0.2),             # unanswerable, answers: wrong
    (["Paris"], "", 0.7),               # answerable, abstains: wrong
    (["the Eiffel Tower"], "Eiffel Tower", 0.1),
    (["Denver Broncos", "the Broncos"], "Broncos", 0.4),
    (["the"], "", 0.3),                 # gold normalises to empty: only "" is right, yet it counts as HasAns
    (["..."], "dots", 0.3),             # same, tie in probability with the previous one
    (["«Paris»"], "Paris", 0.5),
    (["New York City"], "york", 0.5),   # partial F1, another tie
    ([], "", 0.05),
    ([], "a", 0.6),                     # prediction normalises to empty: still a non-empty string for the sweep
    (["1,000"], "1000", 0.95),
]


def _squad(questions: list[tuple[str, list[str], list[int], str]], version: str) -> dict:
    """A SQuAD document from (context, gold texts, gold starts, question id), one paragraph per context."""
    paragraphs = []
    for context, texts, starts, qid in questions:
        qa = {"id": qid, "question": f"What about {qid}?",
              "answers": [{"text": t, "answer_start": s} for t, s in zip(texts, starts, strict=True)]}
        if version == "v2.0":
            qa["is_impossible"] = not texts
        paragraphs.append({"context": context, "qas": [qa]})
    return {"version": version, "data": [{"title": "crafted", "paragraphs": paragraphs}]}


def _crafted_v1() -> tuple[dict, dict]:
    questions, predictions = [], {}
    for i, (golds, prediction) in enumerate(V1_CRAFTED):
        context = " ; ".join(golds)
        starts = [context.index(g) for g in golds]
        questions.append((context, golds, starts, f"v1-{i}"))
        predictions[f"v1-{i}"] = prediction
    questions.append(("Nobody predicted this.", ["this"], [17], "v1-missing"))  # no prediction: scores 0
    return _squad(questions, "1.1"), predictions


def _crafted_v2() -> tuple[dict, dict, dict]:
    questions, predictions, na = [], {}, {}
    for i, (golds, prediction, prob) in enumerate(V2_CRAFTED):
        context = " ; ".join(golds) or "An unanswerable paragraph."
        questions.append((context, golds, [context.index(g) for g in golds], f"v2-{i}"))
        predictions[f"v2-{i}"], na[f"v2-{i}"] = prediction, prob
    return _squad(questions, "v2.0"), predictions, na


def _random_cases(corpus: Path, rng: random.Random, n: int, version: str):
    """Real sentences as contexts; gold = 1-3 spans, prediction = a nearby span, a gold answer, a span of another
    sentence, or (v2.0) empty; a quarter of the v2.0 questions unanswerable; probabilities rounded to 0.1 (ties)."""
    sentences = [s for s in corpus.read_text(encoding="utf-8").splitlines() if 40 <= len(s) <= 300]
    questions, predictions, na = [], {}, {}
    for i in range(n):
        context = rng.choice(sentences)
        words = context.split(" ")
        qid = f"{version}-r{i}"
        golds = []
        if version == "1.1" or rng.random() > 0.25:
            for _ in range(rng.randint(1, 3)):
                a = rng.randrange(len(words))
                golds.append(" ".join(words[a:a + rng.randint(1, 6)]))
        starts = [context.index(g) for g in golds]
        questions.append((context, golds, starts, qid))
        roll = rng.random()
        if golds and roll < 0.3:
            predictions[qid] = rng.choice(golds)
        elif roll < 0.7:
            a = rng.randrange(len(words))
            predictions[qid] = " ".join(words[a:a + rng.randint(1, 8)])
        elif roll < 0.85 or version == "1.1":
            other = rng.choice(sentences).split(" ")
            predictions[qid] = " ".join(other[:rng.randint(1, 5)])
        else:
            predictions[qid] = ""
        na[qid] = round(rng.random(), 1)
    return _squad(questions, version), predictions, na


def _run(script: str, data: dict, predictions: dict, na: dict | None, thresh: float | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "data.json").write_text(json.dumps(data), encoding="utf-8")
        (tmp / "pred.json").write_text(json.dumps(predictions), encoding="utf-8")
        cmd = [sys.executable, script, str(tmp / "data.json"), str(tmp / "pred.json")]
        if na is not None:
            (tmp / "na.json").write_text(json.dumps(na), encoding="utf-8")
            cmd += ["--na-prob-file", str(tmp / "na.json"), "--out-file", str(tmp / "out.json")]
            if thresh is not None:
                cmd += ["--na-prob-thresh", str(thresh)]
            subprocess.run(cmd, check=True)
            return json.loads((tmp / "out.json").read_text())
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()
        return json.loads(out[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--v1", required=True, help="the official evaluate-v1.1.py")
    parser.add_argument("--v2", required=True, help="the official evaluate-v2.0.py")
    args = parser.parse_args()
    from bert_ds.data.english_corpus import build_english_corpus

    rng = random.Random(15)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = build_english_corpus(Path(tmp) / "english.txt", max_chars=200_000)
        random_v1 = _random_cases(corpus, rng, 150, "1.1")
        random_v2 = _random_cases(corpus, rng, 150, "v2.0")
    cases = []
    data, predictions = _crafted_v1()
    cases.append({"name": "v1_crafted", "version": 1, "data": data, "predictions": predictions})
    data, predictions, _ = random_v1
    cases.append({"name": "v1_random", "version": 1, "data": data, "predictions": predictions})
    data, predictions, na = _crafted_v2()
    for thresh in (1.0, 0.5, 0.0):
        cases.append({"name": f"v2_crafted_thresh_{thresh}", "version": 2, "data": data, "predictions": predictions,
                      "na_probs": na, "na_prob_thresh": thresh})
    # One question per case as well: the official output is then that question's own exact / F1.
    for i, (golds, prediction) in enumerate(V1_CRAFTED):
        context = " ; ".join(golds)
        data = _squad([(context, golds, [context.index(g) for g in golds], f"v1-{i}")], "1.1")
        cases.append({"name": f"v1_single_{i}", "version": 1, "data": data, "predictions": {f"v1-{i}": prediction}})
    for i, (golds, prediction, prob) in enumerate(V2_CRAFTED):
        context = " ; ".join(golds) or "An unanswerable paragraph."
        data = _squad([(context, golds, [context.index(g) for g in golds], f"v2-{i}")], "v2.0")
        cases.append({"name": f"v2_single_{i}", "version": 2, "data": data, "predictions": {f"v2-{i}": prediction},
                      "na_probs": {f"v2-{i}": prob}, "na_prob_thresh": 1.0})
    data, predictions, na = random_v2
    for thresh in (1.0, 0.45):
        cases.append({"name": f"v2_random_thresh_{thresh}", "version": 2, "data": data, "predictions": predictions,
                      "na_probs": na, "na_prob_thresh": thresh})
    for case in cases:
        script = args.v1 if case["version"] == 1 else args.v2
        case["official"] = _run(script, {"version": case["data"]["version"], "data": case["data"]["data"]},
                                case["predictions"], case.get("na_probs"), case.get("na_prob_thresh"))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"cases": cases}, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
