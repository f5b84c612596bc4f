"""The front door: ``bert-ds <command> [args]`` runs every bert_ds program; ``bert-ds --help`` lists them.
:data:`COMMANDS` is the one table of commands, each a :class:`Command`: its module, its parser builder and argument
dataclass, and its body. :func:`run` parses the command line once and runs the body once, through
:func:`bert_ds.errors.run_main`; each ``bert-ds-<command>`` console script (and ``tools/<command>.py``) is the
module's ``main = alias("<command>")``, so a command behaves the same whichever name starts it. ``setup.cfg``
installs one alias per entry, checked by ``tests/test_console_scripts.py``, and the flags of every command are
frozen in ``tests/assets/cli_surface.json`` so none vanishes unnoticed.

One rule for the error line: ``<prog>: error: <message>``, ``prog`` being the command's parser's (the name its usage
line shows), except the commands marked ``bare_errors``, whose lines users and scripts match as ``error: <message>``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

from bert_ds.cli_args import parse
from bert_ds.errors import error_lines, run_main
from bert_ds.exit_codes import ExitCode

__all__ = ["COMMANDS", "Command", "alias", "main", "run", "usage"]


class Command(NamedTuple):
    """One ``bert-ds`` command: names in ``module``, resolved when the command runs (``bert-ds --help`` imports none
    of them)."""

    module: str
    summary: str
    """One line for ``bert-ds --help``."""
    args: str | None = None
    """The argument dataclass (:mod:`bert_ds.cli_args`); None for a command that passes its arguments on verbatim (a
    launcher): its body gets the argument list and its exit status is the launcher's, with no error line of its
    own."""
    parser: str = "cli_parser"
    """``() -> argparse.ArgumentParser``: the parser generated from ``args`` (its prog, description, extras)."""
    body: str = "_run"
    """``(args) -> exit status or None``: what the command does with its parsed arguments."""
    bare_errors: bool = False
    """Error lines without the prog: ``error: <message>``."""
    with_argv: bool = False
    """The body also gets the argument list as given (None: ``sys.argv[1:]``), to record the command line."""


COMMANDS: dict[str, Command] = {
    "train-tokenizer": Command("bert_ds.data.tokenizer", "train a WordPiece vocabulary on text",
                               "TrainTokenizerArgs"),
    "create-shards": Command("bert_ds.data.create", "text -> NSP pairs, static masking -> WebDataset shards + "
                             "index.json", "CreateShardsArgs"),
    "verify-shards": Command("bert_ds.data.reader", "check a shard set against its index.json", "VerifyArgs"),
    "pretrain": Command("bert_ds.runtime.pretrain", "pre-train (one process; ranks via deepspeed, srun or mpirun)",
                        "RunArgs"),
    "deepspeed": Command("bert_ds.lifecycle.supervise", "DeepSpeed's runner, supervised: pre-emption exits 75, no "
                         "orphans"),
    "mpirun": Command("bert_ds.lifecycle.supervise_mpirun", "Open MPI's mpirun, supervised: pre-emption exits 75, no "
                      "orphans"),
    "make-hostfile": Command("bert_ds.lifecycle.hostfile", "write DeepSpeed's hostfile from a Slurm allocation or a "
                             "host list", "HostfileArgs"),
    "evaluate": Command("bert_ds.evaluate", "held-out masked-LM / NSP accuracy of a checkpoint", "EvaluateArgs",
                        bare_errors=True),
    "convert-checkpoint": Command("bert_ds.export.convert", "export a checkpoint to Hugging Face transformers, "
                                  "verified", "ConvertArgs", bare_errors=True),
    "finetune": Command("bert_ds.downstream.finetune", "fine-tune an export on a GLUE/SQuAD/SWAG/NER-style task",
                        "FinetuneArgs", parser="build_parser"),
    "glue": Command("bert_ds.downstream.suite", "the GLUE suite: seeds, learning-rate grid, Table-1 layout",
                    "SuiteArgs", body="_suite_and_table"),
    "extract-features": Command("bert_ds.downstream.features", "contextual features of sentences (feature-based "
                                "use)", "FeaturesArgs"),
    "demo": Command("bert_ds.devtools.demo", "the end-to-end demo on 2 CPU ranks", "DemoArgs"),
    "gpu-check": Command("bert_ds.devtools.gpu_check", "prove the GPU path on a GPU (kernels, dropout, training)",
                         "GpuCheckArgs", body="_check"),
    "kernel-report": Command("bert_ds.devtools.kernel_report", "compile every Triton build for sm_80/sm_90; spills, "
                             "MMA", "ReportArgs"),
    "plot-run": Command("bert_ds.devtools.plot_run", "draw a run's TensorBoard curves", "PlotArgs"),
    "benchmark": Command("bert_ds.devtools.benchmarks.cli", "every performance figure beside its baseline",
                         "BenchmarkArgs", with_argv=True),
}
"""Command -> how it is parsed and run (:class:`Command`)."""


def _module(name: str) -> ModuleType:
    """The module ``name``; when it is the running script (``python -m name``, ``python path/to/name.py``), that
    one, so its code is not imported a second time."""
    running = sys.modules.get("__main__")
    path = getattr(running, "__file__", None)
    if path is not None and name not in sys.modules:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and Path(spec.origin).resolve() == Path(path).resolve():
            return running
    return importlib.import_module(name)


def run(name: str, argv: Sequence[str] | None = None) -> int:
    """``bert-ds <name> <argv>``: the command's arguments parsed once, its body run once; its exit status (an error
    it raises: one line and its code, :func:`bert_ds.errors.run_main`)."""
    command = COMMANDS[name]
    module = _module(command.module)
    body = getattr(module, command.body)
    if command.args is None:
        code = body(list(sys.argv[1:] if argv is None else argv))
        return 0 if code is None else int(code)
    parser = getattr(module, command.parser)()
    args = parse(getattr(module, command.args), parser, argv)
    extra = (argv,) if command.with_argv else ()
    return run_main(None if command.bare_errors else parser.prog, body, args, *extra)


def alias(name: str) -> Callable[[Sequence[str] | None], int]:
    """The ``main`` of command ``name``'s module: what its ``bert-ds-<name>`` console script runs."""

    def main(argv: Sequence[str] | None = None) -> int:
        return run(name, argv)

    main.__doc__ = f"``bert-ds-{name}``, the same as ``bert-ds {name}`` (:func:`bert_ds.cli.run`)."
    main.__qualname__ = main.__name__ = "main"
    return main


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: bert-ds <command> [args]   (bert-ds <command> --help: that command's options)", "",
             "commands (each also installed as bert-ds-<command>):"]
    lines += [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
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
    return run(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
