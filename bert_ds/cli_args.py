"""Command lines generated from typed argument dataclasses: each field is one option, its default written once (on
the field), its help the field's docstring (the string right below it, read from the source as litgpt's jsonargparse
does) or ``option(help=...)`` where the text is computed. The type decides the rest:

* ``int``, ``float``, ``str``, ``Path`` (or ``X | None``): ``type=X``; ``Literal[...]`` (or ``option(choices=...)``):
  choices; a field without a default: a required option (``option(positional=True)``: a positional);
* ``bool``: a switch, ``--name`` for a False default, ``--no-name`` for a True one;
* ``tuple[X, ...]``: comma-separated (``--lr-grid 5e-5,3e-5``); ``list[X]``: ``nargs="+"`` (or ``option(nargs=...)``).

The default is appended to the help (``(default: 128)``) unless the text already speaks of one (``%(default)s``
places it). A field whose value is handed to a function takes its default from there (:func:`defaults_of`).
:func:`parse` builds the instance, and a ``ValueError`` from its ``__post_init__`` is a usage error (exit 2 with the
usage line). A leaf: imports nothing of bert_ds.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Option", "add_arguments", "build_parser", "comma_separated", "defaults_of", "field_docs", "option",
           "parse"]

_KEY = "bert_ds.cli"


@dataclasses.dataclass(frozen=True)
class Option:
    """How one dataclass field appears on the command line (``option()`` stores it in the field's metadata)."""

    flags: tuple[str, ...] = ()
    """Option strings (default: ``--`` + the field name with ``-`` for ``_``)."""
    help: str | None = None
    choices: Sequence | None = None
    metavar: str | None = None
    positional: bool = False
    hidden: bool = False
    nargs: str | int | None = None


def option(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
           flags: tuple[str, ...] = (), help: str | None = None, choices: Sequence | None = None,
           metavar: str | None = None, positional: bool = False, hidden: bool = False,
           nargs: str | int | None = None) -> Any:
    """A dataclass field with its command-line details; the default is given here and nowhere else."""
    cli = Option(tuple(flags), help, tuple(choices) if choices is not None else None, metavar, positional, hidden,
                 nargs)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: cli})


def _clean(doc: str) -> str:
    """A docstring as one line of help: reST roles and literals unwrapped, ``%`` escaped for argparse."""
    doc = re.sub(r":\w+:`~?([^`]*)`", r"\1", " ".join(inspect.cleandoc(doc).split()))
    return _escape(doc.replace("``", ""))


def _escape(text: str) -> str:
    """``%`` escaped for argparse, except ``%(default)s`` (a help text that places the default itself)."""
    return re.sub(r"%(?!\(default\)s)", "%%", text)


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right below the field in the class body (base classes first, so a subclass
    may override); fields without one are absent. Empty when the source cannot be read."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[node.target.id] = _clean(after.value.value)
    return docs


def defaults_of(function: Callable) -> dict[str, Any]:
    """The parameters of ``function`` that have defaults, and those defaults: for the fields of a CLI dataclass that
    call ``function``, so its defaults stay written once, in its signature."""
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def comma_separated(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    """An argparse ``type``: ``"a,b"`` -> ``(kind("a"), kind("b"))``; empty items are dropped (``""`` is ``()``)."""
    name = getattr(kind, "__name__", "value")

    def convert(text: str) -> tuple:
        try:
            return tuple(kind(item.strip()) for item in text.split(",") if item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {name} values, got {text!r}") from None

    convert.__name__ = f"comma-separated {name}"
    return convert


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _default_text(value: Any) -> str | None:
    if value is None or isinstance(value, bool) or value in ((), [], ""):  # a switch's flag says its default
        return None
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple | list):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return str(value)


def _type_kwargs(hint: Any, cli: Option) -> dict:
    """argparse keywords for a field of type ``hint`` (not a bool)."""
    kind, _ = _unwrap(hint)
    origin = typing.get_origin(kind)
    kwargs: dict = {}
    if origin is typing.Literal:
        kwargs["choices"] = typing.get_args(kind)
        kind = type(kwargs["choices"][0])
    elif origin is tuple and not cli.nargs:
        return {"type": comma_separated(typing.get_args(kind)[0])}
    elif origin in (tuple, list):
        kwargs["nargs"] = cli.nargs or "+"
        kind = typing.get_args(kind)[0]
    elif cli.nargs is not None:
        kwargs["nargs"] = cli.nargs
    if kind in (int, float, Path):
        kwargs["type"] = kind
    return kwargs


def _help(name: str, cli: Option, docs: dict[str, str], default: Any) -> str | None:
    if cli.hidden:
        return argparse.SUPPRESS
    text = _escape(cli.help) if cli.help is not None else docs.get(name)
    text = text.removesuffix(".") if text else text
    shown = _default_text(default)
    if shown is not None and (text is None or "default" not in text.lower()):
        text = f"{text} (default: {shown})" if text else f"default: {shown}"
    return text


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One argument per ``init`` field of the dataclass ``cls``, in field order (see the module docstring)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        cli: Option = f.metadata.get(_KEY, Option())
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if has_default else None)
        kwargs: dict = {"help": _help(f.name, cli, docs, default), "metavar": cli.metavar}
        hint, _ = _unwrap(hints[f.name])
        if hint is bool:
            kwargs.update(action="store_false" if default else "store_true")
            kwargs.pop("metavar")
        else:
            kwargs.update(_type_kwargs(hints[f.name], cli))
        if cli.choices is not None:
            kwargs["choices"] = cli.choices
        if cli.positional:
            parser.add_argument(f.name, **kwargs, **({"default": default} if has_default else {}))
            continue
        flags = cli.flags or ((f"--no-{f.name.replace('_', '-')}",) if hint is bool and default else
                              (f"--{f.name.replace('_', '-')}",))
        parser.add_argument(*flags, dest=f.name, default=default, required=not has_default, **kwargs)


def build_parser(cls: type, prog: str, description: str | None = None, **kwargs) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` holding :func:`add_arguments` of ``cls``; ``kwargs`` go to the parser."""
    parser = argparse.ArgumentParser(prog=prog, description=description, **kwargs)
    add_arguments(parser, cls)
    return parser


def parse(cls: type, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> Any:
    """``cls`` from the command line: the parser's values of ``cls``'s fields (options the parser adds beyond them are
    ignored); a ``ValueError`` from ``cls`` (its ``__post_init__``) ends as ``parser.error``: usage line, exit 2."""
    values = vars(parser.parse_args(argv))
    try:
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.init and f.name in values})
    except ValueError as exc:
        parser.error(str(exc))
