"""Fine-tuning an exported model with transformers' ``Trainer`` (BERT paper §4: one output layer on top, all weights
trained), from local CSV or JSON-lines files.

Tasks:

* ``sequence``: a label per example from one text column (single sentence, e.g. SST-2, CoLA) or two (sentence pair,
  e.g. MNLI, MRPC: ``[CLS] A [SEP] B [SEP]`` with segment ids 0 / 1, as in pre-training). The head classifies the
  pooled ``[CLS]`` vector.
* ``token``: a tag per word (e.g. CoNLL-2003 NER). The words column holds a JSON list or a whitespace-separated
  string, the tags column the same number of tags. As in the paper (§4.3), a word's first WordPiece carries its tag
  and the loss and accuracy ignore the other pieces.

Labels are whatever the files hold (strings or numbers); the training file's distinct labels, sorted, become the ids,
and the mapping is saved as ``id2label`` / ``label2id`` in the output's ``config.json``, so ``pipeline(...)`` answers
with the names. The output directory gets the fine-tuned model, its tokenizer and ``finetune_metrics.json``.

Nothing here imports deepspeed: fine-tuning needs only the export.
"""

from __future__ import annotations

import argparse
import csv
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

import torch

from bert_ds.export.convert import apply_umask

__all__ = ["TASKS", "METRICS_NAME", "FinetuneArgs", "read_records", "label_names", "encode_sequence_examples",
           "encode_token_examples", "majority_accuracy", "finetune", "main"]

log = logging.getLogger(__name__)

TASKS = ("sequence", "token")
METRICS_NAME = "finetune_metrics.json"
IGNORE_INDEX = -100  # positions the loss skips (transformers' and torch's cross-entropy default)
_DEFAULT_COLUMNS = {"sequence": ("text", "label"), "token": ("tokens", "tags")}


@dataclass
class FinetuneArgs:
    """One fine-tuning run. Defaults from the BERT paper's §A.3 ranges (batch 32, lr 5e-5, 3 epochs) and Google's
    ``run_classifier.py`` (10% linear warm-up, then linear decay)."""

    model: str
    """Directory of an export (``bert-ds-convert-checkpoint``) or any BERT model directory transformers reads."""
    train_file: str
    out: str
    task: str = "sequence"
    validation_file: str | None = None
    text_column: str | None = None
    """Sequence: the (first) text; token: the words. Default ``text`` / ``tokens``."""
    text_pair_column: str | None = None
    """Sequence only: the second text of a sentence pair."""
    label_column: str | None = None
    """Sequence: the label; token: the tags. Default ``label`` / ``tags``."""
    max_seq_length: int = 128
    epochs: float = 3.0
    batch_size: int = 32
    learning_rate: float = 5e-5
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1
    seed: int = 42
    device: str | None = None
    """``cpu`` forces the CPU; default: whatever transformers picks (a GPU when there is one)."""
    logging_steps: int = 10

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r}: choose one of {TASKS}")
        if self.task == "token" and self.text_pair_column:
            raise ValueError("text_pair_column is for the sequence task; token classification reads one column")
        text, label = _DEFAULT_COLUMNS[self.task]
        self.text_column = self.text_column or text
        self.label_column = self.label_column or label
        for name in ("max_seq_length", "batch_size", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.epochs > 0 or not self.learning_rate > 0:
            raise ValueError(f"epochs and learning_rate must be > 0, got {self.epochs!r} and {self.learning_rate!r}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction!r}")


def read_records(path: str | Path) -> list[dict]:
    """Rows of a ``.csv`` file (header line) or a JSON-lines file (``.jsonl`` / ``.json``, one object a line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    elif suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not a JSON object: {exc}") from exc
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
                rows.append(row)
    else:
        raise ValueError(f"{path}: unknown format {suffix!r}; use .csv, .jsonl or .json (JSON lines)")
    if not rows:
        raise ValueError(f"{path}: no examples")
    return rows


def _column(row: dict, name: str, where: str):
    if name not in row or row[name] is None or row[name] == "":
        raise ValueError(f"{where}: no value in column {name!r} (columns: {sorted(row)})")
    return row[name]


def _words(value) -> list[str]:
    """A JSON list of words or a whitespace-separated string (how a CSV cell holds them)."""
    if isinstance(value, list):
        return [str(v) for v in value]
    return str(value).split()


def label_names(values: list) -> list[str]:
    """The distinct labels as strings, sorted numerically when all are integers (``2`` before ``10``)."""
    names = {str(v) for v in values}
    if all(n.lstrip("-").isdigit() for n in names):
        return sorted(names, key=int)
    return sorted(names)


def _label_id(value, label2id: dict[str, int], where: str) -> int:
    name = str(value)
    if name not in label2id:
        raise ValueError(f"{where}: label {name!r} does not occur in the training file (labels: {list(label2id)})")
    return label2id[name]


def encode_sequence_examples(rows: list[dict], tokenizer, args: FinetuneArgs, label2id: dict[str, int],
                             source: str) -> tuple[list[dict], int]:
    """Token ids + label id per row; returns the examples and how many were truncated to ``max_seq_length``."""
    examples, truncated = [], 0
    for number, row in enumerate(rows, 1):
        where = f"{source}: example {number}"
        text = str(_column(row, args.text_column, where))
        pair = str(_column(row, args.text_pair_column, where)) if args.text_pair_column else None
        full = tokenizer(text, pair)
        enc = tokenizer(text, pair, truncation=True, max_length=args.max_seq_length)
        truncated += len(full["input_ids"]) > len(enc["input_ids"])
        examples.append({**enc, "labels": _label_id(_column(row, args.label_column, where), label2id, where)})
    return examples, truncated


def encode_token_examples(rows: list[dict], tokenizer, args: FinetuneArgs, label2id: dict[str, int],
                          source: str) -> tuple[list[dict], int]:
    """Token ids + one label per WordPiece (the word's tag on its first piece, ignored elsewhere)."""
    examples, truncated = [], 0
    for number, row in enumerate(rows, 1):
        where = f"{source}: example {number}"
        words = _words(_column(row, args.text_column, where))
        tags = _words(_column(row, args.label_column, where))
        if len(words) != len(tags):
            raise ValueError(f"{where}: {len(words)} words in {args.text_column!r} but {len(tags)} tags in "
                             f"{args.label_column!r}")
        enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=args.max_seq_length)
        labels, previous = [], None
        for word in enc.word_ids():
            first_piece = word is not None and word != previous
            labels.append(_label_id(tags[word], label2id, where) if first_piece else IGNORE_INDEX)
            previous = word
        truncated += len({w for w in enc.word_ids() if w is not None}) < len(words)
        examples.append({**enc, "labels": labels})
    return examples, truncated


def majority_accuracy(examples: list[dict]) -> float:
    """Accuracy of always answering the most frequent label of ``examples`` (the chance level to beat)."""
    labels = [label for ex in examples for label in (ex["labels"] if isinstance(ex["labels"], list) else
                                                      [ex["labels"]]) if label != IGNORE_INDEX]
    return Counter(labels).most_common(1)[0][1] / len(labels)


def _accuracy(eval_prediction) -> dict:
    logits, labels = eval_prediction.predictions, eval_prediction.label_ids
    predicted = logits.argmax(-1)
    real = labels != IGNORE_INDEX
    return {"accuracy": float((predicted[real] == labels[real]).mean())}


def _load(args: FinetuneArgs, labels: list[str]):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    if args.task == "token" and not tokenizer.is_fast:
        raise ValueError(f"{args.model}: token classification needs a fast tokenizer (tokenizer.json) to map "
                         "WordPieces to words")
    head = (transformers.AutoModelForSequenceClassification if args.task == "sequence"
            else transformers.AutoModelForTokenClassification)
    transformers.set_seed(args.seed)  # the new classifier layer's initialisation
    model = head.from_pretrained(args.model, num_labels=len(labels), id2label=dict(enumerate(labels)),
                                 label2id={name: i for i, name in enumerate(labels)})
    max_len = model.config.max_position_embeddings
    if args.max_seq_length > max_len:
        raise ValueError(f"max_seq_length={args.max_seq_length} exceeds the model's max_position_embeddings={max_len}")
    collator = (transformers.DataCollatorWithPadding(tokenizer) if args.task == "sequence"
                else transformers.DataCollatorForTokenClassification(tokenizer))
    return tokenizer, model, collator


def _trainer(args: FinetuneArgs, model, tokenizer, collator, train: list[dict], validation: list[dict],
             work_dir: Path):
    import transformers

    steps = math.ceil(math.ceil(len(train) / args.batch_size) * args.epochs)
    training_args = transformers.TrainingArguments(
        output_dir=str(work_dir), num_train_epochs=args.epochs, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=args.learning_rate,
        weight_decay=args.weight_decay, warmup_steps=int(args.warmup_fraction * steps), lr_scheduler_type="linear",
        seed=args.seed, logging_steps=args.logging_steps, save_strategy="no", report_to="none",
        use_cpu=args.device == "cpu", disable_tqdm=True)
    return transformers.Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=validation or None,
                                data_collator=collator, processing_class=tokenizer, compute_metrics=_accuracy)


def _evaluation(trainer) -> dict:
    out = trainer.evaluate()
    return {"loss": out["eval_loss"], "accuracy": out["eval_accuracy"]}


def _encode_files(args: FinetuneArgs, tokenizer, labels: list[str], train_rows: list[dict],
                  validation_rows: list[dict]) -> tuple[list[dict], list[dict], int]:
    label2id = {name: i for i, name in enumerate(labels)}
    encode = encode_sequence_examples if args.task == "sequence" else encode_token_examples
    train, truncated = encode(train_rows, tokenizer, args, label2id, args.train_file)
    validation, truncated_validation = (encode(validation_rows, tokenizer, args, label2id, args.validation_file)
                                        if validation_rows else ([], 0))
    return train, validation, truncated + truncated_validation


def finetune(args: FinetuneArgs) -> dict:
    """Fine-tune ``args.model`` on ``args.train_file``; write the model, tokenizer and metrics JSON to ``args.out``
    (atomically: a temporary directory beside it, renamed at the end). Returns the metrics: the training loss logged
    every ``logging_steps`` steps and, with a validation file, loss and accuracy before and after training next to
    the majority-class accuracy."""
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: already exists and is not an empty directory; choose another --out")
    train_rows = read_records(args.train_file)
    validation_rows = read_records(args.validation_file) if args.validation_file else []
    where = f"{args.train_file}: column {args.label_column!r}"
    tag_values = [t for i, row in enumerate(train_rows, 1)
                  for t in ([_column(row, args.label_column, f"{where}, example {i}")] if args.task == "sequence"
                            else _words(_column(row, args.label_column, f"{where}, example {i}")))]
    labels = label_names(tag_values)
    if len(labels) < 2:
        raise ValueError(f"{where}: only one distinct label {labels}; a classifier needs at least two")
    tokenizer, model, collator = _load(args, labels)
    train, validation, truncated = _encode_files(args, tokenizer, labels, train_rows, validation_rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        trainer = _trainer(args, model, tokenizer, collator, train, validation, work)
        before = _evaluation(trainer) if validation else None
        result = trainer.train()
        metrics = {
            "task": args.task, "model": str(args.model), "labels": labels, "train_examples": len(train),
            "validation_examples": len(validation), "truncated_examples": truncated,
            "steps": result.global_step, "train_loss": result.training_loss,
            "train_loss_log": [{"step": e["step"], "loss": e["loss"]} for e in trainer.state.log_history
                               if "loss" in e],
            "before": before, "after": _evaluation(trainer) if validation else None,
            "majority_accuracy": majority_accuracy(validation) if validation else None,
            "args": asdict(args),
        }
        trainer.save_model(str(work))
        (work / METRICS_NAME).write_text(json.dumps(metrics, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above); rename cannot replace a directory
        apply_umask(work)  # mkdtemp's 0700 and safetensors' 0600 otherwise
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return metrics


def _parse_args(argv: list[str] | None) -> FinetuneArgs:
    parser = argparse.ArgumentParser(prog="bert-ds-finetune", description="Fine-tune an exported BERT with "
                                     "transformers' Trainer for sequence or token classification.")
    parser.add_argument("--model", required=True, help="export directory (bert-ds-convert-checkpoint --out)")
    parser.add_argument("--task", choices=TASKS, default="sequence",
                        help="sequence: a label per sentence or sentence pair; token: a tag per word "
                             "(default: sequence)")
    parser.add_argument("--train", required=True, dest="train_file", help="training examples, .csv or .jsonl")
    parser.add_argument("--validation", dest="validation_file", default=None,
                        help="held-out examples in the same format: loss and accuracy before and after training")
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    parser.add_argument("--text-column", default=None, help="sequence: the text (default: text); token: the words, "
                        "a JSON list or a space-separated string (default: tokens)")
    parser.add_argument("--text-pair-column", default=None, help="sequence: the second text of a pair (default: none)")
    parser.add_argument("--label-column", default=None,
                        help="sequence: the label (default: label); token: the tags, one per word (default: tags)")
    parser.add_argument("--max-seq-length", type=int, default=128, help="WordPieces per example, [CLS]/[SEP] "
                        "included; longer ones are truncated and counted (default: 128)")
    parser.add_argument("--epochs", type=float, default=3.0, help="passes over the training file (default: 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per step (default: 32)")
    parser.add_argument("--learning-rate", type=float, default=5e-5, help="peak Adam lr, linear decay (default: 5e-5)")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default: 0.01)")
    parser.add_argument("--warmup-fraction", type=float, default=0.1,
                        help="fraction of the steps spent warming the lr up (default: 0.1)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the head's init and the shuffling (default: 42)")
    parser.add_argument("--device", choices=("cpu",), default=None, help="cpu: never use a GPU (default: a GPU if any)")
    parser.add_argument("--logging-steps", type=int, default=10, help="log the training loss every N steps "
                        "(default: 10)")
    ns = parser.parse_args(argv)
    try:
        return FinetuneArgs(**vars(ns))
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    """``bert-ds-finetune`` / ``tools/finetune.py``: exit 0 after writing the model, 2 for bad input."""
    args = _parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.device == "cpu" or not torch.cuda.is_available():
        # accelerate (under Trainer) imports deepspeed when it is installed, which then warns that it "was unable to
        # detect" a GPU; name the CPU accelerator it would pick anyway.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        metrics = finetune(args)
    except (OSError, ValueError) as exc:
        print(f"bert-ds-finetune: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {metrics['steps']} steps, mean training loss {metrics['train_loss']:.4f}")
    if metrics["after"] is not None:
        print(f"validation: loss {metrics['before']['loss']:.4f} -> {metrics['after']['loss']:.4f}, accuracy "
              f"{metrics['before']['accuracy']:.4f} -> {metrics['after']['accuracy']:.4f} (always answering the most "
              f"frequent label: {metrics['majority_accuracy']:.4f})")
    return 0

