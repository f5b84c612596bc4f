"""Fine-tuning a BERT directory with transformers' heads and ``Trainer`` (BERT paper §4 and Figure 4: one output
layer on top, all weights trained), for every task shape of the paper:

* ``classification``: a label per sentence or sentence pair (``[CLS] A [SEP] B [SEP]``, segments 0 / 1) from the
  pooled ``[CLS]`` (``AutoModelForSequenceClassification``); GLUE's CoLA, SST-2, MRPC, QQP, MNLI, QNLI, RTE, WNLI.
* ``regression``: one output trained with MSE (``num_labels=1``, ``problem_type="regression"``): STS-B.
* ``multiple_choice``: one score per ``[CLS] context [SEP] ending [SEP]``, softmax over the choices: SWAG.
* ``token``: a tag per word, carried by the word's first WordPiece (the others are IGNORE_INDEX, ignored by the loss and
  the metrics); entity-level F1 for IOB tags: CoNLL-2003.
* ``qa``: span extraction with document stride, n-best spans and v2.0's null score (``qa.py``): SQuAD.

``--task`` is a preset of ``tasks.py`` (``cola`` ... ``conll2003``) or a generic shape (``sequence``, ``pair``,
``regression``, ``token``, ``multiple_choice``, ``qa``); ``readers.py`` reads the files, ``metrics.py`` scores them.
The model may be a bert_ds export or any Hugging Face BERT directory (``BertForPreTraining``, ``BertForMaskedLM``,
``BertModel``, a fine-tuned model: a head whose shape differs is re-initialised). A tokenizer whose casing differs
from the model's, or whose vocabulary is not the model's token by id, is refused. The output directory gets the
fine-tuned model, its tokenizer and ``finetune_metrics.json`` (with the run's identity: model and data hashes and the
settings; and QA predictions).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bert_ds import cli_args
from bert_ds.cli import alias
from bert_ds.cli_args import option
from bert_ds.config import IGNORE_INDEX
from bert_ds.data.tokenizer import read_lowercase
from bert_ds.downstream import qa
from bert_ds.downstream.identity import check_vocabulary, file_sha256, model_sha256
from bert_ds.downstream.metrics import compute_metrics, squad_v1, squad_v2
from bert_ds.downstream.readers import DownstreamInputError, read_split
from bert_ds.downstream.tasks import MAX_SEQ_LENGTH, QA_MAX_SEQ_LENGTH, TASKS, TaskSpec, task_spec
from bert_ds.errors import BadInput
from bert_ds.export.convert import apply_umask

__all__ = ["METRICS_NAME", "PREDICTIONS_NAME", "FinetuneArgs", "label_names", "split_files", "check_casing",
           "run_identity", "majority_baseline", "finetune", "main"]

log = logging.getLogger(__name__)

METRICS_NAME = "finetune_metrics.json"
PREDICTIONS_NAME = "predictions.json"
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class FinetuneArgs:
    """One fine-tuning run; its fields are ``bert-ds-finetune``'s options (:mod:`bert_ds.cli_args`). Defaults from the
    BERT paper's §A.3 ranges (batch 32, lr 5e-5, 3 epochs), Google's ``run_classifier.py`` (10% linear warm-up, then
    linear decay) and ``run_squad.py`` (stride 128, query 64, n-best 20, answers of at most 30 tokens)."""

    model: str
    """Export directory (bert-ds-convert-checkpoint --out) or any Hugging Face BERT directory."""
    out: str
    """Output directory (must not exist or be empty)."""
    task: str = option("sequence", metavar="TASK", help=f"a preset or generic shape: {', '.join(TASKS)}")
    train_file: str | None = option(None, flags=("--train",), help="training file (overrides --data-dir)")
    validation_file: str | None = option(None, flags=("--validation",), help="labelled evaluation file in the same "
                                         "format (overrides --data-dir's dev split)")
    data_dir: str | None = None
    """GLUE data directory (or the task's directory), or the directory holding the preset's SQuAD/SWAG/CoNLL files;
    the preset names the files."""
    tokenizer: str | None = None
    """Tokenizer directory (default: the model's); its casing must match the model's and its vocabulary must be the
    model's, token by id."""
    text_column: str | None = None
    """Generic tasks: the (first) text (default: text); token: the words, a JSON list or a space-separated string
    (default: tokens)."""
    text_pair_column: str | None = None
    """Generic tasks: the second text of a pair."""
    label_column: str | None = None
    """Generic tasks: the label (default: label); token: the tags (default: tags)."""
    max_seq_length: int | None = option(None, help="WordPieces per example, [CLS]/[SEP] included; longer ones are "
                                        f"truncated and counted (default: {QA_MAX_SEQ_LENGTH} for QA tasks, "
                                        f"{MAX_SEQ_LENGTH} for the others)")
    doc_stride: int = 128
    """QA: tokens a window shares with the previous one."""
    max_query_length: int = 64
    """QA: question WordPieces kept."""
    n_best: int = 20
    """QA: start/end candidates per window."""
    max_answer_length: int = 30
    """QA: longest answer in WordPieces."""
    null_threshold: float = 0.0
    """SQuAD v2.0: no answer when null score - best span score exceeds this (tau); the metrics report the dev-optimal
    value as best_f1_thresh, in these units."""
    epochs: float = 3.0
    """Passes over the training file."""
    batch_size: int = 32
    """Examples per step and device."""
    learning_rate: float = 5e-5
    """Peak Adam lr, linear decay."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup_fraction: float = 0.1
    """Fraction of the steps spent warming the lr up."""
    gradient_accumulation_steps: int = 1
    """Batches per optimizer step."""
    seed: int = 42
    """Seed of the head's init and the shuffling."""
    device: str = option("auto", choices=DEVICES, help="auto: a GPU when there is one; cpu; cuda (refused without a "
                         "GPU)")
    bf16: bool = False
    """bf16 mixed precision."""
    deepspeed: str | None = option(None, metavar="CONFIG", help="DeepSpeed JSON config for Trainer's integration "
                                   "(launch with the deepspeed launcher)")
    logging_steps: int = 10
    """Log the training loss every N steps."""

    def __post_init__(self) -> None:
        self.spec = task_spec(self.task)  # BadInput listing the presets
        if self.max_seq_length is None:
            self.max_seq_length = self.spec.max_seq_length
        if self.device is None:
            self.device = "auto"
        if self.device not in DEVICES:
            raise BadInput(f"device={self.device!r}: choose one of {DEVICES}")
        if self.spec.shape not in ("classification", "regression") and self.text_pair_column:
            raise BadInput(f"text_pair_column is for sentence-pair tasks, not {self.spec.shape!r}")
        for name in ("max_seq_length", "batch_size", "logging_steps", "gradient_accumulation_steps", "n_best",
                     "max_answer_length", "max_query_length", "doc_stride"):
            if getattr(self, name) < 1:
                raise BadInput(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.epochs > 0 or not self.learning_rate > 0:
            raise BadInput(f"epochs and learning_rate must be > 0, got {self.epochs!r} and {self.learning_rate!r}")
        if not 0 <= self.warmup_fraction < 1:
            raise BadInput(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction!r}")
        if self.train_file is None and self.data_dir is None:
            raise BadInput("give --data-dir or --train")
        if self.deepspeed is not None and not Path(self.deepspeed).is_file():
            raise BadInput(f"deepspeed={self.deepspeed!r}: no such file")

    def columns(self) -> dict[str, str]:
        """Column overrides for generic CSV/JSON-lines tasks (``--text-column`` etc.)."""
        roles = ({"tokens": self.text_column, "tags": self.label_column} if self.spec.shape == "token" else
                 {"text": self.text_column, "text_pair": self.text_pair_column, "label": self.label_column})
        return {k: v for k, v in roles.items() if v}


# --------------------------------------------------------------------------------------------------- inputs
def split_files(spec: TaskSpec, data_dir: str | Path | None, train: str | None = None,
                validation: str | None = None) -> dict[str, Path]:
    """Split name -> file: the preset's files under ``data_dir`` (GLUE: ``data_dir/<glue_dir>/`` or ``data_dir``
    itself when it is the task's directory), then the explicit files. Evaluation splits: ``spec.eval_splits``."""
    files: dict[str, Path] = {}
    if data_dir is not None:
        root = Path(data_dir)
        if spec.glue_dir and (root / spec.glue_dir).is_dir():
            root = root / spec.glue_dir
        if not spec.splits:
            raise BadInput(f"task {spec.name!r} has no file names; give --train/--validation")
        for split in ("train", *spec.eval_splits):
            path = root / spec.splits[split]
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no such file (task {spec.name!r}, split {split!r})")
            files[split] = path
    if train:
        files["train"] = Path(train)
    if validation:
        files = {k: v for k, v in files.items() if k == "train"} | {"dev": Path(validation)}
    if "train" not in files:
        raise BadInput("no training file")
    return files


def label_names(values: list) -> list[str]:
    """The distinct labels as strings, sorted numerically when all are integers (``2`` before ``10``)."""
    names = {str(v) for v in values}
    if all(n.lstrip("-").isdigit() for n in names):
        return sorted(names, key=int)
    return sorted(names)


def _labels(spec: TaskSpec, train: list[dict], source: Path) -> list[str] | None:
    if spec.shape in ("regression", "qa"):
        return None
    if spec.shape == "multiple_choice":
        return None
    if spec.labels is not None:
        return list(spec.labels)
    values = [t for r in train for t in r["tags"]] if spec.shape == "token" else [r["label"] for r in train]
    labels = label_names([v for v in values if v is not None])
    if len(labels) < 2:
        raise BadInput(f"{source}: only one distinct label {labels}; a classifier needs at least two")
    return labels


def _check_eval_labels(spec: TaskSpec, labels: list[str] | None, records: dict, files: dict, args) -> None:
    """Every label of an evaluation split of a generic task occurs in the training file (its label set comes from
    there), checked before the model loads and over whole examples, truncated words included."""
    if labels is None or spec.labels is not None:
        return
    known = {name: i for i, name in enumerate(labels)}
    role = "tags" if spec.shape == "token" else "label"
    for split, path in files.items():
        for number, r in enumerate(records[split] if split != "train" else (), 1):
            for value in (r["tags"] if role == "tags" else [r["label"]]):
                if value is not None and str(value) not in known:
                    raise _unseen_label(path, r, number, role, value, known, args)


def run_identity(args: FinetuneArgs) -> dict:
    """What decides a run's result, by content: the task, the model directory's :func:`identity.model_sha256`, the
    sha256 of each split file, then every setting of ``args`` except where things are (``out``, the paths, which
    ``model_sha256`` and ``data_sha256`` stand for), the device and how often it logs. Recorded in the metrics file;
    the GLUE suite reuses a finished run only when its identity is this one (fields in this order)."""
    files = split_files(args.spec, args.data_dir, args.train_file, args.validation_file)
    where = ("task", "model", "out", "train_file", "validation_file", "data_dir", "device", "logging_steps")
    settings = {k: v for k, v in asdict(args).items() if k not in where}
    return {"task": args.spec.name, "model_sha256": model_sha256(args.model),
            "data_sha256": {split: file_sha256(path) for split, path in files.items()}, **settings}


# --------------------------------------------------------------------------------------------------- model
def _vocab_lowercase(directory: Path) -> bool | None:
    """An uncased WordPiece vocabulary has no ASCII upper-case letter outside its special tokens (Google's uncased
    vocabulary still holds symbols such as "ℝ" that Python calls upper case)."""
    vocab = directory / "vocab.txt"
    if not vocab.is_file():
        return None
    try:
        tokens = [t for t in vocab.read_text(encoding="utf-8").split("\n") if t and not t.startswith("[")]
    except UnicodeDecodeError as exc:
        raise BadInput(f"{vocab}: not UTF-8 at byte {exc.start}") from exc
    return not any("A" <= c <= "Z" for t in tokens for c in t)


def _tokenizer_lowercase(tokenizer) -> bool | None:
    """Whether the tokenizer lower-cases "Hello HELLO": from its normaliser's output when it has one (a fast
    tokenizer), else from its pieces other than special tokens. Never from ``[UNK]``: a small or domain vocabulary
    that cannot spell "hello" turns it into ``[UNK]``, whose upper-case letters say nothing of the input's. None when
    nothing is left to judge by."""
    probe = "Hello HELLO"
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    if normalizer is not None:
        return not any(c.isupper() for c in normalizer.normalize_str(probe))
    special = set(tokenizer.all_special_tokens)
    pieces = [p for p in tokenizer.tokenize(probe) if p not in special]
    return not any(c.isupper() for p in pieces for c in p) if pieces else None


def check_casing(model_dir: str | Path, tokenizer) -> bool | None:
    """Refuse a tokenizer that lower-cases text for a model trained on cased text, or the reverse: the model's casing
    is what its directory records (bert_ds exports and hub models: ``do_lower_case`` in ``tokenizer_config.json``),
    else what its vocabulary shows; the tokenizer's is what it does to "Hello" (:func:`_tokenizer_lowercase`).
    Returns the tokenizer's lowercase flag (None when it cannot be told)."""
    model_dir = Path(model_dir)
    model_lower = read_lowercase(model_dir, default=None)
    if model_lower is None:
        model_lower = _vocab_lowercase(model_dir)
    tokenizer_lower = _tokenizer_lowercase(tokenizer)
    if None not in (model_lower, tokenizer_lower) and model_lower != tokenizer_lower:
        kind = {True: "uncased (lower-cases its input)", False: "cased (keeps upper case)"}
        raise BadInput(f"tokenizer {tokenizer.name_or_path}: {kind[tokenizer_lower]}, but model {model_dir} was "
                       f"trained {kind[model_lower].split(' ')[0]}; use the model's own tokenizer or one with "
                       f"do_lower_case={model_lower}")
    return tokenizer_lower


def _head(shape: str):
    import transformers

    return {"classification": transformers.AutoModelForSequenceClassification,
            "regression": transformers.AutoModelForSequenceClassification,
            "multiple_choice": transformers.AutoModelForMultipleChoice,
            "token": transformers.AutoModelForTokenClassification,
            "qa": transformers.AutoModelForQuestionAnswering}[shape]


def _load(args: FinetuneArgs, labels: list[str] | None):
    import transformers

    spec = args.spec
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    if spec.shape in ("token", "qa") and not tokenizer.is_fast:
        raise BadInput(f"{args.tokenizer or args.model}: {spec.shape} needs a fast tokenizer (tokenizer.json) to "
                       "map WordPieces to words and characters")
    check_casing(args.model, tokenizer)
    config = transformers.AutoConfig.from_pretrained(args.model)
    check_vocabulary(args.model, tokenizer, args.tokenizer, config.vocab_size)
    kwargs: dict = {}
    if spec.shape == "regression":
        kwargs = {"num_labels": 1, "problem_type": "regression"}  # one output, MSE loss (not one class per score)
    elif labels is not None:
        kwargs = {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
                  "label2id": {name: i for i, name in enumerate(labels)}}
        if spec.shape == "classification":
            kwargs["problem_type"] = "single_label_classification"
    transformers.set_seed(args.seed)  # the new output layer's initialisation
    # A fine-tuned model as the start (MNLI -> RTE transfer): its head has another shape and is initialised anew.
    model = _head(spec.shape).from_pretrained(args.model, ignore_mismatched_sizes=True, **kwargs)
    max_len = model.config.max_position_embeddings
    if args.max_seq_length > max_len:
        raise BadInput(f"max_seq_length={args.max_seq_length} exceeds the model's max_position_embeddings={max_len}")
    return tokenizer, model


# --------------------------------------------------------------------------------------------------- encoding
def _unseen_label(source, record: dict, number: int, role: str, value, label2id: dict, args) -> DownstreamInputError:
    """A label of an evaluation file that the training file never had (generic tasks take their label set from
    it), at the record's line and the column holding it."""
    column = {**args.spec.columns, **args.columns()}.get(role, role)
    return DownstreamInputError(source, record.get("line", number), repr(column), f"label {str(value)!r} does not "
                                f"occur in the training file (labels: {list(label2id)})")


def _encode_pairs(records, tokenizer, args, label2id, source) -> tuple[list[dict], int]:
    examples, truncated = [], 0
    for number, r in enumerate(records, 1):
        full = tokenizer(r["text"], r["text_pair"])
        enc = dict(tokenizer(r["text"], r["text_pair"], truncation=True, max_length=args.max_seq_length))
        truncated += len(full["input_ids"]) > len(enc["input_ids"])
        if r["label"] is not None:
            if args.spec.shape == "regression":
                enc["labels"] = float(r["label"])
            elif str(r["label"]) not in label2id:
                raise _unseen_label(source, r, number, "label", r["label"], label2id, args)
            else:
                enc["labels"] = label2id[str(r["label"])]
        examples.append(enc)
    return examples, truncated


def _encode_tokens(records, tokenizer, args, label2id, source) -> tuple[list[dict], int]:
    examples, truncated = [], 0
    for number, r in enumerate(records, 1):
        enc = tokenizer(r["tokens"], is_split_into_words=True, truncation=True, max_length=args.max_seq_length)
        labels, previous = [], None
        for word in enc.word_ids():
            first_piece = word is not None and word != previous
            if first_piece and r["tags"][word] not in label2id:
                raise _unseen_label(source, r, number, "tags", r["tags"][word], label2id, args)
            labels.append(label2id[r["tags"][word]] if first_piece else IGNORE_INDEX)
            previous = word
        truncated += len({w for w in enc.word_ids() if w is not None}) < len(r["tokens"])
        examples.append({**enc, "labels": labels})
    return examples, truncated


def _encode_choices(records, tokenizer, args, label2id, source) -> tuple[list[dict], int]:
    examples, truncated = [], 0
    for r in records:
        n = len(r["endings"])
        enc = tokenizer([r["context"]] * n, r["endings"], truncation=True, max_length=args.max_seq_length)
        full = tokenizer([r["context"]] * n, r["endings"])
        truncated += any(len(a) > len(b) for a, b in zip(full["input_ids"], enc["input_ids"], strict=True))
        example = {k: list(v) for k, v in enc.items()}
        if r["label"] is not None:
            example["labels"] = int(r["label"])
        examples.append(example)
    if len({len(e["input_ids"]) for e in examples}) > 1:
        raise BadInput(f"{source}: examples have different numbers of choices; a batch needs the same number")
    return examples, truncated


_ENCODERS = {"classification": _encode_pairs, "regression": _encode_pairs, "token": _encode_tokens,
             "multiple_choice": _encode_choices}


class ChoiceCollator:
    """Pads (batch, choices, tokens) inputs to the longest sequence of the batch."""

    def __init__(self, tokenizer):
        self.pad_id = tokenizer.pad_token_id

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(seq) for f in features for seq in f["input_ids"])
        batch = {}
        for key in ("input_ids", "token_type_ids", "attention_mask"):
            if key in features[0]:
                fill = self.pad_id if key == "input_ids" else 0
                batch[key] = torch.tensor([[seq + [fill] * (width - len(seq)) for seq in f[key]] for f in features])
        if "labels" in features[0]:
            batch["labels"] = torch.tensor([f["labels"] for f in features])
        return batch


def _collator(shape: str, tokenizer):
    import transformers

    if shape == "multiple_choice":
        return ChoiceCollator(tokenizer)
    if shape == "token":
        return transformers.DataCollatorForTokenClassification(tokenizer)
    return transformers.DataCollatorWithPadding(tokenizer)


# --------------------------------------------------------------------------------------------------- metrics
def _is_iob(labels: list[str]) -> bool:
    return all(t == "O" or t[:2] in ("B-", "I-") for t in labels) and any(t != "O" for t in labels)


def _metric_names(spec: TaskSpec, labels: list[str] | None) -> list[str]:
    names = list(spec.metrics)
    if spec.shape == "token" and labels is not None and not _is_iob(labels):
        names = [n for n in names if not n.startswith("entity_")]  # tags without entities: token accuracy only
    if spec.shape == "classification" and "f1" in names and labels is not None and len(labels) != 2:
        names.remove("f1")  # binary F1 needs two classes
    return names or ["accuracy"]


def _scores(spec: TaskSpec, labels: list[str] | None, logits: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    names = _metric_names(spec, labels)
    if spec.shape == "regression":
        return compute_metrics(names, logits.reshape(-1).tolist(), gold.reshape(-1).tolist())
    predicted = logits.argmax(-1)
    if spec.shape == "token":
        keep = gold != IGNORE_INDEX
        pred_tags = [[labels[p] for p in row[k]] for row, k in zip(predicted, keep, strict=True)]
        gold_tags = [[labels[g] for g in row[k]] for row, k in zip(gold, keep, strict=True)]
        return compute_metrics(names, pred_tags, gold_tags)
    return compute_metrics(names, predicted.tolist(), gold.tolist())


def majority_baseline(spec: TaskSpec, labels: list[str] | None, train: list[dict],
                      validation: list[dict]) -> dict[str, float]:
    """The score to beat: always answering the training set's most frequent label (classification, token), the
    training mean (regression: a constant has no correlation, scored 0), or one choice (multiple choice: the most
    frequent index). ``majority_accuracy`` is the accuracy of that constant answer on ``validation``."""
    names = _metric_names(spec, labels)
    if spec.shape == "regression":
        return {n: 0.0 for n in names} | {"majority_accuracy": None}
    if spec.shape == "token":
        gold = [[g for g in ex["labels"] if g != IGNORE_INDEX] for ex in validation]
        common = Counter(g for ex in train for g in ex["labels"] if g != IGNORE_INDEX).most_common(1)[0][0]
        scores = compute_metrics(names, [[labels[common]] * len(g) for g in gold],
                                 [[labels[x] for x in g] for g in gold])
        return scores | {"majority_accuracy": scores.get("accuracy", _flat_accuracy(gold, common))}
    gold = [ex["labels"] for ex in validation]
    common = Counter(ex["labels"] for ex in train).most_common(1)[0][0]
    scores = compute_metrics(names, [common] * len(gold), gold)
    return scores | {"majority_accuracy": sum(g == common for g in gold) / len(gold)}


def _flat_accuracy(gold: list[list[int]], answer: int) -> float:
    flat = [g for row in gold for g in row]
    return sum(g == answer for g in flat) / len(flat)


# --------------------------------------------------------------------------------------------------- training
def _deepspeed_config(args: FinetuneArgs, world: int) -> dict:
    """The DeepSpeed config with its batch fields filled from the arguments (``"auto"`` or absent) or checked
    against them: DeepSpeed asserts train_batch_size = micro batch x accumulation x ranks, and transformers' own "auto"
    filling has been seen to leave the accumulation out of it (transformers 4.5x + accelerate 1.x)."""
    try:
        config = json.loads(Path(args.deepspeed).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise BadInput(f"{args.deepspeed}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise BadInput(f"{args.deepspeed}: a DeepSpeed config is a JSON object")
    wanted = {"train_micro_batch_size_per_gpu": args.batch_size,
              "gradient_accumulation_steps": args.gradient_accumulation_steps,
              "train_batch_size": args.batch_size * args.gradient_accumulation_steps * world}
    for key, value in wanted.items():
        if config.get(key, "auto") == "auto":
            config[key] = value
        elif config[key] != value:
            raise BadInput(f"{args.deepspeed}: {key}={config[key]!r} but the arguments give {value} "
                           "(--batch-size, --gradient-accumulation-steps, ranks); use \"auto\"")
    return config


def _training_arguments(args: FinetuneArgs, work_dir: Path, train_examples: int):
    import transformers

    if args.device == "cuda" and not torch.cuda.is_available():
        raise BadInput("device='cuda' but torch sees no GPU; use --device cpu or auto")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    batches = math.ceil(train_examples / (args.batch_size * world)) / args.gradient_accumulation_steps
    steps = math.ceil(math.ceil(batches) * args.epochs)
    return transformers.TrainingArguments(
        output_dir=str(work_dir), num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.learning_rate,
        weight_decay=args.weight_decay, warmup_steps=int(args.warmup_fraction * steps), lr_scheduler_type="linear",
        gradient_accumulation_steps=args.gradient_accumulation_steps, bf16=args.bf16,
        deepspeed=_deepspeed_config(args, world) if args.deepspeed else None,
        seed=args.seed, logging_steps=args.logging_steps, save_strategy="no", report_to="none",
        use_cpu=args.device == "cpu" or not torch.cuda.is_available(),
        # CPU ranks (tests, a machine without GPUs) talk over gloo; accelerate counts them from WORLD_SIZE.
        ddp_backend="gloo" if world > 1 and (args.device == "cpu" or not torch.cuda.is_available()) else None,
        disable_tqdm=True, ddp_find_unused_parameters=False)


def _evaluate(trainer, spec, labels, dataset: list[dict]) -> dict[str, float]:
    out = trainer.predict(dataset)
    logits = out.predictions[0] if isinstance(out.predictions, tuple) else out.predictions
    return {"loss": float(out.metrics["test_loss"]), **_scores(spec, labels, logits, out.label_ids)}


def _qa_evaluate(trainer, args: FinetuneArgs, tokenizer, records: list[dict]) -> tuple[dict, dict]:
    inputs, meta = qa.eval_features(tokenizer, records, args.max_seq_length, args.doc_stride, args.max_query_length)
    out = trainer.predict(inputs)
    start, end = out.predictions[:2]
    texts, margins = qa.best_spans(start, end, meta, records, args.n_best, args.max_answer_length)
    v2 = args.spec.name != "squad_v1" and (args.spec.name == "squad_v2" or any(r["is_impossible"] for r in records))
    predictions = qa.answers(texts, margins, args.null_threshold if v2 else None)
    if v2:
        # Scored on the best spans with the null margin as na_prob: the threshold turns the margins above it into
        # "no answer" (the reported exact/f1), and the sweep gives the dev-optimal tau (best_f1_thresh) as a value
        # --null-threshold reproduces: margins are signed, so the official 0.0 for "below every value" is not one.
        scores = squad_v2(texts, records, na_probs=margins, na_prob_thresh=args.null_threshold,
                          reproducible_thresholds=True)
    else:
        scores = squad_v1(predictions, records)
    return {k: float(v) for k, v in scores.items()}, predictions


def _encode_splits(args: FinetuneArgs, files: dict[str, Path], records: dict[str, list[dict]], tokenizer,
                   labels: list[str] | None) -> tuple[list[dict], dict[str, list[dict]], int]:
    """(training features, encoded evaluation splits, examples truncated). QA windows its training questions here and
    its evaluation questions at scoring time; every other shape encodes each split, and an evaluation split must be
    labelled."""
    spec = args.spec
    if spec.shape == "qa":
        return qa.train_features(tokenizer, records["train"], args.max_seq_length, args.doc_stride,
                                 args.max_query_length), {}, 0
    label2id = {name: i for i, name in enumerate(labels)} if labels else {}
    encoded, truncated = {}, 0
    for split in files:
        encoded[split], n = _ENCODERS[spec.shape](records[split], tokenizer, args, label2id, files[split])
        truncated += n
    for split in (s for s in files if s != "train"):
        if any("labels" not in ex for ex in encoded[split]):
            raise BadInput(f"{files[split]}: no labels (a test file?); evaluation needs a labelled file")
    return encoded["train"], encoded, truncated


def _train_and_score(trainer, args: FinetuneArgs, tokenizer, labels, records, train, encoded, eval_names) -> dict:
    """Score before training (where Trainer can), train, score after, with the majority baseline; returns the parts
    of the metrics file that come from training."""
    spec = args.spec
    before, after, baseline, predictions = {}, {}, {}, {}
    # Before training Trainer runs DeepSpeed only as ZeRO-3 inference; under other stages that score is skipped.
    if spec.shape != "qa" and args.deepspeed is None:
        for split in eval_names:
            before[split] = _evaluate(trainer, spec, labels, encoded[split])
    result = trainer.train()
    for split in eval_names:
        if spec.shape == "qa":
            after[split], predictions[split] = _qa_evaluate(trainer, args, tokenizer, records[split])
        else:
            after[split] = _evaluate(trainer, spec, labels, encoded[split])
            baseline[split] = majority_baseline(spec, labels, train, encoded[split])
    first = eval_names[0] if eval_names else None
    return {"steps": result.global_step, "train_loss": result.training_loss,
            "train_loss_log": [{"step": e["step"], "loss": e["loss"]} for e in trainer.state.log_history
                               if "loss" in e],
            "eval": after, "eval_before": before, "baseline": baseline,
            "before": before.get(first), "after": after.get(first),
            "majority_accuracy": baseline[first]["majority_accuracy"] if first in baseline else None,
            "predictions": predictions}


def _publish(trainer, work: Path, out: Path, metrics: dict, predictions: dict) -> None:
    """Save the model, metrics and predictions into ``work`` and rename it to ``out`` (the main process); other ranks
    drop their copy."""
    trainer.save_model(str(work))  # every rank calls it (ZeRO-3 gathers the weights); the main process writes
    if not trainer.is_world_process_zero():
        shutil.rmtree(work, ignore_errors=True)
        return
    (work / METRICS_NAME).write_text(json.dumps(metrics, indent=2) + "\n")
    if predictions:
        (work / PREDICTIONS_NAME).write_text(json.dumps(predictions, indent=2) + "\n")
    if out.exists():
        out.rmdir()  # empty (checked before training); rename cannot replace a directory
    apply_umask(work)  # mkdtemp's 0700 and safetensors' 0600 otherwise
    work.rename(out)


def finetune(args: FinetuneArgs) -> dict:
    """Fine-tune ``args.model`` on the task's training split; write the model, tokenizer and metrics JSON to
    ``args.out`` (atomically: a temporary directory beside it, renamed at the end). Returns the metrics: the training
    loss every ``logging_steps`` steps and, per evaluation split, the task's metrics before and after training next
    to the majority baseline; ``after`` / ``before`` are those of the first evaluation split."""
    spec = args.spec
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"{out}: already exists and is not an empty directory; choose another --out")
    files = split_files(spec, args.data_dir, args.train_file, args.validation_file)
    columns = args.columns() if spec.format == "records" else None
    records = {split: read_split(spec, path, columns=columns, training=split == "train")
               for split, path in files.items()}
    labels = _labels(spec, records["train"], files["train"])
    _check_eval_labels(spec, labels, records, files, args)
    identity = run_identity(args)
    tokenizer, model = _load(args, labels)
    eval_names = [s for s in files if s != "train"]
    train, encoded, truncated = _encode_splits(args, files, records, tokenizer, labels)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        import transformers

        trainer = transformers.Trainer(
            model=model, args=_training_arguments(args, work, len(train)), train_dataset=train,
            data_collator=_collator(spec.shape, tokenizer), processing_class=tokenizer)
        trained = _train_and_score(trainer, args, tokenizer, labels, records, train, encoded, eval_names)
        predictions = trained.pop("predictions")
        first = eval_names[0] if eval_names else None
        metrics = {
            "task": spec.name, "shape": spec.shape, "model": str(args.model), "labels": labels,
            "num_labels": model.config.num_labels, "problem_type": model.config.problem_type,
            "main_metric": spec.main_metric, "train_examples": len(records["train"]), "train_features": len(train),
            "validation_examples": len(records[first]) if first else 0, "truncated_examples": truncated,
            **trained, "world_size": trainer.args.world_size, "args": asdict(args), "identity": identity,
        }
        _publish(trainer, work, out, metrics, predictions)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return metrics


# --------------------------------------------------------------------------------------------------- CLI
def build_parser(prog: str = "bert-ds-finetune") -> argparse.ArgumentParser:
    """The CLI generated from FinetuneArgs (its defaults, its field docs), plus the launcher's ``--local_rank``."""
    parser = cli_args.build_parser(FinetuneArgs, prog, "Fine-tune a BERT directory (a bert_ds export or a Hugging Face "
                                   "BERT) with transformers' heads and Trainer, on any task shape of the BERT paper: "
                                   "classification, regression, multiple choice, token tagging, span-extraction QA.")
    # The deepspeed launcher passes it; transformers reads LOCAL_RANK, so it is parsed and dropped.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return parser


def _summary(metrics: dict) -> str:
    main_metric, lines = metrics["main_metric"], []
    for split, scores in metrics["eval"].items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if isinstance(v, float) and "thresh" not in k)
        line = f"{split}: {shown}"
        if split in metrics["baseline"]:
            base = metrics["baseline"][split].get(main_metric)
            if base is not None:
                line += f" (majority baseline {main_metric} {base:.4f})"
        lines.append(line)
    return "\n".join(lines)


main = alias("finetune")


def _run(args: FinetuneArgs) -> int:
    """``bert-ds-finetune`` / ``tools/finetune.py``: exit 0 after writing the model, 2 for bad input."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.device == "cpu" or not torch.cuda.is_available():
        # accelerate (under Trainer) imports deepspeed when it is installed, which then warns that it "was unable to
        # detect" a GPU; name the CPU accelerator it would pick anyway.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.deepspeed is not None:
        # DeepSpeed's CPU backend builds its shared-memory extension when Trainer starts it: build or load it where
        # pre-training does, under the same lock, with this interpreter's ninja (bert_ds.runtime.caches), rather than
        # in torch's default directory, where it would be built again (a minute of a core per rank).
        from bert_ds.runtime.caches import extensions_root, load_extensions

        loaded = load_extensions()
        if loaded:
            log.info("JIT extensions %s loaded from %s", ", ".join(loaded), extensions_root())
    metrics = finetune(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {args.out}: {metrics['steps']} steps, mean training loss {metrics['train_loss']:.4f}")
        if metrics["after"] is not None and metrics["before"]:
            b, a = metrics["before"], metrics["after"]
            line = f"validation: loss {b['loss']:.4f} -> {a['loss']:.4f}"
            if "accuracy" in a and metrics["majority_accuracy"] is not None:
                line += (f", accuracy {b['accuracy']:.4f} -> {a['accuracy']:.4f} (always answering the most "
                         f"frequent label: {metrics['majority_accuracy']:.4f})")
            print(line)
        print(_summary(metrics))
    return 0
