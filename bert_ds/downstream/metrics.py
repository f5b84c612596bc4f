"""The metrics the BERT paper's fine-tuning tables report, computed offline.

* GLUE: accuracy; binary F1 of the positive class (label id 1: MRPC "paraphrase", QQP "duplicate"); Matthews
  correlation (CoLA; the multi-class form of Gorodkin 2004, equal to the binary phi coefficient for two classes);
  Pearson and Spearman correlation (STS-B; Spearman with average ranks for ties).
* CoNLL-2003: entity-level precision / recall / F1 (seqeval, the Python port of conlleval's chunk rules).
* SQuAD v1.1 and v2.0: exact match and token F1 after the official scripts' answer normalisation, the maximum over
  the gold answers, on a 0-100 scale; v2.0 adds the HasAns / NoAns split and the best no-answer threshold.

Each is checked in tests/downstream/test_metrics.py against an independent implementation (scikit-learn, scipy,
seqeval, and outputs of the official SQuAD evaluation scripts).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import string
import sys
from collections import Counter
from collections.abc import Sequence

import numpy as np

from bert_ds.errors import BadInput, run_main

__all__ = ["METRICS", "compute_metrics", "accuracy", "binary_f1", "matthews_corrcoef", "pearson", "spearman",
           "entity_scores", "normalize_answer", "squad_exact", "squad_f1", "squad_v1", "squad_v2", "main"]


def _pair(predictions, references) -> tuple[np.ndarray, np.ndarray]:
    p, r = np.asarray(predictions), np.asarray(references)
    if p.shape != r.shape or p.ndim != 1:
        raise BadInput(f"predictions and references must be two 1-D sequences of one length, got shapes "
                       f"{p.shape} and {r.shape}")
    if len(p) == 0:
        raise BadInput("no predictions to score")
    return p, r


def accuracy(predictions, references) -> float:
    p, r = _pair(predictions, references)
    return float(np.mean(p == r))


def binary_f1(predictions, references, positive=1) -> float:
    """F1 of the positive class; 0.0 when there is no positive prediction nor reference (scikit-learn's
    ``zero_division`` default)."""
    p, r = _pair(predictions, references)
    tp = int(np.sum((p == positive) & (r == positive)))
    fp = int(np.sum((p == positive) & (r != positive)))
    fn = int(np.sum((p != positive) & (r == positive)))
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def matthews_corrcoef(predictions, references) -> float:
    """Matthews correlation over any number of classes, from the confusion matrix (Gorodkin 2004):
    (c·s − Σ_k p_k·t_k) / sqrt((s² − Σ p_k²)(s² − Σ t_k²)); 0.0 when either side is constant (the denominator is 0,
    as GLUE's CoLA score treats a constant classifier)."""
    p, r = _pair(predictions, references)
    classes, codes = np.unique(np.concatenate([p, r]), return_inverse=True)
    pc, rc = codes[:len(p)], codes[len(p):]
    k = len(classes)
    confusion = np.zeros((k, k), dtype=np.float64)
    np.add.at(confusion, (rc, pc), 1.0)
    s = confusion.sum()
    c = np.trace(confusion)
    t_k, p_k = confusion.sum(axis=1), confusion.sum(axis=0)
    denominator = math.sqrt((s * s - p_k @ p_k) * (s * s - t_k @ t_k))
    return float((c * s - t_k @ p_k) / denominator) if denominator else 0.0


def pearson(predictions, references) -> float:
    """Pearson's r in float64; NaN when either side is constant (undefined, as scipy reports)."""
    p, r = _pair(predictions, references)
    x, y = p.astype(np.float64), r.astype(np.float64)
    x, y = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float(x @ x) * float(y @ y))
    if denominator == 0.0:
        return float("nan")
    return float(np.clip((x @ y) / denominator, -1.0, 1.0))


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing the mean of the ranks they span."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.r_[True, sorted_values[1:] != sorted_values[:-1]]
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    last = np.r_[first[1:], len(values)] - 1
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = (first[group] + last[group]) / 2.0 + 1.0
    return ranks


def spearman(predictions, references) -> float:
    """Spearman's rho: Pearson's r of the average ranks."""
    p, r = _pair(predictions, references)
    return pearson(_average_ranks(p.astype(np.float64)), _average_ranks(r.astype(np.float64)))


def entity_scores(predictions: Sequence[Sequence[str]], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """Entity-level micro precision / recall / F1 of IOB tag sequences (seqeval's default, conlleval-compatible
    chunking: an ``I-X`` after ``O`` or another type starts an entity, so IOB1 files score as conlleval scores them)."""
    from seqeval.metrics import f1_score, precision_score, recall_score

    if len(predictions) != len(references):
        raise BadInput(f"{len(predictions)} predicted sequences but {len(references)} references")
    for i, (p, r) in enumerate(zip(predictions, references, strict=True)):
        if len(p) != len(r):
            raise BadInput(f"sequence {i}: {len(p)} predicted tags but {len(r)} reference tags")
    p, r = [list(s) for s in predictions], [list(s) for s in references]
    return {"entity_precision": float(precision_score(r, p, zero_division=0)),
            "entity_recall": float(recall_score(r, p, zero_division=0)),
            "entity_f1": float(f1_score(r, p, zero_division=0))}


METRICS = {"accuracy": accuracy, "f1": binary_f1, "mcc": matthews_corrcoef, "pearson": pearson, "spearman": spearman}
_ENTITY = ("entity_f1", "entity_precision", "entity_recall")


def compute_metrics(names: Sequence[str], predictions, references) -> dict[str, float]:
    """``{name: value}`` for each name in ``names``. Classification metrics take label ids (``f1``: positive class =
    label id 1), ``pearson``/``spearman`` take floats, the ``entity_*`` metrics lists of tag lists; ``accuracy`` on
    tag lists is the token accuracy."""
    out: dict[str, float] = {}
    for name in names:
        if name in _ENTITY:
            out[name] = entity_scores(predictions, references)[name]
        elif name == "accuracy" and len(predictions) and isinstance(predictions[0], list | tuple):
            flat_p = [t for s in predictions for t in s]
            flat_r = [t for s in references for t in s]
            out[name] = accuracy(flat_p, flat_r)
        elif name in METRICS:
            out[name] = METRICS[name](predictions, references)
        else:
            raise BadInput(f"unknown metric {name!r}; known: {sorted(METRICS) + list(_ENTITY)}")
    return out


# --------------------------------------------------------------------------------------------------- SQuAD
_PUNCTUATION = frozenset(string.punctuation)  # ASCII only, as the official scripts: "«" or "—" stay
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """The official SQuAD normalisation, in its order: lower-case, drop ASCII punctuation, replace the words a/an/the
    by a space, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def squad_exact(gold: str, prediction: str) -> int:
    return int(normalize_answer(gold) == normalize_answer(prediction))


def squad_f1(gold: str, prediction: str, empty_matches_empty: bool = True) -> float:
    """Token-overlap F1 of the normalised answers. v2.0 scores an empty answer against an empty gold as 1
    (``empty_matches_empty``); v1.1's script has no such rule (both empty: 0)."""
    gold_tokens, pred_tokens = normalize_answer(gold).split(), normalize_answer(prediction).split()
    if empty_matches_empty and (not gold_tokens or not pred_tokens):
        return float(gold_tokens == pred_tokens)
    same = sum((Counter(gold_tokens) & Counter(pred_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _gold_texts(example: dict) -> list[str]:
    answers = example["answers"]
    return list(answers["text"] if isinstance(answers, dict) else [a["text"] for a in answers])


def squad_v1(predictions: dict[str, str], examples: Sequence[dict]) -> dict[str, float]:
    """SQuAD v1.1 exact match and F1 (0-100) over ``examples`` (records of ``readers.read_squad_json``); a question
    without a prediction scores 0, as in the official script."""
    if not examples:
        raise BadInput("no questions to score")
    exact = f1 = 0.0
    for example in examples:
        prediction = predictions.get(example["id"])
        if prediction is None:
            continue
        golds = _gold_texts(example)
        if not golds:
            raise BadInput(f"question {example['id']!r} has no gold answer: SQuAD v1.1 needs one (use squad_v2)")
        exact += max(squad_exact(g, prediction) for g in golds)
        f1 += max(squad_f1(g, prediction, empty_matches_empty=False) for g in golds)
    return {"exact_match": 100.0 * exact / len(examples), "f1": 100.0 * f1 / len(examples)}


def _below_every(values) -> float:
    """A readable threshold under every value (their floor minus one): with it, every question is "no answer"."""
    finite = [v for v in values if math.isfinite(v)]
    return float(math.floor(min(finite)) - 1) if finite else 0.0


def _best_threshold(predictions, raw: dict[str, float], na_probs: dict[str, float],
                    has_answer: dict[str, bool], reproducible: bool = False) -> tuple[float, float]:
    """The official v2.0 threshold sweep. Below every no-answer probability all questions answer "no answer" (score =
    number of NoAns questions); raising the threshold past a question's probability switches it to its predicted
    span, which gains its raw score if it has an answer and loses 1 if it has none and the span is non-empty. The
    best running total and the probability where it was reached are kept (the first on ties). Like the official
    script, the sweep walks questions one by one in (stable) probability order, even inside a group of equal
    probabilities; and a best total reached before any question switches reports threshold 0.0, which means "below
    every value" only for probabilities (with signed scores such as null-score margins, read it as minus infinity).

    ``reproducible``: every reported (score, threshold) is what thresholding at that value gives (the official sweep
    evaluated in the units of its input, as ``--null-threshold`` takes them): a total counts only once every question
    of equal probability has switched (a threshold cannot split them), and the start reports a value below every
    probability (:func:`_below_every`) instead of 0.0."""
    total = sum(1 for v in has_answer.values() if not v)
    order = [qid for qid in sorted(na_probs, key=lambda k: na_probs[k]) if qid in raw]
    best, best_threshold = total, _below_every(na_probs[q] for q in order) if reproducible and order else 0.0
    for i, qid in enumerate(order):
        if has_answer[qid]:
            total += raw[qid]
        elif predictions[qid]:
            total -= 1
        if reproducible and i + 1 < len(order) and na_probs[order[i + 1]] == na_probs[qid]:
            continue  # the rest of this probability's questions switch at the same threshold
        if total > best:
            best, best_threshold = total, na_probs[qid]
    return 100.0 * best / len(raw), best_threshold


def squad_v2(predictions: dict[str, str], examples: Sequence[dict], na_probs: dict[str, float] | None = None,
             na_prob_thresh: float = 1.0, reproducible_thresholds: bool = False) -> dict[str, float]:
    """SQuAD v2.0 metrics (0-100) like the official script: ``exact`` / ``f1`` after the no-answer threshold (a
    question whose ``na_probs`` exceeds ``na_prob_thresh`` is answered "no answer"), the same on the HasAns and NoAns
    questions, and the best exact / F1 over all thresholds with the thresholds that reach them. Without ``na_probs``
    every probability is 0 (the script's default). Every question needs a prediction ("" = no answer).
    ``reproducible_thresholds``: best scores and thresholds that ``na_prob_thresh`` = the reported threshold gives
    back (see ``_best_threshold``), for signed scores such as fine-tuning's null margins; False: the official
    script's numbers, probabilities in [0, 1]."""
    if not examples:
        raise BadInput("no questions to score")
    missing = [e["id"] for e in examples if e["id"] not in predictions]
    if missing:
        raise BadInput(f"{len(missing)} questions have no prediction (e.g. {missing[:3]}); predict '' for no answer")
    if na_probs is None:
        na_probs = {e["id"]: 0.0 for e in examples}
    lacking = [e["id"] for e in examples if e["id"] not in na_probs]
    if lacking:
        raise BadInput(f"na_probs lacks {len(lacking)} questions (e.g. {lacking[:3]})")
    has_answer, exact_raw, f1_raw = {}, {}, {}
    for example in examples:
        qid, prediction = example["id"], predictions[example["id"]]
        # Gold answers that normalise to nothing do not count; a question left with none is unanswerable, and
        # only the empty answer is right for it.
        golds = [g for g in _gold_texts(example) if normalize_answer(g)] or [""]
        has_answer[qid] = bool(_gold_texts(example))
        exact_raw[qid] = max(squad_exact(g, prediction) for g in golds)
        f1_raw[qid] = max(squad_f1(g, prediction) for g in golds)

    def thresholded(raw: dict[str, float]) -> dict[str, float]:
        return {qid: float(not has_answer[qid]) if na_probs[qid] > na_prob_thresh else score
                for qid, score in raw.items()}

    exact, f1 = thresholded(exact_raw), thresholded(f1_raw)
    out: dict[str, float] = {}
    for prefix, ids in (("", list(exact)), ("HasAns_", [q for q in exact if has_answer[q]]),
                        ("NoAns_", [q for q in exact if not has_answer[q]])):
        if ids:
            out[f"{prefix}exact"] = 100.0 * sum(exact[q] for q in ids) / len(ids)
            out[f"{prefix}f1"] = 100.0 * sum(f1[q] for q in ids) / len(ids)
        out[f"{prefix}total"] = len(ids)
    sweep_na = {qid: na_probs[qid] for qid in na_probs if qid in exact}
    out["best_exact"], out["best_exact_thresh"] = _best_threshold(predictions, exact_raw, sweep_na, has_answer,
                                                                  reproducible_thresholds)
    out["best_f1"], out["best_f1_thresh"] = _best_threshold(predictions, f1_raw, sweep_na, has_answer,
                                                            reproducible_thresholds)
    return out


def _load_json(path: str):
    from bert_ds.downstream.readers import DownstreamInputError

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise DownstreamInputError(path, exc.lineno, exc.colno, f"not valid JSON: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise DownstreamInputError(path, 1, exc.start + 1, "not UTF-8") from None


def _score_files(args: argparse.Namespace) -> int:
    from bert_ds.downstream.readers import read_squad_json

    examples = read_squad_json(args.data_file)
    version = str(_load_json(args.data_file).get("version", ""))
    predictions = _load_json(args.pred_file)
    if not isinstance(predictions, dict) or not all(isinstance(v, str) for v in predictions.values()):
        raise BadInput(f"{args.pred_file}: expected a JSON object mapping question ids to answer strings")
    if version.lstrip("v").startswith("2"):
        na_probs = _load_json(args.na_prob_file) if args.na_prob_file else None
        result = squad_v2(predictions, examples, na_probs, args.na_prob_thresh)
    else:
        result = squad_v1(predictions, examples)
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m bert_ds.downstream.metrics DATA.json PRED.json [--na-prob-file F] [--na-prob-thresh T]``: score
    SQuAD predictions (a JSON object id -> answer text) as the official scripts do, v1.1 or v2.0 after the data file's
    ``version``; prints the JSON result. Bad input: one line on stderr, exit 2."""
    parser = argparse.ArgumentParser(description="SQuAD v1.1 / v2.0 evaluation (the official scripts' metrics)")
    parser.add_argument("data_file")
    parser.add_argument("pred_file")
    parser.add_argument("--na-prob-file", help="v2.0: question id -> probability of no answer")
    parser.add_argument("--na-prob-thresh", type=float, default=1.0, help="v2.0: answer '' above this (default 1.0)")
    return run_main(None, _score_files, parser.parse_args(argv))  # "error: ...", as this module always wrote it


if __name__ == "__main__":
    sys.exit(main())
