"""Task presets: every task of the BERT paper's suite is there, with GLUE's directory names, splits and the metric each
leaderboard reports, and every metric name is one ``compute_metrics`` (or the SQuAD scorers) understands."""

from __future__ import annotations

import pytest

from bert_ds.downstream.metrics import compute_metrics
from bert_ds.downstream.tasks import GLUE_TASKS, TASKS, TaskSpec, TsvLayout, task_spec

# GLUE's own directory names (download_glue_data.py) and the figure the BERT paper's Table 1 reports per task.
PAPER = {"cola": ("CoLA", "mcc"), "sst2": ("SST-2", "accuracy"), "mrpc": ("MRPC", "f1"), "qqp": ("QQP", "f1"),
         "stsb": ("STS-B", "spearman"), "mnli": ("MNLI", "accuracy"), "qnli": ("QNLI", "accuracy"),
         "rte": ("RTE", "accuracy"), "wnli": ("WNLI", "accuracy")}


def test_every_task_of_the_paper_has_a_preset():
    assert set(GLUE_TASKS) == set(PAPER)
    assert {"squad_v1", "squad_v2", "swag", "conll2003", "sequence", "pair", "regression", "token",
            "multiple_choice", "qa"} <= set(TASKS)
    shapes = {spec.shape for spec in TASKS.values()}
    assert shapes == {"classification", "regression", "qa", "multiple_choice", "token"}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_glue_directory_metric_and_splits(name):
    spec = GLUE_TASKS[name]
    assert (spec.glue_dir, spec.main_metric) == PAPER[name]
    assert spec.splits["train"] == "train.tsv"
    assert spec.test_layout.label is None and spec.train_layout.label is not None
    if name == "mnli":
        assert set(spec.splits) == {"train", "dev_matched", "dev_mismatched", "test_matched", "test_mismatched"}
    else:
        assert set(spec.splits) == {"train", "dev", "test"}
    if name in ("mrpc", "qqp"):
        assert spec.metrics == ["f1", "accuracy"]  # GLUE reports both
    if name == "stsb":
        assert spec.shape == "regression" and spec.labels is None and spec.metrics == ["pearson", "spearman"]


def test_glue_label_sets():
    assert TASKS["mnli"].labels == ["contradiction", "entailment", "neutral"]
    assert TASKS["qnli"].labels == TASKS["rte"].labels == ["entailment", "not_entailment"]
    for name in ("cola", "sst2", "mrpc", "qqp", "wnli"):
        assert TASKS[name].labels == ["0", "1"], name
        assert TASKS[name].label2id()["1"] == 1  # binary F1's positive class is label id 1


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_metric_name_is_computable(name):
    spec = TASKS[name]
    assert spec.main_metric in spec.metrics
    if spec.shape == "qa":
        assert spec.main_metric == "f1"  # SQuAD's scorers (metrics.squad_v1 / squad_v2) return it
        return
    if spec.shape == "token":
        predictions = references = [["B-PER", "I-PER", "O"], ["O", "B-LOC"]]
    elif spec.shape == "regression":
        predictions, references = [0.1, 2.0, 4.5, 3.0], [0.0, 2.5, 5.0, 2.0]
    else:
        predictions, references = [0, 1, 1, 0], [0, 1, 0, 0]
    assert set(compute_metrics(spec.metrics, predictions, references)) == set(spec.metrics)


def test_presets_are_validated():
    with pytest.raises(ValueError, match="shape='span'"):
        TaskSpec(name="x", shape="span", format="records", metrics=["accuracy"], main_metric="accuracy")
    with pytest.raises(ValueError, match="main_metric='mcc' is not in"):
        TaskSpec(name="x", shape="classification", format="records", metrics=["accuracy"], main_metric="mcc")
    with pytest.raises(ValueError, match="unknown metrics"):
        TaskSpec(name="x", shape="classification", format="records", metrics=["bleu"], main_metric="bleu")
    with pytest.raises(ValueError, match="not one of the columns"):
        TsvLayout(header=("sentence",), text="sentence", label="label")
    with pytest.raises(ValueError, match=r"task='glue': choose one of \["):
        task_spec("glue")
    assert task_spec("cola") is TASKS["cola"]


def test_qa_presets_default_to_run_squads_window():
    """QA presets default to run_squad.py's 384/128 (a 128-token window cannot hold a 128-token stride after the
    question); every other task keeps 128; an explicit --max-seq-length wins. Written once: on the TaskSpec."""
    from dataclasses import MISSING, fields

    from bert_ds.downstream.finetune import FinetuneArgs, build_parser

    for name, spec in TASKS.items():
        args = FinetuneArgs(model="m", out="o", task=name, train_file="t")
        assert args.max_seq_length == (384 if spec.shape == "qa" else 128), name
        assert args.doc_stride == 128
    assert FinetuneArgs(model="m", out="o", task="squad_v2", train_file="t", max_seq_length=256).max_seq_length == 256
    # The parser's defaults are FinetuneArgs', not written again.
    defaults = {f.name: f.default for f in fields(FinetuneArgs) if f.default is not MISSING}
    assert {a.dest: a.default for a in build_parser()._actions if a.dest in defaults} == defaults
