"""``bert-ds-glue`` on a small GLUE-layout directory built from real text (MNLI, SST-2, STS-B, RTE): 2 seeds, a
2-rate grid, MNLI transfer for RTE and STS-B; the table's medians, spreads, chosen rates and average are those of
the per-run metrics it leaves behind. The model is a random tiny export (the suite's bookkeeping is under test, not
the scores)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bert_ds.downstream.suite import find_tasks, main
from tests.helpers.downstream_data import write_mnli, write_rte, write_sst2, write_stsb
from tests.helpers.hf_export import random_tiny_export


@pytest.fixture(scope="module")
def tiny_export(tokenizer_dir, tmp_path_factory) -> Path:
    return random_tiny_export(tokenizer_dir, tmp_path_factory.mktemp("suite_export"), seed=0)


@pytest.mark.slow  # in-process CPU fine-tuning, minutes: the whole suite only
def test_glue_suite_table(tiny_export, corpus_documents, tmp_path, capsys):
    glue = tmp_path / "glue"
    write_mnli(corpus_documents, glue / "MNLI", n_train=48, n_dev=24)
    write_sst2(corpus_documents, glue / "SST-2", n_train=48, n_dev=24)
    write_stsb(corpus_documents, glue / "STS-B", n_train=48, n_dev=24)
    write_rte(corpus_documents, glue / "RTE", n_train=48, n_dev=24)
    assert find_tasks(glue) == ["mnli", "sst2", "stsb", "rte"]
    out = tmp_path / "results"
    argv = ["--model", str(tiny_export), "--data-dir", str(glue), "--out", str(out), "--seeds", "2",
            "--lr-grid", "1e-3,1e-5", "--mnli-transfer", "--epochs", "1", "--batch-size", "16",
            "--max-seq-length", "48", "--device", "cpu"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    print(printed)
    table = json.loads((out / "glue_results.json").read_text())
    assert (out / "glue_results.md").read_text() in printed
    assert ("| Model | MNLI-m (acc) | MNLI-mm (acc) | SST-2 (acc) | STS-B (Spearman) | STS-B (Pearson) | RTE (acc) | "
            "Average |") in printed
    medians = []
    for task, headings in (("mnli", (("MNLI-m", "dev_matched", "accuracy"), ("MNLI-mm", "dev_mismatched", "accuracy"))),
                           ("sst2", (("SST-2", "dev", "accuracy"),)),
                           ("stsb", (("STS-B", "dev", "spearman"), ("STS-B pearson", "dev", "pearson"))),
                           ("rte", (("RTE", "dev", "accuracy"),))):
        result = table["tasks"][task]
        assert result["seeds"] == [1, 2] and result["transfer_from_mnli"] == (task in ("stsb", "rte"))
        # The chosen rate has the best median on the first column.
        assert result["lr_medians"][f"{result['learning_rate']:g}"] == max(result["lr_medians"].values())
        for heading, split, metric in headings:
            runs = []
            for seed in (1, 2):
                run = out / "runs" / task / f"lr{result['learning_rate']:g}" / f"seed{seed}"
                metrics = json.loads((run / "finetune_metrics.json").read_text())
                runs.append(100 * metrics["eval"][split][metric])
                if task in ("stsb", "rte"):  # started from the MNLI fine-tune of the same seed
                    mnli_lr = table["tasks"]["mnli"]["learning_rate"]
                    assert metrics["model"] == str(out / "runs" / "mnli" / f"lr{mnli_lr:g}" / f"seed{seed}")
                if task == "stsb":
                    assert metrics["num_labels"] == 1 and metrics["problem_type"] == "regression"
            column = result["columns"][heading]
            assert column["median"] == pytest.approx(statistics.median(runs))
            assert (column["min"], column["max"]) == pytest.approx((min(runs), max(runs)))
            if heading != "STS-B pearson":  # shown, not averaged
                medians.append(column["median"])
    assert table["average"] == pytest.approx(statistics.fmean(medians))
    assert not table["complete"] and "over 5 of 9 columns" in printed
    # Weights are dropped after scoring except MNLI's, which the transfer started from.
    assert not list((out / "runs" / "sst2").rglob("*.safetensors"))
    assert list((out / "runs" / "mnli").rglob("model.safetensors"))
    # The same suite again reuses every finished run (same model, data and settings by content): nothing reruns.
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("finetune_metrics.json")}
    assert main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("finetune_metrics.json")} == before
    assert json.loads((out / "glue_results.json").read_text()) == table


def test_markdown_table_shows_glue_second_figures():
    from bert_ds.downstream.suite import SHOWN, column_key, markdown_table

    tasks = {}
    for column in SHOWN:
        heading, task, split, metric = column
        entry = tasks.setdefault(task, {"learning_rate": 2e-5, "transfer_from_mnli": False, "columns": {}})
        entry["columns"][column_key(column)] = {"median": 50.0, "min": 40.0, "max": 60.0, "metric": metric}
    table = {"model": "m", "tasks": tasks, "average": 50.0, "complete": True, "seeds": 3, "average_over": []}
    header = markdown_table(table).splitlines()[0]
    assert header == ("| Model | MNLI-m (acc) | MNLI-mm (acc) | QQP (F1) | QQP (acc) | QNLI (acc) | SST-2 (acc) | "
                      "CoLA (MCC) | STS-B (Spearman) | STS-B (Pearson) | MRPC (F1) | MRPC (acc) | RTE (acc) | "
                      "WNLI (acc) * | Average |")


def test_missing_task_is_refused(tmp_path, capsys):
    (tmp_path / "SST-2").mkdir()
    assert main(["--model", str(tmp_path), "--data-dir", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--tasks", "cola"]) == 2
    assert "no training file for ['cola']" in capsys.readouterr().err
