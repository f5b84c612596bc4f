"""One error base class carrying the exit code, written once (``bert_ds/errors.py``): a command's error is one line
``<prog>: error: <message>`` and its class's code; a full disk is 74, not bad input; no command writes its own."""

from __future__ import annotations

import ast
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.cli import COMMANDS
from bert_ds.errors import BadInput, BertDsError, StepFailed, StorageError, exit_code_of, run_main
from bert_ds.exit_codes import ExitCode
from tests.helpers import HANG_GUARD_S, child_env
from tests.helpers.ranks import REPO


class _Refused(BadInput):
    pass


def _raise(exc: BaseException):
    raise exc


@pytest.mark.parametrize("exc, code", [
    (_Refused("--data x: no index.json"), 2), (StorageError("cannot save: 0 MiB free"), 74),
    (StepFailed("a worker died"), 1), (OSError(errno.ENOSPC, "No space left on device"), 74),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), 74), (OSError(errno.EIO, "Input/output error"), 74),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "x"), 2), (PermissionError(errno.EACCES, "no"), 2),
    (BadInput("seq_len=7 must be >= 8"), 2)])
def test_an_error_is_one_line_and_its_code(capsys, exc, code):
    assert run_main("bert-ds-x", _raise, exc) == code == exit_code_of(exc)
    err = capsys.readouterr().err
    assert err == f"bert-ds-x: error: {exc}\n"


def test_one_line_per_problem_the_bare_form_and_success(capsys):
    assert run_main("bert-ds-x", _raise, BadInput("shard 1: bad\nshard 2: bad")) == 2
    assert capsys.readouterr().err == "bert-ds-x: error: shard 1: bad\nbert-ds-x: error: shard 2: bad\n"
    assert run_main(None, _raise, BadInput("no such tag")) == 2
    assert capsys.readouterr().err == "error: no such tag\n"
    assert run_main("bert-ds-x", lambda: None) == 0 and run_main("bert-ds-x", lambda: 3) == 3


@pytest.mark.parametrize("exc", [KeyError("step"), ValueError("zip() argument 2 is shorter than argument 1")])
def test_a_bug_keeps_its_traceback(capsys, exc):
    """A plain ``ValueError`` is a bug like any other untyped exception: bad input is raised as ``BadInput``."""
    assert exit_code_of(exc) is None
    with pytest.raises(type(exc)):
        run_main("bert-ds-x", _raise, exc)
    assert capsys.readouterr().err == ""


def test_the_errors_of_bert_ds_carry_their_codes_and_stay_what_they_were():
    from bert_ds.checkpoint import CheckpointError, CheckpointSaveError, DamagedCheckpointError
    from bert_ds.data.format import ShardError
    from bert_ds.data.workers import LoaderWorkerError
    from bert_ds.devtools.demo import DemoError, NotDemoDirectory
    from bert_ds.downstream.readers import DownstreamInputError
    from bert_ds.export.convert import VerificationError
    from bert_ds.export.keymap import ExportError
    from bert_ds.optim.lamb import UnsupportedZeroSetup

    for cls in (CheckpointError, DamagedCheckpointError, ShardError, ExportError, DownstreamInputError,
                UnsupportedZeroSetup, NotDemoDirectory):
        assert issubclass(cls, BertDsError) and cls.exit_code == ExitCode.BAD_INPUT, cls
    for cls in (LoaderWorkerError, VerificationError, DemoError):
        assert issubclass(cls, StepFailed) and cls.exit_code == ExitCode.FAILED, cls
    # A full disk during a save is the storage's failure, not bad input; callers catching CheckpointError (or
    # ValueError, as pre-training's main still does) still catch it.
    assert issubclass(CheckpointSaveError, StorageError) and CheckpointSaveError.exit_code == ExitCode.IO_ERROR
    assert issubclass(CheckpointSaveError, CheckpointError) and issubclass(CheckpointSaveError, ValueError)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_command_writing_to_a_full_device_exits_74(capsys):
    from bert_ds.lifecycle.hostfile import main

    assert main(["--hosts", "node0:8", "--output", "/dev/full"]) == ExitCode.IO_ERROR
    err = capsys.readouterr().err
    assert err.startswith("bert-ds-make-hostfile: error: [Errno 28] No space left on device") and err.count("\n") == 1


# ---- every command goes through run_main; none writes its own error line ---------------------------------------------

NOT_YET_JOINED: set[str] = set()
"""Modules that still format their own error lines (none: pre-training joined run_main too)."""


def _error_line_literals(path: Path) -> list[int]:
    """Line numbers of string literals (f-string parts included, docstrings not) that hold ``error: ``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and "error: " in n.value and id(n) not in docs]


def test_the_scan_sees_an_error_line(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('def main():\n    """error: in prose"""\n    print(f"bert-ds-x: error: {exc}")\n')
    assert _error_line_literals(probe) == [3]


def test_no_module_writes_its_own_error_line():
    found = {str(p.relative_to(REPO)): lines for p in sorted((REPO / "bert_ds").rglob("*.py"))
             if (lines := _error_line_literals(p)) and str(p.relative_to(REPO)) not in NOT_YET_JOINED
             and p.name != "errors.py"}
    assert found == {}, f"write error lines with bert_ds.errors.run_main / error_lines: {found}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_main_is_the_front_doors_alias(command):
    """A command's module parses nothing and calls no run_main itself: its ``main`` is ``alias(name)``, and
    :func:`bert_ds.cli.run` parses the command line once and runs the body once (deepspeed and mpirun, which pass
    their arguments on to the launcher, get them verbatim and write no error line of their own)."""
    path = REPO / (COMMANDS[command].module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"
             or isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "main" for t in n.targets)]
    assert len(mains) == 1 and isinstance(mains[0], ast.Assign), f"{path.relative_to(REPO)}: main = alias(...)"
    call = mains[0].value
    assert isinstance(call, ast.Call) and call.func.id == "alias" and call.args[0].value == command
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "run_main" not in calls, path


_BUG = """
import sys
import bert_ds.lifecycle.hostfile as launch
from bert_ds.cli import main

def step(args):  # a bug: the two lists were meant to be as long
    return len(list(zip([1, 2], [1], strict=True)))

launch._run = step
sys.exit(main(sys.argv[1:]))
"""


def test_a_plain_value_error_in_a_command_is_a_bug_with_its_traceback():
    """A command whose body raises a plain ``ValueError`` (here a ``zip(..., strict=True)``) exits 1 with the
    traceback, not as bad input: exit 2 and ``error:`` are for ``BadInput`` (the same command refusing its input)."""
    bug = subprocess.run([sys.executable, "-c", _BUG, "make-hostfile", "--hosts", "node0:8", "--output", "-"],
                         capture_output=True, text=True, timeout=HANG_GUARD_S, env=child_env())
    assert bug.returncode == 1, bug.stderr
    assert "Traceback (most recent call last)" in bug.stderr, bug.stderr
    assert "ValueError: zip() argument 2 is shorter than argument 1" in bug.stderr and "error:" not in bug.stderr
    refused = subprocess.run([sys.executable, "-m", "bert_ds.cli", "make-hostfile", "--hosts", "node0"],
                             capture_output=True, text=True, timeout=HANG_GUARD_S, env=child_env())
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr == "bert-ds-make-hostfile: error: --hosts: 'node0' has no :SLOTS and no --slots was given\n"


# ---- the count: a bare ValueError is a bug when it fires, so every one left is an internal contract ------------------

def test_the_raise_scan_sees_what_is_raised(tmp_path):
    from tests.helpers.value_errors import Raise, raises

    (tmp_path / "probe.py").write_text('"""raise ValueError in prose"""\ndef f(x):\n    if x:\n'
                                       '        raise ValueError("bad")\n    raise errors.BadInput("x")\n')
    assert raises(tmp_path) == [Raise("probe.py", 4, "f", "ValueError"), Raise("probe.py", 5, "f", "BadInput")]


def test_every_bare_value_error_left_is_an_internal_contract():
    """Outside the modules another branch of issue 32 types (``PENDING``), each ``raise ValueError`` sits in a
    function of ``INTERNAL``, which says why no user value reaches it; a user's bad input is ``BadInput``."""
    from tests.helpers.value_errors import INTERNAL, PENDING, raises

    bare = [r for r in raises() if r.raised == "ValueError"]
    untyped = [f"{r.module}:{r.line} ({r.function})" for r in bare
               if r.module not in PENDING and (r.module, r.function) not in INTERNAL]
    assert untyped == [], "raise BadInput for a user's input, or list the function in INTERNAL with why"
    assert set(INTERNAL) <= {(r.module, r.function) for r in bare}, "an INTERNAL entry raises no ValueError now"
