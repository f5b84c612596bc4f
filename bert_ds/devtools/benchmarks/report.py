"""The printed table and BENCHMARKS.md from the results ``tools/benchmark.py`` collects (one dict per section)."""

from __future__ import annotations

import os
import platform

import torch

__all__ = ["machine", "render"]


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "load_average_1m": os.getloadavg()[0]}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


def _step_rows(results: dict) -> list[str]:
    rows = ["| model | seq | batch | fill (real tokens) | bert_ds min / median ms | transformers min / median ms | "
            "speed-up (median of pairs) | best / best | target |",
            "|---|---|---|---|---|---|---|---|---|"]
    for key, target in (("step128", 1.3), ("step512", 1.6)):
        r = results.get(key)
        if not r:
            continue
        s = r["speedup"]
        met = "met" if s["median_pair"] >= target else "NOT met"
        rows.append(f"| BERT-{r['preset']} | {r['seq_len']} | {r['batch_size']} | {r['fill']:.0%} | "
                    f"{_ms(r['bert_ds']['min_s'])} / "
                    f"{_ms(r['bert_ds']['median_s'])} | {_ms(r['transformers']['min_s'])} / "
                    f"{_ms(r['transformers']['median_s'])} | **{s['median_pair']:.2f}x** "
                    f"({s['min_pair']:.2f}-{s['max_pair']:.2f}) | {s['best']:.2f}x | >= {target}x {met} |")
    return rows


def _flop_rows(results: dict) -> list[str]:
    rows = ["| model | seq | lengths | full length: counted / analytic | "
            "real lengths: counted / analytic at real lengths | "
            "real batch work vs padded count |", "|---|---|---|---|---|---|"]
    for r in results.get("flops", []):
        f, g = r["full_length"], r["real_lengths"]
        rows.append(f"| BERT-{r['preset']} | {r['seq_len']} | {r['lengths']} | "
                    f"{f['counted'] / 1e9:,.1f} / {f['analytic'] / 1e9:,.1f} GFLOP "
                    f"= {f['ratio']:.4f} | {g['counted'] / 1e9:,.1f} / {g['analytic_at_real_lengths'] / 1e9:,.1f} "
                    f"GFLOP = {g['ratio']:.4f} | {g['work_vs_padded']:.3f} |")
    return rows


def _zero_rows(results: dict) -> list[str]:
    rows = ["| ZeRO stage | ranks | params | optimizer state per rank (MiB) | largest rank / (1-rank total / N) |",
            "|---|---|---|---|---|"]
    for r in results.get("zero", []):
        per = ", ".join(f"{b / 2**20:,.1f}" for b in r["per_rank_bytes"])
        ideal = "" if r["max_rank_vs_ideal"] is None else f"{r['max_rank_vs_ideal']:.4f}"
        rows.append(f"| {r['stage']} | {r['world_size']} | {r['params']:,} | {per} | {ideal} |")
    return rows


def _create_rows(results: dict) -> list[str]:
    c = results.get("create")
    if not c:
        return []
    rows = ["| run | pairs | CPU s | pairs per CPU-second | peak RSS MiB |", "|---|---|---|---|---|"]
    for name, r in c["rows"].items():
        rows.append(f"| {name} | {r['samples']:,} | {r['cpu_s']:.1f} | {r['pairs_per_cpu_s']:,.0f} | "
                    f"{r['peak_rss_mb']:,.0f} |")
    rows.append(f"\nSpeed-up over the Google-style baseline: **{c['speedup_dupe5']:.1f}x** at dupe 5, "
                f"**{c['speedup_dupe1']:.1f}x** at dupe 1.")
    return rows


def _loader_rows(results: dict) -> list[str]:
    rows = ["| what | samples | seconds | samples/s | per worker |", "|---|---|---|---|---|"]
    for r in results.get("loader", []):
        rows.append(f"| {r['what']} | {r['samples']:,} | {r['seconds']:.2f} | {r['samples_per_s']:,.0f} | "
                    f"{r['per_worker']:,.0f} |")
    if len(rows) == 2:
        return []
    for r in results.get("loader", []):
        if "mix_cost" in r:
            rows.append(f"\nA mix of 3 weighted sources ({':'.join(f'{w:g}' for w in r['weights'])}) vs one source, "
                        f"num_workers={r['num_workers']}, global batch {r['global_batch_size']} (micro "
                        f"{r['micro_batch_size']}): the mix costs **{100 * r['mix_cost']:.1f}%** of throughput "
                        f"(median of {r['rounds']} alternated rounds; best / best {100 * r['mix_cost_best']:.1f}%).")
    return rows


def _tta_rows(results: dict) -> list[str]:
    t = results.get("tta")
    if not t:
        return []
    rows = ["| trainer | target reached at step | wall s to target | final held-out MLM accuracy | settings |",
            "|---|---|---|---|---|"]
    for name in ("bert_ds", "transformers"):
        r = t[name]
        reached = "not reached" if r["step_at_target"] is None else str(r["step_at_target"])
        wall = "" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:,.0f}"
        rows.append(f"| {name} | {reached} | {wall} | {r['final_accuracy']:.1%} | {r['settings']} |")
    if t.get("ratio") is not None:
        rows.append(f"\nTime to {t['target']:.0%} held-out masked-LM accuracy: bert_ds **{t['ratio']:.2f}x** faster.")
    return rows


SECTIONS = (
    ("Training step: bert_ds vs transformers BertForPreTraining", "step", _step_rows,
     "fp32, dropout on, forward + backward, on real shard batches (their lengths and masked "
     "positions); alternating steps on the same batch, one warm-up round. Speed-up = median over repeats of "
     "transformers' time / bert_ds' time on the same batch."),
    ("Analytic FLOPs vs torch.utils.flop_counter.FlopCounterMode", "flops", _flop_rows,
     "Training step (forward + backward) of bert_ds. Full-length batch: the count behind "
     "perf/tflops and MFU. Real batch: the unpadded model's work against the analytic count at each sequence's "
     "real length, and against the padded count (what unpadding saves)."),
    ("ZeRO optimizer state per rank", "zero", _zero_rows,
     "Real DeepSpeed ranks (gloo, CPU) through bert_ds's engine with the ZeRO-aware LAMB: fp32 master partition "
     "+ exp_avg + exp_avg_sq after one step. Expected: the 1-rank total / N."),
    ("Shard creation", "create", _create_rows,
     "tools/bench_create.py: seq 128, one core per run (child processes), against a Google-style "
     "create_pretraining_data.py baseline run in the same process tree."),
    ("Loader", "loader", _loader_rows,
     "tools/bench_loader.py on the seq-128 shard set: the training loader against reading the raw tar bytes; then "
     "3 weighted synthetic sources against one synthetic source of as many samples, both loaders read in alternated "
     "rounds in the same process."),
    ("Time to accuracy", "tta", _tta_rows, ""),
)


def render(results: dict, commands: list[str]) -> str:
    """Markdown: what ran (commands, machine), then one table per section present in ``results``."""
    m = results["machine"]
    ran = "`" + commands[0] + "`" + "".join(f", then `{c}` (those sections re-measured)" for c in commands[1:])
    lines = ["# Benchmarks", "",
             f"Produced by {ran} on {m['cpus']} CPU cores ({m['cpu']}), torch {m['torch']} with "
             f"{m['torch_threads']} threads, load average {m['load_average_1m']:.1f} at the start. "
             "Every figure is measured in the same run as its baseline. Numbers depend on the machine and its load; "
             "the ratios are what carries over.", ""]
    for title, key, rows_of, note in SECTIONS:
        if key == "step":
            present = any(k in results for k in ("step128", "step512"))
        else:
            present = key in results
        if not present:
            continue
        rows = rows_of(results)
        if not rows:
            continue
        lines += [f"## {title}", ""]
        if note:
            lines += [note, ""]
        lines += rows + [""]
    return "\n".join(lines)
