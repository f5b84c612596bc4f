"""Task presets for the BERT paper's fine-tuning suite: where each task's files live, which columns hold the text and
the label, the label set, and the metrics its leaderboard reports.

GLUE layouts are those of the GLUE distribution (``download_glue_data.py``: one directory per task, tab-separated
files, ``train.tsv`` / ``dev.tsv`` / ``test.tsv``; MNLI splits dev and test into matched and mismatched). CoLA's
train and dev files have no header; every other GLUE file has one, and test files have no label column. SQuAD is the
official JSON, SWAG the CSV of its release (``regular/train.csv``, ``val.csv``), CoNLL-2003 the column format.
``sequence`` / ``pair`` / ``regression`` / ``token`` / ``multiple_choice`` read CSV or JSON-lines files with named
columns, ``qa`` reads SQuAD-layout JSON.

``readers.read_split`` reads any of them into the normalised records the fine-tuning code consumes;
``metrics.compute_metrics`` understands every name in ``TaskSpec.metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bert_ds.errors import BadInput

__all__ = ["SHAPES", "FORMATS", "MAX_SEQ_LENGTH", "QA_MAX_SEQ_LENGTH", "TsvLayout", "TaskSpec", "TASKS", "GLUE_TASKS",
           "task_spec"]

SHAPES = ("classification", "regression", "qa", "multiple_choice", "token")
FORMATS = ("glue_tsv", "squad_json", "swag_csv", "conll", "records")
MAX_SEQ_LENGTH = 128
"""WordPieces per example when ``--max-seq-length`` is not given: Google's ``run_classifier.py`` default."""
QA_MAX_SEQ_LENGTH = 384
"""The QA presets' window: Google's ``run_squad.py`` default (with ``doc_stride`` 128, which a 128-token window,
after the question, cannot hold)."""
# compute_metrics' names, plus the SQuAD scripts' own keys ("exact_match" for v1.1, "exact" for v2.0, and their "f1").
_METRIC_NAMES = ("accuracy", "f1", "mcc", "pearson", "spearman", "entity_f1", "entity_precision", "entity_recall",
                 "exact_match", "exact")


@dataclass(frozen=True)
class TsvLayout:
    """Columns of one kind of GLUE file (labelled train/dev, or unlabelled test)."""

    header: tuple[str, ...] | None
    """The header line's fields, or None for a file without header (CoLA train/dev): then ``columns`` names the
    fields by position and every line must have exactly that many."""
    text: str
    text_pair: str | None = None
    label: str | None = None
    """None for test files (no gold label)."""
    idx: str | None = None
    """Column holding the example's id (GLUE's ``index`` / ``id`` / ``pairID``), or None: the line number is used."""
    columns: tuple[str, ...] | None = None
    """Positional names of a header-less file."""

    def __post_init__(self) -> None:
        names = self.header if self.header is not None else self.columns
        if names is None:
            raise BadInput("TsvLayout needs a header or positional columns")
        for role in ("text", "text_pair", "label", "idx"):
            value = getattr(self, role)
            if value is not None and value not in names:
                raise BadInput(f"TsvLayout.{role}={value!r} is not one of the columns {names}")

    @property
    def names(self) -> tuple[str, ...]:
        return self.header if self.header is not None else self.columns  # type: ignore[return-value]


@dataclass(frozen=True)
class TaskSpec:
    """One fine-tuning task: its shape (which head), its files and columns, its labels and metrics."""

    name: str
    shape: str
    """One of SHAPES: which transformers head fine-tunes it."""
    format: str
    """One of FORMATS: which reader parses its files."""
    metrics: list[str]
    """Names ``metrics.compute_metrics`` understands (SQuAD: handled by ``metrics.squad_v1`` / ``squad_v2``)."""
    main_metric: str
    """The figure the paper's tables report (GLUE: MCC for CoLA, F1 for MRPC/QQP, Spearman for STS-B, else accuracy)."""
    labels: list[str] | None = None
    """The label set in label-id order (id i is ``labels[i]``); None when the training file defines it (generic
    tasks) or there is no label (regression, QA)."""
    glue_dir: str | None = None
    """Directory name of the task inside a GLUE data directory."""
    splits: dict[str, str] = field(default_factory=dict)
    """Split name -> file name, relative to ``glue_dir`` (or to the data directory for non-GLUE tasks)."""
    train_layout: TsvLayout | None = None
    """GLUE: columns of the labelled files (train, dev)."""
    test_layout: TsvLayout | None = None
    """GLUE: columns of the unlabelled test files."""
    columns: dict[str, str] = field(default_factory=dict)
    """Generic CSV/JSON-lines tasks: record field -> column name (e.g. ``{"text": "sentence", "label": "label"}``)."""
    eval_splits: tuple[str, ...] = ("dev",)
    """Splits the suite scores (MNLI: matched and mismatched)."""
    max_seq_length: int = MAX_SEQ_LENGTH
    """The window a run of this task gets unless ``--max-seq-length`` says otherwise (QA: QA_MAX_SEQ_LENGTH)."""
    drop_malformed_rows: bool = False
    """GLUE: skip (and count, with a warning) lines whose column count is wrong instead of refusing the file. Only
    QQP: its GLUE train/dev files carry such lines, which fairseq's GLUE preprocessing also drops (awk NF == 6)."""

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise BadInput(f"TaskSpec {self.name!r}: shape={self.shape!r}, choose one of {SHAPES}")
        if self.format not in FORMATS:
            raise BadInput(f"TaskSpec {self.name!r}: format={self.format!r}, choose one of {FORMATS}")
        unknown = [m for m in self.metrics if m not in _METRIC_NAMES]
        if unknown:
            raise BadInput(f"TaskSpec {self.name!r}: unknown metrics {unknown}; known: {_METRIC_NAMES}")
        if self.main_metric not in self.metrics:
            raise BadInput(f"TaskSpec {self.name!r}: main_metric={self.main_metric!r} is not in {self.metrics}")
        if self.format == "glue_tsv" and (self.train_layout is None or self.test_layout is None):
            raise BadInput(f"TaskSpec {self.name!r}: a GLUE task needs train_layout and test_layout")
        if self.shape == "regression" and self.labels is not None:
            raise BadInput(f"TaskSpec {self.name!r}: a regression task has no label set")
        missing = [s for s in self.eval_splits if self.splits and s not in self.splits]
        if missing:
            raise BadInput(f"TaskSpec {self.name!r}: eval_splits {missing} are not in splits {sorted(self.splits)}")

    @property
    def is_glue(self) -> bool:
        return self.format == "glue_tsv"

    def label2id(self) -> dict[str, int]:
        if self.labels is None:
            raise BadInput(f"task {self.name!r} has no fixed label set")
        return {label: i for i, label in enumerate(self.labels)}


_GLUE_SPLITS = {"train": "train.tsv", "dev": "dev.tsv", "test": "test.tsv"}
_BINARY = ["0", "1"]
_NLI3 = ["contradiction", "entailment", "neutral"]  # transformers' MnliProcessor order: label ids match its heads
_NLI2 = ["entailment", "not_entailment"]


def _glue(name, glue_dir, shape, labels, metrics, main, train_layout, test_layout, splits=None, eval_splits=("dev",),
          drop_malformed_rows=False):
    return TaskSpec(name=name, shape=shape, format="glue_tsv", labels=labels, metrics=metrics, main_metric=main,
                    glue_dir=glue_dir, splits=dict(splits or _GLUE_SPLITS), train_layout=train_layout,
                    test_layout=test_layout, eval_splits=eval_splits, drop_malformed_rows=drop_malformed_rows)


_PAIR_TEST = TsvLayout(header=("index", "sentence1", "sentence2"), text="sentence1", text_pair="sentence2", idx="index")
# STS-B: genre, source file, year and the pair ids of the STS benchmark, then the pair and (train/dev) the score.
_STSB_COLUMNS = ("index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2")
# MNLI (from MultiNLI's own TSV): ids, genre, binary and full parses, the raw sentences; train has one annotator label
# then gold_label, dev has five annotator labels then gold_label, test stops after sentence2.
_MNLI_FRONT = ("index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
               "sentence1_parse", "sentence2_parse", "sentence1", "sentence2")

GLUE_TASKS: dict[str, TaskSpec] = {
    "cola": _glue(
        "cola", "CoLA", "classification", _BINARY, ["mcc", "accuracy"], "mcc",
        # CoLA train/dev: no header; source code of the sentence, acceptability (0/1), the author's original mark
        # ("*" or empty), the sentence.
        TsvLayout(header=None, columns=("source", "label", "original_label", "sentence"), text="sentence",
                  label="label"),
        TsvLayout(header=("index", "sentence"), text="sentence", idx="index")),
    "sst2": _glue(
        "sst2", "SST-2", "classification", _BINARY, ["accuracy"], "accuracy",
        TsvLayout(header=("sentence", "label"), text="sentence", label="label"),
        TsvLayout(header=("index", "sentence"), text="sentence", idx="index")),
    "mrpc": _glue(
        "mrpc", "MRPC", "classification", _BINARY, ["f1", "accuracy"], "f1",
        TsvLayout(header=("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"), text="#1 String",
                  text_pair="#2 String", label="Quality"),
        TsvLayout(header=("index", "#1 ID", "#2 ID", "#1 String", "#2 String"), text="#1 String",
                  text_pair="#2 String", idx="index")),
    "qqp": _glue(
        "qqp", "QQP", "classification", _BINARY, ["f1", "accuracy"], "f1",
        TsvLayout(header=("id", "qid1", "qid2", "question1", "question2", "is_duplicate"), text="question1",
                  text_pair="question2", label="is_duplicate", idx="id"),
        TsvLayout(header=("id", "question1", "question2"), text="question1", text_pair="question2", idx="id"),
        drop_malformed_rows=True),
    "stsb": _glue(
        "stsb", "STS-B", "regression", None, ["pearson", "spearman"], "spearman",
        TsvLayout(header=_STSB_COLUMNS + ("score",), text="sentence1", text_pair="sentence2", label="score",
                  idx="index"),
        TsvLayout(header=_STSB_COLUMNS, text="sentence1", text_pair="sentence2", idx="index")),
    "mnli": _glue(
        "mnli", "MNLI", "classification", _NLI3, ["accuracy"], "accuracy",
        # dev files have label1..label5; the reader finds gold_label by name, so one layout serves train and dev.
        TsvLayout(header=_MNLI_FRONT + ("label1", "gold_label"), text="sentence1", text_pair="sentence2",
                  label="gold_label", idx="pairID"),
        TsvLayout(header=_MNLI_FRONT, text="sentence1", text_pair="sentence2", idx="pairID"),
        splits={"train": "train.tsv", "dev_matched": "dev_matched.tsv", "dev_mismatched": "dev_mismatched.tsv",
                "test_matched": "test_matched.tsv", "test_mismatched": "test_mismatched.tsv"},
        eval_splits=("dev_matched", "dev_mismatched")),
    "qnli": _glue(
        "qnli", "QNLI", "classification", _NLI2, ["accuracy"], "accuracy",
        TsvLayout(header=("index", "question", "sentence", "label"), text="question", text_pair="sentence",
                  label="label", idx="index"),
        TsvLayout(header=("index", "question", "sentence"), text="question", text_pair="sentence", idx="index")),
    "rte": _glue(
        "rte", "RTE", "classification", _NLI2, ["accuracy"], "accuracy",
        TsvLayout(header=("index", "sentence1", "sentence2", "label"), text="sentence1", text_pair="sentence2",
                  label="label", idx="index"),
        _PAIR_TEST),
    "wnli": _glue(
        "wnli", "WNLI", "classification", _BINARY, ["accuracy"], "accuracy",
        TsvLayout(header=("index", "sentence1", "sentence2", "label"), text="sentence1", text_pair="sentence2",
                  label="label", idx="index"),
        _PAIR_TEST),
}

# MNLI's dev layout: five annotator labels, then the gold label (the reader accepts either header for "mnli").
MNLI_DEV_HEADER = _MNLI_FRONT + ("label1", "label2", "label3", "label4", "label5", "gold_label")

# CoNLL-2003 NER tags (the IOB1 files of the shared task and their IOB2 conversions use the same nine names).
CONLL_NER_TAGS = ["O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]

_OTHER_TASKS: dict[str, TaskSpec] = {
    "squad_v1": TaskSpec(
        name="squad_v1", shape="qa", format="squad_json", metrics=["exact_match", "f1"],
        main_metric="f1", splits={"train": "train-v1.1.json", "dev": "dev-v1.1.json"},
        max_seq_length=QA_MAX_SEQ_LENGTH),
    "squad_v2": TaskSpec(
        name="squad_v2", shape="qa", format="squad_json", metrics=["exact", "f1"], main_metric="f1",
        splits={"train": "train-v2.0.json", "dev": "dev-v2.0.json"}, max_seq_length=QA_MAX_SEQ_LENGTH),
    "swag": TaskSpec(
        name="swag", shape="multiple_choice", format="swag_csv", labels=["0", "1", "2", "3"],
        metrics=["accuracy"], main_metric="accuracy",
        splits={"train": "train.csv", "dev": "val.csv", "test": "test.csv"}),
    "conll2003": TaskSpec(
        name="conll2003", shape="token", format="conll", labels=CONLL_NER_TAGS,
        metrics=["entity_f1", "entity_precision", "entity_recall", "accuracy"], main_metric="entity_f1",
        splits={"train": "eng.train", "dev": "eng.testa", "test": "eng.testb"}),
    # Generic tasks: user files with named columns (CSV with a header line, or JSON lines).
    "sequence": TaskSpec(
        name="sequence", shape="classification", format="records", metrics=["accuracy"], main_metric="accuracy",
        columns={"text": "text", "label": "label"}),
    "pair": TaskSpec(
        name="pair", shape="classification", format="records", metrics=["accuracy"], main_metric="accuracy",
        columns={"text": "text", "text_pair": "text_pair", "label": "label"}),
    "regression": TaskSpec(
        name="regression", shape="regression", format="records", metrics=["pearson", "spearman"],
        main_metric="spearman", columns={"text": "text", "text_pair": "text_pair", "label": "label"}),
    "token": TaskSpec(
        name="token", shape="token", format="records", metrics=["entity_f1", "accuracy"], main_metric="entity_f1",
        columns={"tokens": "tokens", "tags": "tags"}),
    "multiple_choice": TaskSpec(
        name="multiple_choice", shape="multiple_choice", format="records", metrics=["accuracy"],
        main_metric="accuracy", columns={"context": "context", "endings": "endings", "label": "label"}),
    "qa": TaskSpec(
        name="qa", shape="qa", format="squad_json", metrics=["exact", "f1"], main_metric="f1",
        max_seq_length=QA_MAX_SEQ_LENGTH),
}

TASKS: dict[str, TaskSpec] = {**GLUE_TASKS, **_OTHER_TASKS}


def task_spec(name: str) -> TaskSpec:
    """The preset called ``name``; a BadInput naming the known presets otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise BadInput(f"task={name!r}: choose one of {sorted(TASKS)}") from None
