"""The GLUE suite as the BERT paper reports it (Table 1), with the protocol that makes fine-tuning scores
reproducible: every task found in a GLUE data directory is fine-tuned with N seeds (default 5) and reported as the
median with its min-max spread (single runs of BERT on the small GLUE sets vary by several points: NVIDIA
DeepLearningExamples#417, ModernBERT#225); optionally a learning-rate grid per task (the paper's 5e-5, 4e-5, 3e-5,
2e-5: the rate whose median dev score is best is kept) and MNLI transfer (RTE, MRPC and STS-B start from the MNLI
fine-tune's encoder, as NeoBERT and RoBERTa do; the classifier is initialised anew).

Scores are on dev (GLUE's test labels are private): MNLI-m/mm and QNLI, SST-2, RTE accuracy, QQP and MRPC F1, CoLA
Matthews correlation, STS-B Spearman, times 100. The average is over the paper's nine columns; WNLI is run when
present but left out of it, as the paper does; QQP and MRPC accuracy and STS-B Pearson, which GLUE reports beside
them, are shown and not averaged. Writes ``glue_results.md`` and ``glue_results.json`` to ``--out``; each run's own
``finetune_metrics.json`` stays under ``runs/<task>/lr<lr>/seed<k>/``. A run found finished there is reused only when
its recorded identity (model and data by content hash, task, every setting: ``finetune.run_identity``) is the one the
suite would run; any other finished run is refused, naming the first field that differs (never overwritten).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from bert_ds import cli_args
from bert_ds.cli import alias
from bert_ds.cli_args import option
from bert_ds.downstream.finetune import DEVICES, METRICS_NAME, FinetuneArgs, finetune, run_identity
from bert_ds.downstream.tasks import GLUE_TASKS
from bert_ds.errors import BadInput

__all__ = ["COLUMNS", "TRANSFER_TASKS", "SuiteArgs", "find_tasks", "run_suite", "markdown_table", "main"]

log = logging.getLogger(__name__)

# The paper's Table 1 columns: (heading, task, evaluation split, metric).
COLUMNS = (("MNLI-m", "mnli", "dev_matched", "accuracy"), ("MNLI-mm", "mnli", "dev_mismatched", "accuracy"),
           ("QQP", "qqp", "dev", "f1"), ("QNLI", "qnli", "dev", "accuracy"), ("SST-2", "sst2", "dev", "accuracy"),
           ("CoLA", "cola", "dev", "mcc"), ("STS-B", "stsb", "dev", "spearman"), ("MRPC", "mrpc", "dev", "f1"),
           ("RTE", "rte", "dev", "accuracy"))
# Shown, not averaged: WNLI (paper Table 1 note), and the second figure GLUE reports for QQP, STS-B and MRPC (F1 and
# accuracy, Pearson and Spearman). Each column's key in the results is its heading, or "heading metric" for these.
EXTRA_COLUMNS = (("QQP", "qqp", "dev", "accuracy"), ("STS-B", "stsb", "dev", "pearson"),
                 ("MRPC", "mrpc", "dev", "accuracy"), ("WNLI", "wnli", "dev", "accuracy"))
_ABBREVIATIONS = {"accuracy": "acc", "f1": "F1", "mcc": "MCC", "spearman": "Spearman", "pearson": "Pearson"}
# Table order: each Table 1 column followed by its task's second figure, then WNLI.
SHOWN = tuple(c for main in COLUMNS for c in (main, *(e for e in EXTRA_COLUMNS if e[1] == main[1]))) + tuple(
    e for e in EXTRA_COLUMNS if e[1] not in {c[1] for c in COLUMNS})
TRANSFER_TASKS = ("rte", "mrpc", "stsb")
ORDER = ("mnli", "qqp", "qnli", "sst2", "cola", "stsb", "mrpc", "rte", "wnli")  # MNLI first: transfer needs it
RESULTS_NAME = "glue_results"


@dataclass
class SuiteArgs:
    """One GLUE suite run; its fields are ``bert-ds-glue``'s options (:mod:`bert_ds.cli_args`)."""

    model: str
    """bert_ds export or Hugging Face BERT directory."""
    data_dir: str
    """GLUE data directory (CoLA/, SST-2/, MRPC/, ...)."""
    out: str
    """Output directory (results and per-run metrics); finished runs there are reused only when model, data and
    settings are the same, any other finished run is refused."""
    seeds: int = 5
    """Fine-tuning seeds per task."""
    learning_rate: float = 2e-5
    """Learning rate without a grid."""
    lr_grid: tuple[float, ...] = ()
    """Comma-separated rates, e.g. 5e-5,4e-5,3e-5,2e-5: the best median dev score per task is kept."""
    mnli_transfer: bool = False
    """Start RTE, MRPC and STS-B from the MNLI fine-tune of the same seed."""
    tasks: tuple[str, ...] = ()
    """Comma-separated subset, e.g. cola,sst2 (default: every task with a train.tsv in --data-dir)."""
    epochs: float = 3.0
    """Epochs per fine-tune."""
    batch_size: int = 32
    """Batch per device."""
    max_seq_length: int | None = None
    """WordPieces per example (default: the task's, 128 for GLUE)."""
    device: str = option("auto", choices=DEVICES, help="auto: a GPU when there is one; cpu; cuda")
    bf16: bool = False
    """bf16 mixed precision."""
    gradient_accumulation_steps: int = 1
    """Batches per optimizer step."""
    first_seed: int = 1
    """Seeds are first-seed .. first-seed+N-1."""
    keep_models: bool = False
    """Keep every run's weights (default: only MNLI's under --mnli-transfer; a BERT-base grid over 8 tasks x 5 seeds
    x 4 rates would otherwise hold ~70 GB)."""

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise BadInput(f"seeds must be >= 1, got {self.seeds}")
        unknown = [t for t in self.tasks if t not in GLUE_TASKS]
        if unknown:
            raise BadInput(f"tasks {unknown} are not GLUE tasks; choose from {list(GLUE_TASKS)}")
        if any(not lr > 0 for lr in (*self.lr_grid, self.learning_rate)):
            raise BadInput(f"learning rates must be > 0, got {self.lr_grid or self.learning_rate}")


def find_tasks(data_dir: str | Path, only: tuple[str, ...] = ()) -> list[str]:
    """GLUE tasks whose directory under ``data_dir`` holds a training file, in the suite's order."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory")
    found = [t for t in ORDER if (root / GLUE_TASKS[t].glue_dir / GLUE_TASKS[t].splits["train"]).is_file()]
    if only:
        missing = [t for t in only if t not in found]
        if missing:
            raise BadInput(f"{root}: no training file for {missing} (found: {found})")
        found = [t for t in found if t in only]
    if not found:
        raise BadInput(f"{root}: no GLUE task directory with a train.tsv (expected e.g. {root / 'CoLA'})")
    return found


def column_key(column: tuple[str, str, str, str]) -> str:
    """A column's key in the results: its heading, or "heading metric" for a task's second figure (QQP accuracy)."""
    heading, task, _, metric = column
    return heading if column == next(c for c in SHOWN if c[1] == task) or task == "mnli" else f"{heading} {metric}"


def _check_reusable(run_dir: Path, metrics: dict, identity: dict) -> None:
    """A finished run is this suite's only when its recorded identity is ``identity``, field for field: else it is
    another model's (or data's, or settings') result, which the suite must neither report under this model's name nor
    overwrite. Refused naming the first field that differs."""
    recorded = metrics.get("identity")
    if recorded is None:
        raise BadInput(f"{run_dir}: a finished run without a recorded identity (written before bert_ds recorded "
                       "one), so nothing tells its model from this one; choose a new --out, or delete it to rerun")
    identity = json.loads(json.dumps(identity))  # as the metrics file holds it (tuples as lists)
    differ = [k for k in identity if recorded.get(k) != identity[k]] + [k for k in recorded if k not in identity]
    if differ:
        key, also = differ[0], f" (also differ: {', '.join(differ[1:])})" if differ[1:] else ""
        raise BadInput(f"{run_dir}: a finished run of another setup: {key} {recorded.get(key)} there, "
                       f"{identity.get(key)} now{also}; choose a new --out, or delete {run_dir} to rerun it")


def _run(args: SuiteArgs, task: str, lr: float, seed: int, start_model: str) -> dict:
    out = Path(args.out) / "runs" / task / f"lr{lr:g}" / f"seed{seed}"
    run_args = FinetuneArgs(
        model=start_model, out=str(out), task=task, data_dir=args.data_dir, epochs=args.epochs,
        batch_size=args.batch_size, max_seq_length=args.max_seq_length, learning_rate=lr, seed=seed,
        device=args.device, bf16=args.bf16, gradient_accumulation_steps=args.gradient_accumulation_steps)
    metrics_file = out / METRICS_NAME
    if metrics_file.is_file():  # a finished run of an interrupted suite is not repeated, if it is this suite's
        metrics = json.loads(metrics_file.read_text())
        _check_reusable(out, metrics, run_identity(run_args))
        log.info("%s: reusing the finished run (same model and data by sha256, same settings)", out)
        return metrics
    metrics = finetune(run_args)
    if not args.keep_models and not (task == "mnli" and args.mnli_transfer):
        for weights in out.glob("*.safetensors"):
            weights.unlink()
    return metrics


def _score(metrics: dict, split: str, metric: str) -> float:
    return 100.0 * metrics["eval"][split][metric]


def run_suite(args: SuiteArgs) -> dict:
    """Fine-tune every task ``seeds`` times (per learning rate of the grid); returns and writes the table."""
    tasks = find_tasks(args.data_dir, args.tasks)
    if args.mnli_transfer and "mnli" not in tasks:
        raise BadInput(f"{args.data_dir}: MNLI transfer needs the MNLI task directory")
    grid = args.lr_grid or (args.learning_rate,)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    columns = {c[1]: [c2 for c2 in SHOWN if c2[1] == c[1]] for c in SHOWN}
    results: dict[str, dict] = {}
    mnli_models: dict[int, str] = {}
    for task in tasks:
        first_split, first_metric = columns[task][0][2], columns[task][0][3]
        per_lr = {}
        for lr in grid:
            runs = {}
            for seed in seeds:
                start = args.model
                if args.mnli_transfer and task in TRANSFER_TASKS:
                    start = mnli_models[seed]
                runs[seed] = _run(args, task, lr, seed, start)
            per_lr[lr] = runs
        # The rate with the best median dev score (the paper picks the best rate on dev; the median over seeds keeps
        # one lucky seed from deciding).
        best_lr = max(grid, key=lambda lr: statistics.median(_score(m, first_split, first_metric)
                                                             for m in per_lr[lr].values()))
        if task == "mnli":
            mnli_models = {seed: str(Path(args.out) / "runs" / "mnli" / f"lr{best_lr:g}" / f"seed{seed}")
                           for seed in seeds}
        scores = {}
        for column in columns[task]:
            _, _, split, metric = column
            values = [_score(per_lr[best_lr][s], split, metric) for s in seeds]
            scores[column_key(column)] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                               "runs": values, "metric": metric, "split": split}
        results[task] = {"learning_rate": best_lr, "seeds": seeds, "columns": scores,
                         "transfer_from_mnli": bool(args.mnli_transfer and task in TRANSFER_TASKS),
                         "lr_medians": {f"{lr:g}": statistics.median(_score(m, first_split, first_metric)
                                                                     for m in per_lr[lr].values()) for lr in grid}}
    averaged = [results[t]["columns"][h]["median"] for h, t, _, _ in COLUMNS if t in results]
    table = {"model": args.model, "data_dir": args.data_dir, "seeds": args.seeds, "lr_grid": list(grid),
             "mnli_transfer": args.mnli_transfer, "epochs": args.epochs, "batch_size": args.batch_size,
             "tasks": results, "average": statistics.fmean(averaged) if averaged else None,
             "average_over": [h for h, t, _, _ in COLUMNS if t in results],
             "complete": all(t in results for _, t, _, _ in COLUMNS)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{RESULTS_NAME}.json").write_text(json.dumps(table, indent=2) + "\n")
    (out / f"{RESULTS_NAME}.md").write_text(markdown_table(table))
    return table


def markdown_table(table: dict) -> str:
    """The paper's Table 1 layout: one row, a column per task (median and min-max over seeds), then the average."""
    headings, cells = [], []
    for shown in SHOWN:
        heading, task = shown[:2]
        if task not in table["tasks"]:
            continue
        column = table["tasks"][task]["columns"][column_key(shown)]
        headings.append(f"{heading} ({_ABBREVIATIONS[column['metric']]})" + (" *" if task == "wnli" else ""))
        cells.append(f"{column['median']:.1f} ({column['min']:.1f}-{column['max']:.1f})")
    average = "n/a" if table["average"] is None else f"{table['average']:.1f}"
    if not table["complete"]:
        average += f" (over {len(table['average_over'])} of 9 columns)"
    lines = [f"| Model | {' | '.join(headings)} | Average |",
             f"|---|{'---|' * len(headings)}---|",
             f"| {Path(table['model']).name} | {' | '.join(cells)} | {average} |", "",
             f"Dev sets; median (min-max) over {table['seeds']} fine-tuning seeds, x100. Learning rate per task: " +
             ", ".join(f"{t} {r['learning_rate']:g}" + (" (from MNLI)" if r["transfer_from_mnli"] else "")
                       for t, r in table["tasks"].items()) + "."]
    if "wnli" in table["tasks"]:
        lines.append("* WNLI is not in the average (as in the BERT paper).")
    return "\n".join(lines) + "\n"


def cli_parser() -> argparse.ArgumentParser:
    """The CLI generated from SuiteArgs (its defaults, its field docs)."""
    return cli_args.build_parser(SuiteArgs, "bert-ds-glue", "Fine-tune a BERT directory on every GLUE task of a data "
                                 "directory with several seeds; median and spread per task and the GLUE average, as "
                                 "Markdown and JSON (BERT paper Table 1 layout).")


main = alias("glue")


def _suite_and_table(args: SuiteArgs) -> int:
    """``bert-ds-glue`` / ``tools/glue.py``: exit 0 with the table printed, 2 for bad input."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.device == "cpu" or not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # see finetune._run
    table = run_suite(args)
    print(markdown_table(table), end="")
    print(f"wrote {Path(args.out) / (RESULTS_NAME + '.md')} and .json")
    return 0
