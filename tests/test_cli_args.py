"""Command lines generated from typed argument dataclasses (``bert_ds/cli_args.py``): help from field docstrings,
defaults written once, switches, choices, required options and positionals, lists; the two commands whose defaults
used to be written twice (bert-ds-finetune, bert-ds-glue) are generated."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Literal

import pytest

from bert_ds.cli_args import build_parser, comma_separated, field_docs, option, parse


@dataclass
class Args:
    """A command's arguments."""

    model: str
    """Model directory, e.g. ``runs/x``."""
    runs: list[str] = option(positional=True, nargs="*", help="run directories")
    steps: int = 10
    """Optimizer steps; 100% of them logged."""
    rate: float = 5e-5
    """Peak learning rate."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run."""
    kernels: str = option("torch", choices=("torch", "triton"), help="fused-op backend")
    bf16: bool = False
    """bf16 mixed precision."""
    verify: bool = True
    """Reload and compare the output."""
    out: Path | None = option(None, flags=("--output", "-o"), metavar="DIR", help="where to write")
    grid: tuple[float, ...] = ()
    """Comma-separated rates."""
    seed: int = option(1, hidden=True)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


def _actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in build_parser(Args, "prog")._actions}


def test_help_is_the_field_docstring_and_the_default_is_appended_once():
    help_text = build_parser(Args, "prog", "What it does.").format_help()
    assert "Model directory, e.g. runs/x" in help_text  # reST literals unwrapped, the final period dropped
    assert "Optimizer steps; 100% of them logged (default: 10)" in help_text  # % survives argparse's formatting
    assert "Peak learning rate (default: 5e-05)" in help_text and "--seed" not in help_text
    assert help_text.count("(default:") == 4  # steps, rate, device, kernels: not None, (), a switch or hidden
    assert field_docs(Args)["bf16"] == "bf16 mixed precision."


def test_defaults_and_types_come_from_the_dataclass():
    actions = _actions()
    for f in fields(Args):
        if f.default is not MISSING:
            assert actions[f.name].default == f.default, f.name
    assert (actions["steps"].type, actions["rate"].type, actions["out"].type) == (int, float, Path)
    assert actions["model"].required and not actions["steps"].required
    args = parse(Args, build_parser(Args, "prog"), ["--model", "m"])
    assert args == Args(model="m", runs=[])


def test_switches_choices_flags_positionals_and_lists():
    actions = _actions()
    assert actions["bf16"].option_strings == ["--bf16"] and actions["bf16"].default is False
    assert actions["verify"].option_strings == ["--no-verify"]
    assert actions["device"].choices == ("auto", "cpu", "cuda") and actions["kernels"].choices == ("torch", "triton")
    assert actions["out"].option_strings == ["--output", "-o"] and actions["out"].metavar == "DIR"
    assert actions["runs"].option_strings == [] and actions["seed"].help == argparse.SUPPRESS
    args = parse(Args, build_parser(Args, "prog"), ["r1", "r2", "--model", "m", "--bf16", "--no-verify", "-o", "x",
                                                    "--device", "cpu", "--grid", "5e-5,3e-5", "--steps", "3"])
    assert (args.runs, args.bf16, args.verify, args.out, args.device) == (["r1", "r2"], True, False, Path("x"), "cpu")
    assert (args.grid, args.steps) == ((5e-5, 3e-5), 3)


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: --model"),
    (["--model", "m", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--model", "m", "--grid", "fast"], "argument --grid: expected comma-separated float values, got 'fast'"),
    (["--model", "m", "--steps", "0"], "prog: error: steps must be >= 1, got 0"),  # __post_init__'s ValueError
])
def test_refusals_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        parse(Args, build_parser(Args, "prog"), argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("usage: prog") and message in err, err


def test_options_beyond_the_dataclass_are_parsed_and_left_out():
    parser = build_parser(Args, "prog")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    assert parse(Args, parser, ["--model", "m", "--local_rank", "3"]) == Args(model="m", runs=[])


def test_comma_separated_drops_empty_items():
    assert comma_separated(str)("cola, sst2,") == ("cola", "sst2") and comma_separated(float)("") == ()


def test_finetune_and_glue_are_generated_with_their_defaults_written_once():
    from bert_ds.cli_args import parse
    from bert_ds.downstream.finetune import FinetuneArgs
    from bert_ds.downstream.finetune import build_parser as finetune_parser
    from bert_ds.downstream.suite import SuiteArgs, cli_parser

    defaults = {f.name: f.default for f in fields(FinetuneArgs) if f.default is not MISSING}
    assert {a.dest: a.default for a in finetune_parser()._actions if a.dest in defaults} == defaults
    assert "Passes over the training file (default: 3)" in " ".join(finetune_parser().format_help().split())
    argv = ["--model", "m", "--data-dir", "d", "--out", "o", "--lr-grid", "5e-5,4e-5", "--tasks", "cola"]
    suite = parse(SuiteArgs, cli_parser(), argv)
    assert suite == SuiteArgs(model="m", data_dir="d", out="o", lr_grid=(5e-5, 4e-5), tasks=("cola",))


def test_defaults_of_a_function_and_a_help_that_places_its_default():
    from bert_ds.cli_args import defaults_of
    from bert_ds.data.create import CreateShardsArgs, create_shards

    def f(a, b=3, *, c="x"):
        return a

    assert defaults_of(f) == {"b": 3, "c": "x"}
    # bert-ds-create-shards' defaults are create_shards' own (written once, in its signature).
    parser = build_parser(CreateShardsArgs, "bert-ds-create-shards")
    actions = {a.dest: a for a in parser._actions}
    shared = set(actions) & set(defaults_of(create_shards))
    assert {"dupe_factor", "seed", "workers", "samples_per_shard", "masked_lm_prob"} <= shared
    assert all(actions[name].default == defaults_of(create_shards)[name] for name in shared)
    help_text = " ".join(parser.format_help().split())
    assert "(default 1; NVIDIA's recipe uses 5, Google's 10)" in help_text and "(default: 12345)" in help_text


# deepspeed and mpirun pass their arguments on to the launcher verbatim: a REMAINDER, no options of their own.
PASS_THROUGH = {"deepspeed", "mpirun"}


@pytest.mark.parametrize("command", sorted(set(__import__("bert_ds.cli").cli.COMMANDS) - PASS_THROUGH))
def test_every_command_line_is_generated_from_a_dataclass(command):
    """Each command's parser comes from ``cli_args.build_parser`` over its argument dataclass: every option it has is
    a field of that class (argparse's help and hidden launcher extras, such as pretrain's ``--local_rank``, aside),
    so no default or help is written twice."""
    import argparse
    import dataclasses
    import importlib
    from unittest import mock

    from bert_ds import cli_args
    from bert_ds.cli import COMMANDS

    built: list[tuple[type, argparse.ArgumentParser]] = []
    real = cli_args.build_parser

    def spy(cls, *args, **kwargs):
        parser = real(cls, *args, **kwargs)
        built.append((cls, parser))
        return parser

    class Stop(BaseException):
        pass

    def stop(self, *args, **kwargs):
        raise Stop

    module = importlib.import_module(COMMANDS[command][0])
    imported = getattr(module, "build_parser", None) is real  # `from bert_ds.cli_args import build_parser`
    with mock.patch.object(cli_args, "build_parser", spy), \
            mock.patch.object(module, "build_parser", spy if imported else getattr(module, "build_parser", None),
                              create=True), \
            mock.patch.object(argparse.ArgumentParser, "parse_args", stop), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop):
        try:
            module.main([])
        except Stop:
            pass
    assert built, f"bert-ds {command}: its parser is not built by bert_ds.cli_args.build_parser"
    names = {f.name for cls, _ in built for f in dataclasses.fields(cls)}
    for _, parser in built:
        for action in parser._actions:
            skip = isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
            if skip or action.help == argparse.SUPPRESS:
                continue
            assert action.dest in names, f"bert-ds {command}: {action.option_strings or action.dest} is not a field"
