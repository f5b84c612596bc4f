"""The front door: ``bert-ds <command> [args]`` runs every bert_ds program; ``bert-ds --help`` lists them. Each
``bert-ds-<command>`` console script (and ``tools/<command>.py``) stays an alias of the same ``main``, so a command
behaves the same whichever name starts it. :data:`COMMANDS` is the one table of commands: ``setup.cfg`` installs one
alias per entry, checked by ``tests/test_console_scripts.py``, and the flags of every command are frozen in
``tests/assets/cli_surface.json`` so none vanishes unnoticed.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from bert_ds.errors import error_lines
from bert_ds.exit_codes import ExitCode

__all__ = ["COMMANDS", "main", "usage"]

COMMANDS: dict[str, tuple[str, str]] = {
    "train-tokenizer": ("bert_ds.data.tokenizer", "train a WordPiece vocabulary on text"),
    "create-shards": ("bert_ds.data.create", "text -> NSP pairs, static masking -> WebDataset shards + index.json"),
    "verify-shards": ("bert_ds.data.reader", "check a shard set against its index.json"),
    "pretrain": ("bert_ds.runtime.pretrain", "pre-train (one process; ranks via deepspeed, srun or mpirun)"),
    "deepspeed": ("bert_ds.lifecycle.supervise", "DeepSpeed's runner, supervised: pre-emption exits 75, no orphans"),
    "mpirun": ("bert_ds.lifecycle.supervise_mpirun", "Open MPI's mpirun, supervised: pre-emption exits 75, no orphans"),
    "make-hostfile": ("bert_ds.lifecycle.hostfile",
                      "write DeepSpeed's hostfile from a Slurm allocation or a host list"),
    "evaluate": ("bert_ds.evaluate", "held-out masked-LM / NSP accuracy of a checkpoint"),
    "convert-checkpoint": ("bert_ds.export.convert", "export a checkpoint to Hugging Face transformers, verified"),
    "finetune": ("bert_ds.downstream.finetune", "fine-tune an export on a GLUE/SQuAD/SWAG/NER-style task"),
    "glue": ("bert_ds.downstream.suite", "the GLUE suite: seeds, learning-rate grid, Table-1 layout"),
    "extract-features": ("bert_ds.downstream.features", "contextual features of sentences (feature-based use)"),
    "demo": ("bert_ds.devtools.demo", "the end-to-end demo on 2 CPU ranks"),
    "gpu-check": ("bert_ds.devtools.gpu_check", "prove the GPU path on a GPU (kernels, dropout, training)"),
    "kernel-report": ("bert_ds.devtools.kernel_report", "compile every Triton build for sm_80/sm_90; spills, MMA"),
    "plot-run": ("bert_ds.devtools.plot_run", "draw a run's TensorBoard curves"),
    "benchmark": ("bert_ds.devtools.benchmarks.cli", "every performance figure beside its baseline"),
}
"""Command -> (the module whose ``main(argv)`` runs it, one line for the help)."""


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: bert-ds <command> [args]   (bert-ds <command> --help: that command's options)", "",
             "commands (each also installed as bert-ds-<command>):"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``bert-ds``: exit 0 with the command list for ``--help``; 2 for no or an unknown command; else the command's
    own exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}" if argv else "no command given"
        sys.stderr.write(usage() + error_lines("bert-ds", f"{given}; choose one of {', '.join(COMMANDS)}"))
        return ExitCode.BAD_INPUT
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    sys.argv[0] = f"bert-ds-{name}"  # argparse's prog where a command does not name its own
    code = module.main(rest)
    return 0 if code is None else int(code)


if __name__ == "__main__":
    sys.exit(main())
