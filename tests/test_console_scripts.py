"""Every user-facing CLI is an installed console script ``bert-ds-<name>`` whose ``main`` lives in the package, and
its ``tools/<name>.py`` file is a thin wrapper over the same ``main``. Needs the package installed (``pip install -e
.``, as ``make test`` does)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]

# console script -> the tools/ file that wraps the same function.
SCRIPTS = {
    "bert-ds": None,  # the front door (bert_ds.cli): bert-ds <command>
    "bert-ds-train-tokenizer": "train_tokenizer.py",
    "bert-ds-create-shards": "create_shards.py",
    "bert-ds-verify-shards": "verify_shards.py",
    "bert-ds-pretrain": None,  # run as `python -m bert_ds.runtime.pretrain` or through the deepspeed launcher
    "bert-ds-deepspeed": None,  # DeepSpeed's runner under the supervisor (python -m bert_ds.lifecycle.supervise)
    "bert-ds-mpirun": None,  # Open MPI's mpirun, the same supervisor (python -m bert_ds.lifecycle.supervise_mpirun)
    "bert-ds-evaluate": "evaluate.py",
    "bert-ds-convert-checkpoint": "convert_checkpoint.py",
    "bert-ds-finetune": "finetune.py",
    "bert-ds-extract-features": "extract_features.py",
    "bert-ds-glue": "glue.py",
    "bert-ds-make-hostfile": "make_hostfile.py",
    "bert-ds-demo": "demo.py",
    "bert-ds-gpu-check": "gpu_check.py",
    "bert-ds-kernel-report": "kernel_report.py",
    "bert-ds-plot-run": "plot_run.py",
    "bert-ds-benchmark": "benchmark.py",
}
# tools/ scripts that are not console scripts: the single benchmarks (thin wrappers over bert_ds.devtools.benchmarks,
# whose create and loader sections bert-ds-benchmark runs), and the installer's shell script.
BENCHMARK_WRAPPERS = {"bench_create.py", "bench_lamb.py", "bench_loader.py", "bench_remote.py"}
NOT_CONSOLE_SCRIPTS = BENCHMARK_WRAPPERS | {"system_packages.sh"}


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    dist = importlib.metadata.distribution("bert_ds")
    return {ep.name: ep for ep in dist.entry_points if ep.group == "console_scripts"}


def _tool_main(filename: str):
    spec = importlib.util.spec_from_file_location(f"tools_{Path(filename).stem}", REPO / "tools" / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_every_console_script_is_installed_and_resolves():
    entry_points = _entry_points()
    assert set(SCRIPTS) <= set(entry_points), f"missing: {sorted(set(SCRIPTS) - set(entry_points))}; re-run " \
                                              "`pip install -e .` after editing setup.cfg"
    assert set(entry_points) <= set(SCRIPTS), f"add {sorted(set(entry_points) - set(SCRIPTS))} to SCRIPTS"
    for name, ep in entry_points.items():
        assert callable(ep.load()), name
        assert ep.value.startswith("bert_ds.") and ep.value.endswith(":main"), (name, ep.value)


def test_every_tools_file_is_a_console_script_or_listed_as_not_one():
    wrapped = {f for f in SCRIPTS.values() if f}
    present = {p.name for p in (REPO / "tools").iterdir() if p.is_file()}
    assert present - NOT_CONSOLE_SCRIPTS == wrapped, "a new tools/ CLI needs a console script (setup.cfg + SCRIPTS)"


@pytest.mark.parametrize("name, filename", [(n, f) for n, f in SCRIPTS.items() if f])
def test_tool_file_and_console_script_run_the_same_main(name, filename):
    assert _tool_main(filename) is _entry_points()[name].load()


@pytest.mark.parametrize("filename", sorted({f for f in SCRIPTS.values() if f} | BENCHMARK_WRAPPERS))
def test_tool_file_is_a_thin_wrapper(filename):
    """Logic lives in the package, where the console script finds it: a tools/ wrapper imports ``main`` from bert_ds
    and calls it, defining nothing of its own."""
    tree = ast.parse((REPO / "tools" / filename).read_text(encoding="utf-8"))
    defined = [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.ClassDef)]
    imports_main = [node.module for node in tree.body if isinstance(node, ast.ImportFrom)
                    and any(alias.name == "main" for alias in node.names)]
    assert defined == [] and len(imports_main) == 1 and imports_main[0].startswith("bert_ds."), (defined, imports_main)


# bert-ds-pretrain names itself after its module: the deepspeed launcher runs it as `-m bert_ds.runtime.pretrain`.
@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - {"bert-ds-pretrain", "bert-ds"}))
def test_installed_script_prints_usage_under_its_own_name(name):
    script = Path(sys.executable).parent / name
    assert script.is_file(), f"{script} not installed; run `pip install -e .`"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: {name} "), result.stdout[:200]


# ---- the front door (issue 22): bert-ds <command>, the aliases, the frozen flags -------------------------------------

def test_every_command_has_its_alias_and_the_front_door_lists_them_all():
    from bert_ds.cli import COMMANDS

    entry_points = _entry_points()
    assert set(entry_points) == {"bert-ds"} | {f"bert-ds-{name}" for name in COMMANDS}
    assert entry_points["bert-ds"].value == "bert_ds.cli:main"
    for name, command in COMMANDS.items():
        assert entry_points[f"bert-ds-{name}"].value == f"{command.module}:main", name
    listed = subprocess.run([str(Path(sys.executable).parent / "bert-ds"), "--help"], capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("  ")] == list(COMMANDS)


def test_a_command_through_the_front_door_is_its_alias(capsys):
    from bert_ds.cli import main

    with pytest.raises(SystemExit) as through_door:
        main(["make-hostfile", "--help"])
    door = capsys.readouterr().out
    with pytest.raises(SystemExit) as alias:
        _entry_points()["bert-ds-make-hostfile"].load()(["--help"])
    assert through_door.value.code == alias.value.code == 0 and door == capsys.readouterr().out
    assert main(["no-such-command"]) == 2
    assert "bert-ds: error: unknown command 'no-such-command'" in capsys.readouterr().err
    assert main([]) == 2


def test_the_cli_surface_is_frozen():
    """Every flag of every command is in tests/assets/cli_surface.json: a flag cannot vanish (or appear) unnoticed.
    After a deliberate change: python -m tests.helpers.cli_surface > tests/assets/cli_surface.json"""
    import json

    from tests.helpers.cli_surface import cli_surface

    frozen = json.loads((REPO / "tests" / "assets" / "cli_surface.json").read_text())
    now = cli_surface()
    vanished = {c: sorted(set(frozen.get(c, [])) - set(now.get(c, []))) for c in frozen}
    added = {c: sorted(set(now.get(c, [])) - set(frozen.get(c, []))) for c in now}
    vanished = {c: f for c, f in vanished.items() if f}
    added = {c: f for c, f in added.items() if f}
    assert not vanished, f"flags removed: {vanished}"
    assert not added, f"flags added (regenerate the file if deliberate): {added}"
