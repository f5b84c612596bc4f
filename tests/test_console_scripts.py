"""Every CLI in tools/ that the README names is also an installed console script, and both run the same package
``main`` (tools/ files are thin wrappers). Needs the package installed (``pip install -e .``, as ``make test`` does)."""

from __future__ import annotations

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
    "bert-ds-train-tokenizer": "train_tokenizer.py",
    "bert-ds-create-shards": "create_shards.py",
    "bert-ds-verify-shards": "verify_shards.py",
    "bert-ds-pretrain": None,  # run as `python -m bert_ds.runtime.pretrain` or through the deepspeed launcher
    "bert-ds-evaluate": "evaluate.py",
    "bert-ds-convert-checkpoint": "convert_checkpoint.py",
    "bert-ds-finetune": "finetune.py",
    "bert-ds-extract-features": "extract_features.py",
}


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
    for name, ep in entry_points.items():
        assert callable(ep.load()), name
        assert ep.value.startswith("bert_ds.") and ep.value.endswith(":main"), (name, ep.value)


@pytest.mark.parametrize("name, filename", [(n, f) for n, f in SCRIPTS.items() if f])
def test_tool_file_and_console_script_run_the_same_main(name, filename):
    assert _tool_main(filename) is _entry_points()[name].load()


@pytest.mark.parametrize("name", ["bert-ds-evaluate", "bert-ds-convert-checkpoint", "bert-ds-finetune",
                                  "bert-ds-extract-features"])
def test_installed_script_prints_usage_under_its_own_name(name):
    script = Path(sys.executable).parent / name
    assert script.is_file(), f"{script} not installed; run `pip install -e .`"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: {name} "), result.stdout[:200]
