"""The GLUE suite as the BERT paper reports it (Table 1), with the protocol that makes fine-tuning scores
reproducible: every task found in a GLUE data directory is fine-tuned with N seeds (default 5) and reported as the
median with its min-max spread (single runs of BERT on the small GLUE sets vary by several points: NVIDIA
DeepLearningExamples#417, ModernBERT#225); optionally a learning-rate grid per task (the paper's 5e-5, 4e-5, 3e-5,
2e-5: the rate whose median dev score is best is kept) and MNLI transfer (RTE, MRPC and STS-B start from the MNLI
fine-tune's encoder, as NeoBERT and RoBERTa do; the classifier is initialised anew).

Scores are on dev (GLUE's test labels are private): MNLI-m/mm and QNLI, SST-2, RTE accuracy, QQP and MRPC F1, CoLA
Matthews correlation, STS-B Spearman, times 100. The average is over the paper's nine columns; WNLI is run when
present but left out of it, as the paper does. Writes ``glue_results.md`` and ``glue_results.json`` to ``--out``;
each run's own ``finetune_metrics.json`` stays under ``runs/<task>/lr<lr>/seed<k>/``.
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

from bert_ds.downstream.finetune import METRICS_NAME, FinetuneArgs, finetune
from bert_ds.downstream.tasks import GLUE_TASKS

__all__ = ["COLUMNS", "TRANSFER_TASKS", "SuiteArgs", "find_tasks", "run_suite", "markdown_table", "main"]

log = logging.getLogger(__name__)

# The paper's Table 1 columns: (heading, task, evaluation split, metric).
COLUMNS = (("MNLI-m", "mnli", "dev_matched", "accuracy"), ("MNLI-mm", "mnli", "dev_mismatched", "accuracy"),
           ("QQP", "qqp", "dev", "f1"), ("QNLI", "qnli", "dev", "accuracy"), ("SST-2", "sst2", "dev", "accuracy"),
           ("CoLA", "cola", "dev", "mcc"), ("STS-B", "stsb", "dev", "spearman"), ("MRPC", "mrpc", "dev", "f1"),
           ("RTE", "rte", "dev", "accuracy"))
EXTRA_COLUMNS = (("WNLI", "wnli", "dev", "accuracy"),)  # run, shown, not averaged (paper Table 1 note)
TRANSFER_TASKS = ("rte", "mrpc", "stsb")
ORDER = ("mnli", "qqp", "qnli", "sst2", "cola", "stsb", "mrpc", "rte", "wnli")  # MNLI first: transfer needs it
RESULTS_NAME = "glue_results"


@dataclass
class SuiteArgs:
    model: str
    data_dir: str
    out: str
    seeds: int = 5
    learning_rate: float = 2e-5
    lr_grid: tuple[float, ...] = ()
    mnli_transfer: bool = False
    tasks: tuple[str, ...] = ()
    """Only these tasks (default: every task with a train.tsv in data_dir)."""
    epochs: float = 3.0
    batch_size: int = 32
    max_seq_length: int = 128
    device: str = "auto"
    bf16: bool = False
    gradient_accumulation_steps: int = 1
    first_seed: int = 1
    keep_models: bool = False
    """Keep every fine-tuned model's weights (default: only MNLI's when transfer needs them; a BERT-base grid over
    8 tasks x 5 seeds x 4 rates would otherwise hold ~70 GB)."""

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {self.seeds}")
        unknown = [t for t in self.tasks if t not in GLUE_TASKS]
        if unknown:
            raise ValueError(f"tasks {unknown} are not GLUE tasks; choose from {list(GLUE_TASKS)}")
        if any(not lr > 0 for lr in (*self.lr_grid, self.learning_rate)):
            raise ValueError(f"learning rates must be > 0, got {self.lr_grid or self.learning_rate}")


def find_tasks(data_dir: str | Path, only: tuple[str, ...] = ()) -> list[str]:
    """GLUE tasks whose directory under ``data_dir`` holds a training file, in the suite's order."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory")
    found = [t for t in ORDER if (root / GLUE_TASKS[t].glue_dir / GLUE_TASKS[t].splits["train"]).is_file()]
    if only:
        missing = [t for t in only if t not in found]
        if missing:
            raise ValueError(f"{root}: no training file for {missing} (found: {found})")
        found = [t for t in found if t in only]
    if not found:
        raise ValueError(f"{root}: no GLUE task directory with a train.tsv (expected e.g. {root / 'CoLA'})")
    return found


def _run(args: SuiteArgs, task: str, lr: float, seed: int, start_model: str) -> dict:
    out = Path(args.out) / "runs" / task / f"lr{lr:g}" / f"seed{seed}"
    metrics_file = out / METRICS_NAME
    if metrics_file.is_file():  # a finished run of an interrupted suite is not repeated
        return json.loads(metrics_file.read_text())
    metrics = finetune(FinetuneArgs(
        model=start_model, out=str(out), task=task, data_dir=args.data_dir, epochs=args.epochs,
        batch_size=args.batch_size, max_seq_length=args.max_seq_length, learning_rate=lr, seed=seed,
        device=args.device, bf16=args.bf16, gradient_accumulation_steps=args.gradient_accumulation_steps))
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
        raise ValueError(f"{args.data_dir}: MNLI transfer needs the MNLI task directory")
    grid = args.lr_grid or (args.learning_rate,)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    columns = {c[1]: [] for c in COLUMNS + EXTRA_COLUMNS}
    for column in COLUMNS + EXTRA_COLUMNS:
        columns[column[1]].append(column)
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
        for heading, _, split, metric in columns[task]:
            values = [_score(per_lr[best_lr][s], split, metric) for s in seeds]
            scores[heading] = {"median": statistics.median(values), "min": min(values), "max": max(values),
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
    for heading, task, _, _ in COLUMNS + EXTRA_COLUMNS:
        if task not in table["tasks"]:
            continue
        column = table["tasks"][task]["columns"][heading]
        metric = {"accuracy": "acc", "f1": "F1", "mcc": "MCC", "spearman": "Spearman"}[column["metric"]]
        headings.append(f"{heading} ({metric})" + (" *" if task == "wnli" else ""))
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


def _parse(argv: list[str] | None) -> SuiteArgs:
    parser = argparse.ArgumentParser(prog="bert-ds-glue", description="Fine-tune a BERT directory on every GLUE task "
                                     "of a data directory with several seeds; median and spread per task and the "
                                     "GLUE average, as Markdown and JSON (BERT paper Table 1 layout).")
    parser.add_argument("--model", required=True, help="bert_ds export or Hugging Face BERT directory")
    parser.add_argument("--data-dir", required=True, help="GLUE data directory (CoLA/, SST-2/, MRPC/, ...)")
    parser.add_argument("--out", required=True, help="output directory (results and per-run metrics)")
    parser.add_argument("--seeds", type=int, default=5, help="fine-tuning seeds per task (default: 5)")
    parser.add_argument("--learning-rate", type=float, default=2e-5, help="lr without a grid (default: 2e-5)")
    parser.add_argument("--lr-grid", default="", help="comma-separated rates, e.g. 5e-5,4e-5,3e-5,2e-5: the best "
                        "median dev score per task is kept")
    parser.add_argument("--mnli-transfer", action="store_true", help="start RTE, MRPC and STS-B from the MNLI "
                        "fine-tune of the same seed")
    parser.add_argument("--tasks", default="", help="comma-separated subset, e.g. cola,sst2 (default: all found)")
    parser.add_argument("--epochs", type=float, default=3.0, help="epochs per fine-tune (default: 3)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch per device (default: 32)")
    parser.add_argument("--max-seq-length", type=int, default=128, help="default: 128")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1, help="default: 1")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    parser.add_argument("--first-seed", type=int, default=1, help="seeds are first-seed .. first-seed+N-1")
    parser.add_argument("--keep-models", action="store_true", help="keep every run's weights (default: only MNLI's "
                        "under --mnli-transfer)")
    ns = parser.parse_args(argv)
    try:
        grid = tuple(float(x) for x in ns.lr_grid.split(",") if x.strip())
    except ValueError:
        parser.error(f"--lr-grid {ns.lr_grid!r}: expected comma-separated numbers")
    try:
        return SuiteArgs(model=ns.model, data_dir=ns.data_dir, out=ns.out, seeds=ns.seeds,
                         learning_rate=ns.learning_rate, lr_grid=grid, mnli_transfer=ns.mnli_transfer,
                         tasks=tuple(t.strip() for t in ns.tasks.split(",") if t.strip()), epochs=ns.epochs,
                         batch_size=ns.batch_size, max_seq_length=ns.max_seq_length, device=ns.device, bf16=ns.bf16,
                         gradient_accumulation_steps=ns.gradient_accumulation_steps, first_seed=ns.first_seed,
                         keep_models=ns.keep_models)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    """``bert-ds-glue`` / ``tools/glue.py``: exit 0 with the table printed, 2 for bad input."""
    args = _parse(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.device == "cpu" or not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # see finetune.main
    try:
        table = run_suite(args)
    except (OSError, ValueError) as exc:
        print(f"bert-ds-glue: error: {exc}", file=sys.stderr)
        return 2
    print(markdown_table(table), end="")
    print(f"wrote {Path(args.out) / (RESULTS_NAME + '.md')} and .json")
    return 0
