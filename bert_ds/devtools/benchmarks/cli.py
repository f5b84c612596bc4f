"""One benchmark command: every performance figure beside its baseline, measured in the same run.

    bert-ds-benchmark                               # all sections -> benchmark.json, table, BENCHMARKS.md
    bert-ds-benchmark --only step flops             # some sections
    bert-ds-benchmark --quick --markdown ''         # a small smoke run (what the test suite runs)
    (also python tools/benchmark.py ...)

Sections: ``step`` (a BERT-base training step, bert_ds vs transformers, seq 128 and 512 on real shard batches),
``flops`` (the analytic count vs FlopCounterMode), ``zero`` (ZeRO-1/2 optimizer state per rank on 1, 2, 4 real
DeepSpeed ranks), ``create`` (:mod:`bert_ds.devtools.benchmarks.create`, also ``tools/bench_create.py``), ``loader``
(:mod:`bert_ds.devtools.benchmarks.loader`, also ``tools/bench_loader.py``), ``tta`` (time to a held-out masked-LM
accuracy on the demo setting, bert_ds vs a plain transformers + PyTorch loop). The real-text shard sets are the demo's
(``make demo``'s data): built under ``--work`` when missing, reused after. Like the demo, it needs the source checkout
the package is installed from (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, option
from bert_ds.devtools.benchmarks.report import machine, render
from bert_ds.errors import BadInput

__all__ = ["SECTIONS", "main", "run"]

REPO = Path(__file__).resolve().parents[3]
SECTIONS = ("step", "flops", "zero", "create", "loader", "tta")


def _data(args) -> dict[str, Path]:
    if args.shards128 and args.shards512:
        return {"train128": args.shards128, "train512": args.shards512}
    from bert_ds.devtools.demo import DemoSettings, prepare_data

    return prepare_data(args.work, DemoSettings())


def _section_json(module: str, extra: list[str]) -> object:
    """Run ``bert_ds.devtools.benchmarks.<module>`` in its own interpreter (a clean process for its timings and peak
    memory) and return the JSON it writes."""
    with tempfile.TemporaryDirectory(prefix="bert_ds_bench_") as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, "-m", f"bert_ds.devtools.benchmarks.{module}", *extra, "--json", str(out)],
                       check=True, cwd=REPO)
        return json.loads(out.read_text())


def run(args) -> dict:
    from bert_ds.devtools.benchmarks.flops import flop_check
    from bert_ds.devtools.benchmarks.step import step_benchmark
    from bert_ds.devtools.benchmarks.zero_state import zero_state_bytes

    results: dict = {"machine": machine()}
    need_data = set(args.only) & {"step", "flops", "loader", "tta"}
    data = _data(args) if need_data else {}
    preset = "tiny" if args.quick else "base"
    if "step" in args.only:
        for seq, batch, repeats in ((128, 8, args.repeats), (512, 8, args.repeats)):
            print(f"==> step, seq {seq}: bert_ds vs transformers, BERT-{preset}, batch {batch}, {repeats} repeats",
                  flush=True)
            results[f"step{seq}"] = step_benchmark(data[f"train{seq}"], preset=preset, batch_size=batch,
                                                   repeats=repeats)
    if "flops" in args.only:
        print("==> flops: analytic count vs FlopCounterMode", flush=True)
        results["flops"] = [flop_check(data[f"train{seq}"], preset=preset) for seq in (128, 512)]
    if "zero" in args.only:
        print("==> zero: optimizer state per rank on real DeepSpeed ranks", flush=True)
        results["zero"] = zero_state_bytes(preset, world_sizes=(1, 2) if args.quick else (1, 2, 4))
    if "create" in args.only:
        print("==> create: bert_ds.devtools.benchmarks.create (tools/bench_create.py)", flush=True)
        copies = ["--copies", "1", "2", "--baseline-copies", "1"] if args.quick else []
        results["create"] = _section_json("create", copies)
    if "loader" in args.only:
        print("==> loader: bert_ds.devtools.benchmarks.loader (tools/bench_loader.py)", flush=True)
        # --mix: 3 weighted synthetic sources vs one, at global batch = micro batch (a source draw per micro batch)
        # and 1024, alternated rounds in the same process (in process: workers=0, the loader's own cost)
        mix = (["--samples", "3000", "--samples-per-shard", "500", "--repeats", "2"] if args.quick
               else ["--repeats", "15"])
        results["loader"] = _section_json("loader", ["--data-dir", str(data["train128"]), "--batches",
                                                     "20" if args.quick else "300", "--micro-batch-size", "32",
                                                     "--mix", "--mix-workers", "0",
                                                     "--mix-global-batch-size", "32", "1024", *mix])
    if "tta" in args.only:
        from bert_ds.devtools.benchmarks.time_to_accuracy import time_to_accuracy

        print("==> tta: time to held-out masked-LM accuracy, bert_ds vs a plain transformers loop", flush=True)
        results["tta"] = time_to_accuracy(data, args.work / "tta", quick=args.quick)
    return results


def _command_line(prog: str, argv: list[str] | None) -> str:
    """The command as the user typed it, for BENCHMARKS.md: ``python tools/benchmark.py ...`` when run through the
    script, else ``bert-ds-benchmark ...`` (the console script, or a call of :func:`main` from Python)."""
    args = sys.argv[1:] if argv is None else argv
    through_script = argv is None and Path(sys.argv[0]).name == "benchmark.py"
    head = f"python {sys.argv[0]}" if through_script else prog
    return head + "".join(f" {shlex.quote(a)}" for a in args)


@dataclass
class BenchmarkArgs:
    """``bert-ds-benchmark``'s options (:mod:`bert_ds.cli_args`)."""

    only: list[str] = option(default_factory=lambda: list(SECTIONS), choices=SECTIONS, help="sections to run")
    work: Path = Path("bench_run")
    """Data and scratch (bench_run/ in the current directory by default)."""
    shards128: Path | None = None
    """Use this seq-128 shard set instead of the demo data."""
    shards512: Path | None = None
    """Use this seq-512 shard set instead of the demo data."""
    repeats: int = 8
    """Timed rounds per step benchmark."""
    quick: bool = False
    """Tiny model, few repeats: checks the command works."""
    out: Path = Path("benchmark.json")
    """JSON results."""
    markdown: str = "BENCHMARKS.md"
    """Markdown report path ('' for none)."""
    update: bool = False
    """Keep the other sections of an existing --out file: re-measure only --only's."""

    def __post_init__(self) -> None:
        if bool(self.shards128) != bool(self.shards512):
            raise BadInput("--shards128 and --shards512 go together")
        if self.repeats < 1:
            raise BadInput(f"--repeats must be >= 1, got {self.repeats}")
        if self.update and not self.out.is_file():
            raise BadInput(f"--update: {self.out} does not exist (run without --update first)")


PROG = "bert-ds-benchmark"


def cli_parser() -> argparse.ArgumentParser:
    return build_parser(BenchmarkArgs, PROG, __doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                        formatter_class=argparse.RawDescriptionHelpFormatter)


main = alias("benchmark")


def _run(args: BenchmarkArgs, argv: list[str] | None) -> int:
    """``bert-ds-benchmark`` / ``tools/benchmark.py``: exit 0 after writing the JSON (and Markdown), 2 for bad
    arguments."""
    previous = json.loads(args.out.read_text()) if args.update else {}
    command = _command_line(PROG, argv)
    args.work.mkdir(parents=True, exist_ok=True)
    results = {**previous, **run(args)}
    results["commands"] = [*previous.get("commands", []), command]
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    text = render(results, results["commands"])
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
        print(f"wrote {args.markdown} and {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
