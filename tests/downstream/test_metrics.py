"""Every fine-tuning metric against an independent implementation on the same predictions: scikit-learn (accuracy,
F1, MCC), scipy (Pearson, Spearman), seqeval and a conlleval-rule chunker written here (entity F1), and the outputs of
the official SQuAD v1.1 / v2.0 evaluation scripts on crafted and random predictions
(tests/assets/squad/official_outputs.json, made by tests/downstream/make_squad_golden.py).

Tolerances: the classification metrics are ratios of integer counts (equal to 1e-12); correlations are float64 sums
of at most 2,000 terms, whose rounding stays below 1e-12 relative, while a real difference (a wrong tie rank, a
missing centring) moves them by more than 1e-3.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics
from seqeval.metrics import classification_report
from seqeval.metrics import f1_score as seqeval_f1

from bert_ds.downstream import metrics
from bert_ds.downstream.metrics import compute_metrics, normalize_answer, squad_v1, squad_v2
from bert_ds.downstream.readers import read_split

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "squad" / "official_outputs.json"


def _random_labels(rng, n, k):
    return rng.integers(0, k, n).tolist(), rng.integers(0, k, n).tolist()


# ------------------------------------------------------------------------------------------ classification
@pytest.mark.parametrize("seed", range(20))
def test_accuracy_f1_mcc_match_scikit_learn_on_random_predictions(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    k = 2 if seed % 2 else int(rng.integers(2, 6))
    predictions, references = _random_labels(rng, n, k)
    if seed % 3 == 0:  # correlated predictions, not just noise: MCC far from 0
        predictions = [r if rng.random() < 0.8 else p for p, r in zip(predictions, references, strict=True)]
    got = compute_metrics(["accuracy", "mcc", "f1"], predictions, references)
    assert got["accuracy"] == pytest.approx(sklearn.metrics.accuracy_score(references, predictions), abs=1e-12)
    assert got["mcc"] == pytest.approx(sklearn.metrics.matthews_corrcoef(references, predictions), abs=1e-12)
    binary_p = [int(p == 1) for p in predictions]
    binary_r = [int(r == 1) for r in references]
    expected_f1 = sklearn.metrics.f1_score(binary_r, binary_p, pos_label=1, zero_division=0)
    assert metrics.binary_f1(binary_p, binary_r) == pytest.approx(expected_f1, abs=1e-12)
    if k == 2:
        assert got["f1"] == pytest.approx(expected_f1, abs=1e-12)


@pytest.mark.parametrize("predictions,references", [
    ([1] * 10, [0, 1] * 5),            # constant prediction: MCC 0, not NaN
    ([0] * 10, [0, 1] * 5),            # no positive prediction: F1 0
    ([0] * 6, [0] * 6),                # no positive anywhere
    ([1, 1, 1], [1, 1, 1]),            # constant and right
    ([1, 0, 1, 0], [0, 1, 0, 1]),      # all wrong: MCC -1
    (["neutral", "entailment", "contradiction", "neutral"], ["neutral", "neutral", "contradiction", "entailment"]),
])
def test_degenerate_classification_cases(predictions, references):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scikit-learn warns about the zero divisions it resolves to 0
        assert metrics.matthews_corrcoef(predictions, references) == pytest.approx(
            sklearn.metrics.matthews_corrcoef(references, predictions), abs=1e-12)
        assert metrics.accuracy(predictions, references) == sklearn.metrics.accuracy_score(references, predictions)
        if not isinstance(predictions[0], str):
            assert metrics.binary_f1(predictions, references) == pytest.approx(
                sklearn.metrics.f1_score(references, predictions, pos_label=1, zero_division=0), abs=1e-12)
    if len(set(predictions)) == 1:
        assert metrics.matthews_corrcoef(predictions, references) == 0.0


# ------------------------------------------------------------------------------------------ correlations
@pytest.mark.parametrize("seed", range(15))
def test_pearson_spearman_match_scipy(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(3, 2000))
    references = rng.uniform(0, 5, n)
    predictions = references + rng.normal(0, 1 + seed % 4, n)
    if seed % 3 == 1:  # STS-B scores come in steps of 0.2: many ties on both sides
        references, predictions = np.round(references * 5) / 5, np.round(predictions)
    if seed % 5 == 2:  # a large offset: a one-pass formula would lose the digits
        predictions = predictions + 1e6
    got = compute_metrics(["pearson", "spearman"], predictions.tolist(), references.tolist())
    assert got["pearson"] == pytest.approx(scipy.stats.pearsonr(predictions, references)[0], rel=1e-12, abs=1e-12)
    assert got["spearman"] == pytest.approx(scipy.stats.spearmanr(predictions, references)[0], rel=1e-12, abs=1e-12)


def test_spearman_ties_use_average_ranks():
    predictions, references = [1, 2, 2, 2, 3, 3], [1, 2, 3, 4, 5, 6]
    assert metrics.spearman(predictions, references) == pytest.approx(
        scipy.stats.spearmanr(predictions, references)[0], abs=1e-12)
    np.testing.assert_array_equal(metrics._average_ranks(np.array([3.0, 1.0, 2.0, 2.0, 2.0, 3.0])),
                                  scipy.stats.rankdata([3, 1, 2, 2, 2, 3]))
    # Min-ranks (ties all given the lowest rank) would give another value: the test above can tell them apart.
    assert metrics.pearson([1, 2, 2, 2, 5, 5], references) != pytest.approx(
        metrics.spearman(predictions, references), abs=1e-3)


def test_constant_input_correlations_are_nan_like_scipy():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert math.isnan(scipy.stats.pearsonr([2.0] * 5, [1, 2, 3, 4, 5])[0])
        assert math.isnan(scipy.stats.spearmanr([2.0] * 5, [1, 2, 3, 4, 5])[0])
    assert math.isnan(metrics.pearson([2.0] * 5, [1, 2, 3, 4, 5]))
    assert math.isnan(metrics.spearman([1, 2, 3, 4, 5], [0.5] * 5))


# ------------------------------------------------------------------------------------------ entity F1
def _conlleval_chunks(tags: list[str]) -> set[tuple[int, int, str]]:
    """Chunks by conlleval's rules (written from the rules, not from seqeval): a chunk ends before a B, an O or a type
    change; it starts at a B, or at an I that follows O or another type."""
    chunks, start, kind = set(), None, None
    for i, tag in enumerate([*tags, "O"]):
        prefix, current = (tag[0], tag[2:]) if tag != "O" else ("O", None)
        if start is not None and (prefix in ("B", "O") or current != kind):
            chunks.add((start, i, kind))
            start, kind = None, None
        if prefix == "B" or (prefix == "I" and start is None):
            start, kind = i, current
    return chunks


def _conlleval_f1(predictions, references) -> float:
    found = correct = gold = 0
    for s, (p, r) in enumerate(zip(predictions, references, strict=True)):
        pc = {(s, *c) for c in _conlleval_chunks(p)}
        rc = {(s, *c) for c in _conlleval_chunks(r)}
        found, gold, correct = found + len(pc), gold + len(rc), correct + len(pc & rc)
    precision = correct / found if found else 0.0
    recall = correct / gold if gold else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def _random_tags(rng, n_sentences, valid_iob2: bool):
    tags = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
    out = []
    for _ in range(n_sentences):
        seq = [tags[i] for i in rng.integers(0, len(tags), int(rng.integers(1, 25)))]
        if valid_iob2:  # an I- continues the previous tag's type, else it becomes a B-
            for i, t in enumerate(seq):
                if t.startswith("I-") and (i == 0 or seq[i - 1] == "O" or seq[i - 1][2:] != t[2:]):
                    seq[i] = "B-" + t[2:]
        out.append(seq)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_entity_f1_matches_seqeval_and_conlleval_rules(seed):
    rng = np.random.default_rng(200 + seed)
    references = _random_tags(rng, 40, valid_iob2=seed % 2 == 0)
    predictions = [[t if rng.random() < 0.75 else p for t, p in zip(r, q, strict=True)]
                   for r, q in zip(references, _random_tags_like(rng, references), strict=True)]
    got = compute_metrics(["entity_f1", "entity_precision", "entity_recall"], predictions, references)
    report = classification_report(references, predictions, output_dict=True, zero_division=0)["micro avg"]
    assert got["entity_f1"] == pytest.approx(seqeval_f1(references, predictions), abs=1e-12)
    assert got["entity_f1"] == pytest.approx(report["f1-score"], abs=1e-12)
    assert got["entity_precision"] == pytest.approx(report["precision"], abs=1e-12)
    assert got["entity_recall"] == pytest.approx(report["recall"], abs=1e-12)
    assert got["entity_f1"] == pytest.approx(_conlleval_f1(predictions, references), abs=1e-12)


def _random_tags_like(rng, references):
    tags = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
    return [[tags[i] for i in rng.integers(0, len(tags), len(r))] for r in references]


def test_entity_f1_crafted():
    references = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "I-ORG", "I-ORG"]]
    # Right PER, LOC typed as ORG, ORG cut short: 1 of 3 predicted entities right, 1 of 3 gold entities found.
    predictions = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "I-ORG", "O"]]
    got = compute_metrics(["entity_f1", "entity_precision", "entity_recall", "accuracy"], predictions, references)
    assert got == pytest.approx({"entity_f1": 1 / 3, "entity_precision": 1 / 3, "entity_recall": 1 / 3,
                                 "accuracy": 5 / 7})
    assert compute_metrics(["entity_f1"], [["O", "O"]], [["O", "O"]]) == {"entity_f1": 0.0}


# ------------------------------------------------------------------------------------------ SQuAD
def _golden_cases():
    return json.loads(GOLDEN.read_text(encoding="utf-8"))["cases"]


@pytest.mark.parametrize("case", _golden_cases(), ids=lambda c: c["name"])
def test_squad_equals_the_official_scripts(case, tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(case["data"]), encoding="utf-8")
    examples = read_split("squad_v1" if case["version"] == 1 else "squad_v2", path)
    if case["version"] == 1:
        got = squad_v1(case["predictions"], examples)
    else:
        got = squad_v2(case["predictions"], examples, case["na_probs"], case["na_prob_thresh"])
    official = case["official"]
    assert set(official) <= set(got)
    for key, value in official.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_golden_cases_hit_the_corner_cases():
    """The golden file's crafted cases contain what the normalisation must get right, so a change there shows."""
    cases = {c["name"]: c for c in _golden_cases()}
    v1 = cases["v1_crafted"]
    golds = [a["text"] for p in v1["data"]["data"][0]["paragraphs"] for a in p["qas"][0]["answers"]]
    assert {"the Eiffel Tower", "U.S.A.", "«Paris»", "Plan A", "Café", "theater"} <= set(golds)
    assert "" in v1["predictions"].values() and "v1-missing" not in v1["predictions"]
    v2 = cases["v2_crafted_thresh_0.5"]
    assert v2["official"]["NoAns_total"] and v2["official"]["HasAns_total"]
    assert len(set(v2["na_probs"].values())) < len(v2["na_probs"]), "ties in no-answer probabilities"
    assert {c["official"]["exact"] for n, c in cases.items() if n.startswith("v2_crafted")} != {50.0}


def test_normalisation_rules():
    assert normalize_answer("  The  Eiffel, Tower! ") == "eiffel tower"
    assert normalize_answer("Plan A") == "plan"                 # "a" is an article, even as a letter
    assert normalize_answer("theater") == "theater"
    assert normalize_answer("«Paris»") == "«paris»"             # only ASCII punctuation goes
    assert normalize_answer("1,000") == "1000"
    assert metrics.squad_f1("the the cat cat", "cat cat cat") == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert metrics.squad_f1("", "") == 1.0 and metrics.squad_f1("", "", empty_matches_empty=False) == 0.0


def test_squad_v2_without_na_probs_and_refusals():
    examples = [{"id": "a", "answers": {"text": ["Paris"], "answer_start": [0]}},
                {"id": "b", "answers": {"text": [], "answer_start": []}}]
    got = squad_v2({"a": "paris", "b": ""}, examples)
    assert got["exact"] == got["f1"] == got["best_exact"] == 100.0
    assert got["HasAns_exact"] == got["NoAns_exact"] == 100.0 and got["best_exact_thresh"] == 0.0
    with pytest.raises(ValueError, match="1 questions have no prediction"):
        squad_v2({"a": "paris"}, examples)
    with pytest.raises(ValueError, match="na_probs lacks 1 questions"):
        squad_v2({"a": "paris", "b": ""}, examples, {"a": 0.5})
    assert squad_v1({}, examples[:1]) == {"exact_match": 0.0, "f1": 0.0}


def test_compute_metrics_refuses_unknown_names_and_mismatched_lengths():
    with pytest.raises(ValueError, match="unknown metric 'bleu'"):
        compute_metrics(["bleu"], [1], [1])
    with pytest.raises(ValueError, match="one length"):
        compute_metrics(["accuracy"], [1, 0], [1])
    with pytest.raises(ValueError, match="no predictions"):
        compute_metrics(["mcc"], [], [])
    with pytest.raises(ValueError, match="sequence 0: 1 predicted tags but 2"):
        compute_metrics(["entity_f1"], [["O"]], [["O", "O"]])


def test_squad_command_line_prints_the_official_result(tmp_path):
    import subprocess
    import sys

    cases = {c["name"]: c for c in _golden_cases()}
    for name in ("v1_crafted", "v2_crafted_thresh_0.5"):
        case = cases[name]
        files = {}
        for key, value in (("data", case["data"]), ("pred", case["predictions"]), ("na", case.get("na_probs"))):
            files[key] = tmp_path / f"{name}_{key}.json"
            files[key].write_text(json.dumps(value), encoding="utf-8")
        cmd = [sys.executable, "-m", "bert_ds.downstream.metrics", str(files["data"]), str(files["pred"])]
        if case["version"] == 2:
            cmd += ["--na-prob-file", str(files["na"]), "--na-prob-thresh", str(case["na_prob_thresh"])]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
        got = json.loads(done.stdout)
        for key, value in case["official"].items():
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), (name, key)
    bad = tmp_path / "bad_pred.json"
    bad.write_text('{"v1-0": "Eiffel",\n "v1-1": }', encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "bert_ds.downstream.metrics", str(files["data"]), str(bad)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"error: {bad}: line 2, column 10: not valid JSON: Expecting value"


def test_reproducible_threshold_is_one_null_threshold_takes():
    """Null-score margins are signed: the official sweep's 0.0 for "below every value" is no usable
    --null-threshold (margins -3, -2, -1: best F1 66.7 "at 0.0", but thresholding at 0.0 answers every question)."""
    examples = [{"id": "a", "answers": {"text": [], "answer_start": []}},
                {"id": "b", "answers": {"text": [], "answer_start": []}},
                {"id": "c", "answers": {"text": ["Paris"], "answer_start": [0]}}]
    spans = {"a": "London", "b": "Rome", "c": "Berlin"}
    margins = {"a": -3.0, "b": -2.0, "c": -1.0}
    official = squad_v2(spans, examples, margins, na_prob_thresh=0.0)
    assert official["best_f1"] == pytest.approx(200 / 3) and official["best_f1_thresh"] == 0.0
    assert official["f1"] == 0.0  # thresholding at the reported 0.0 answers all three: not the best
    got = squad_v2(spans, examples, margins, na_prob_thresh=0.0, reproducible_thresholds=True)
    assert got["best_f1"] == pytest.approx(200 / 3) and got["best_f1_thresh"] == -4.0
    again = squad_v2(spans, examples, margins, na_prob_thresh=got["best_f1_thresh"])
    assert again["f1"] == pytest.approx(got["best_f1"]) and again["exact"] == pytest.approx(got["best_exact"])


@pytest.mark.parametrize("seed", range(20))
def test_reproducible_thresholds_reproduce_their_scores_with_ties(seed):
    """Random margins drawn from a few values (ties) and random answers: thresholding at each reported threshold
    gives the reported best, which is the best over every threshold."""
    rng = np.random.default_rng(seed)
    examples, spans, margins = [], {}, {}
    for i in range(30):
        answerable = rng.random() < 0.5
        examples.append({"id": f"q{i}", "answers": {"text": ["red fox"] if answerable else [],
                                                    "answer_start": [0] if answerable else []}})
        spans[f"q{i}"] = str(rng.choice(["red fox", "fox", "a dog", ""]))
        margins[f"q{i}"] = float(rng.choice([-2.5, -1.0, 0.0, 0.5, 3.0]))
    got = squad_v2(spans, examples, margins, reproducible_thresholds=True)
    for metric in ("exact", "f1"):
        again = squad_v2(spans, examples, margins, na_prob_thresh=got[f"best_{metric}_thresh"])
        assert again[metric] == pytest.approx(got[f"best_{metric}"], abs=1e-9)
        every = [squad_v2(spans, examples, margins, na_prob_thresh=t)[metric] for t in (-10.0, *margins.values())]
        assert got[f"best_{metric}"] == pytest.approx(max(every), abs=1e-9)
