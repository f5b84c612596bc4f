"""Span-extraction question answering (SQuAD v1.1 / v2.0, BERT paper §4.2-4.3) on transformers'
``AutoModelForQuestionAnswering``: a start and an end vector over the final hidden states.

* Windows: ``[CLS] question [SEP] context-window [SEP]``; a context longer than ``max_seq_length`` is cut into windows
  that share ``doc_stride`` tokens with the previous one (the tokenizer's ``stride``, as transformers' ``run_qa.py``;
  Google's ``run_squad.py`` counts the step between window starts instead).
* Training target: the answer's first and last token when the whole answer lies inside the window, else ``[CLS]``
  (position 0) — the paper's no-answer span, used for v2.0's unanswerable questions and for windows that miss it.
* Prediction: per window the ``n_best`` highest start and end logits; a span is valid when both ends lie in the
  context, end >= start and it is at most ``max_answer_length`` tokens; its score is start + end logit. The null score
  is the ``[CLS]`` span's score, the smallest over a question's windows (as ``run_squad.py``). v2.0 predicts "no
  answer" when null score - best span score > ``null_threshold`` (tau; the paper picks it on dev to maximise F1,
  which ``metrics.squad_v2``'s ``best_f1_thresh`` reports).
"""

from __future__ import annotations

import math

import numpy as np

from bert_ds.errors import BadInput

__all__ = ["train_features", "eval_features", "best_spans", "answers"]


def _windows(tokenizer, examples: list[dict], max_seq_length: int, doc_stride: int, max_query_length: int):
    questions = [_question(tokenizer, e["question"], max_query_length) for e in examples]
    for example, question in zip(examples, questions, strict=True):
        room = max_seq_length - len(tokenizer(question, add_special_tokens=False)["input_ids"]) - 3
        if doc_stride >= room:
            raise BadInput(f"question {example['id']!r}: doc_stride={doc_stride} must be below the {room} context "
                           f"tokens a window of max_seq_length={max_seq_length} holds after the question")
    # Question first, as the paper (segment A = question, B = passage); only the passage is cut into windows.
    return tokenizer(questions, [e["context"] for e in examples], truncation="only_second",
                     max_length=max_seq_length, stride=doc_stride, return_overflowing_tokens=True,
                     return_offsets_mapping=True)


def _question(tokenizer, question: str, max_query_length: int) -> str:
    # run_squad.py caps the question at max_query_length WordPieces so the passage keeps most of the window.
    question = question.lstrip()
    ids = tokenizer(question, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return question if len(ids) <= max_query_length else question[:ids[max_query_length - 1][1]]


def train_features(tokenizer, examples: list[dict], max_seq_length: int, doc_stride: int,
                   max_query_length: int = 64) -> list[dict]:
    """Model inputs with ``start_positions`` / ``end_positions`` for every window of every example."""
    enc = _windows(tokenizer, examples, max_seq_length, doc_stride, max_query_length)
    features = []
    for i, offsets in enumerate(enc["offset_mapping"]):
        example = examples[enc["overflow_to_sample_mapping"][i]]
        sequence = enc.sequence_ids(i)
        start = end = 0  # [CLS]: no answer in this window
        texts, starts = example["answers"]["text"], example["answers"]["answer_start"]
        if texts and not example.get("is_impossible"):
            char_start = starts[0]
            char_end = char_start + len(texts[0])
            context = [k for k, s in enumerate(sequence) if s == 1]
            if offsets[context[0]][0] <= char_start and offsets[context[-1]][1] >= char_end:
                start = next(k for k in context if offsets[k][1] > char_start)
                end = next(k for k in reversed(context) if offsets[k][0] < char_end)
        features.append({key: enc[key][i] for key in ("input_ids", "token_type_ids", "attention_mask")
                         if key in enc} | {"start_positions": start, "end_positions": end})
    return features


def eval_features(tokenizer, examples: list[dict], max_seq_length: int, doc_stride: int,
                  max_query_length: int = 64) -> tuple[list[dict], list[dict]]:
    """(model inputs, per-window bookkeeping): the bookkeeping holds the example index and the character offsets of
    the context tokens (None elsewhere), which post-processing maps spans back through."""
    enc = _windows(tokenizer, examples, max_seq_length, doc_stride, max_query_length)
    inputs, meta = [], []
    for i, offsets in enumerate(enc["offset_mapping"]):
        sequence = enc.sequence_ids(i)
        inputs.append({key: enc[key][i] for key in ("input_ids", "token_type_ids", "attention_mask") if key in enc})
        meta.append({"example": enc["overflow_to_sample_mapping"][i],
                     "offsets": [o if s == 1 else None for o, s in zip(offsets, sequence, strict=True)]})
    return inputs, meta


def best_spans(start_logits: np.ndarray, end_logits: np.ndarray, meta: list[dict], examples: list[dict],
               n_best: int = 20, max_answer_length: int = 30) -> tuple[dict[str, str], dict[str, float]]:
    """Best non-null answer text per question id and ``null score - best span score`` (the no-answer margin; +inf
    when no window holds a valid span). ``start_logits`` / ``end_logits``: (windows, seq) padded arrays."""
    best: dict[int, tuple[float, str]] = {}
    null: dict[int, float] = {}
    for w, info in enumerate(meta):
        k, offsets = info["example"], info["offsets"]
        starts, ends = start_logits[w][:len(offsets)], end_logits[w][:len(offsets)]
        null[k] = min(null.get(k, math.inf), float(starts[0] + ends[0]))
        context = examples[k]["context"]
        for s in np.argsort(starts)[::-1][:n_best]:
            if offsets[s] is None:
                continue
            for e in np.argsort(ends)[::-1][:n_best]:
                if offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                    continue
                score = float(starts[s] + ends[e])
                if k not in best or score > best[k][0]:
                    best[k] = (score, context[offsets[s][0]:offsets[e][1]])
    texts, margins = {}, {}
    for k, example in enumerate(examples):
        score, text = best.get(k, (-math.inf, ""))
        texts[example["id"]] = text
        margins[example["id"]] = null.get(k, -math.inf) - score
    return texts, margins


def answers(texts: dict[str, str], margins: dict[str, float], null_threshold: float | None) -> dict[str, str]:
    """Final predictions: the best span, or "" where v2.0's null margin exceeds ``null_threshold`` (None: v1.1,
    always answer)."""
    if null_threshold is None:
        return dict(texts)
    return {qid: "" if margins[qid] > null_threshold else text for qid, text in texts.items()}
