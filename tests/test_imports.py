"""Imports point down the data flow.

* Importing the model, the data path, the run directory reader, the exporter or evaluation does not import deepspeed
  (checked in a fresh interpreter): those run on machines and in processes without a DeepSpeed process group.
* ``bert_ds/model`` never imports ``bert_ds.export``, ``bert_ds.runtime.engine`` or ``deepspeed``: the model is
  single-device and the Hugging Face import/export sits above it (``bert_ds.export.hf.load_hf_pretrained``).
* ``bert_ds/data`` follows its pipeline: a module imports its own stage or earlier ones, never a later one (the order
  is :data:`DATA_STAGES`). Function-level imports count too.
* ``bert_ds.checkpoint`` owns the run directory; export and evaluation call it, never the other way round.
* ``tools/`` are thin CLIs over the package: they never import ``tests``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "bert_ds"

DATA_STAGES = {
    "text": 0,  # raw documents and sentences
    "english_corpus": 0,  # a raw-text corpus built from files on the machine (tests, benchmarks)
    "tokenizer": 1,  # vocab.txt, casing, WordPiece
    "pairs": 2,  # NSP sentence pairs from tokenized documents
    "masking": 3,  # MLM masking (static at creation, dynamic in the loader)
    "format": 4,  # one sample's bytes
    "index": 5,  # shard files + index.json
    "create": 6,  # text -> shards (the whole offline pipeline)
    "reader": 6,  # shards -> samples
    "synthetic": 6,  # random shards for tests and benchmarks
    "loader": 7,  # samples -> batches, rank/worker split, dynamic masking
}
"""Stage of each ``bert_ds.data`` module in the pipeline text -> tokenizer -> pairs -> masking -> format -> index ->
create/reader -> loader. Modules of the same stage may import each other; none imports a later stage."""

NO_DEEPSPEED = ["bert_ds.model", "bert_ds.data", "bert_ds.data.create", "bert_ds.data.loader", "bert_ds.export",
                "bert_ds.checkpoint", "bert_ds.evaluate", "bert_ds.downstream.finetune", "bert_ds.downstream.features"]


def imported_modules(source: str, package: str) -> set[str]:
    """Every module ``source`` (a file of ``package``) imports, at any depth, relative imports resolved."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # ``from pkg import submodule``
    return names


def _imports_of(path: Path) -> set[str]:
    package = ".".join(path.relative_to(REPO).parent.parts)
    return imported_modules(path.read_text(encoding="utf-8"), package)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _deepspeed_modules_after_import(module: str) -> list[str]:
    code = (f"import json, sys; import {module}; "
            "print(json.dumps(sorted(m for m in sys.modules if m == 'deepspeed' or m.startswith('deepspeed.'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_the_static_scan_sees_nested_and_relative_imports():
    source = ("import os\n"
              "from . import heads\n"
              "from ..export.hf import load_hf_pretrained\n"
              "def f():\n"
              "    import deepspeed.comm as dist\n"
              "    from bert_ds.runtime.engine import build_model\n")
    found = imported_modules(source, "bert_ds.model")
    assert {"os", "bert_ds.model.heads", "bert_ds.export.hf", "deepspeed.comm", "bert_ds.runtime.engine"} <= found


def test_the_deepspeed_probe_sees_deepspeed():
    # The engine wires DeepSpeed in: the probe below must report it there, or its empty answers would mean nothing.
    assert "deepspeed" in _deepspeed_modules_after_import("bert_ds.runtime.engine")


@pytest.mark.parametrize("module", NO_DEEPSPEED)
def test_importing_does_not_import_deepspeed(module):
    assert _deepspeed_modules_after_import(module) == []


def test_the_model_imports_neither_export_nor_engine_nor_deepspeed():
    forbidden = ("bert_ds.export", "bert_ds.runtime.engine", "bert_ds.runtime.pretrain", "deepspeed")
    bad = {path.name: sorted(n for n in _imports_of(path) if _under(n, forbidden))
           for path in sorted((PACKAGE / "model").glob("*.py"))}
    assert {name: names for name, names in bad.items() if names} == {}


def test_data_modules_import_only_their_own_or_earlier_stages():
    modules = sorted(p for p in (PACKAGE / "data").glob("*.py") if p.name != "__init__.py")
    assert {p.stem for p in modules} == set(DATA_STAGES), "place every bert_ds/data module in DATA_STAGES"
    later = {}
    for path in modules:
        stage = DATA_STAGES[path.stem]
        for name in _imports_of(path):
            parts = name.split(".")
            if parts[:2] == ["bert_ds", "data"] and len(parts) > 2 and parts[2] in DATA_STAGES:
                if DATA_STAGES[parts[2]] > stage:
                    later.setdefault(path.stem, []).append(parts[2])
    assert later == {}


def test_the_run_directory_owner_does_not_import_its_readers():
    readers = ("bert_ds.export", "bert_ds.evaluate", "bert_ds.runtime.engine", "bert_ds.runtime.pretrain")
    assert sorted(n for n in _imports_of(PACKAGE / "checkpoint.py") if _under(n, readers)) == []


def test_tools_do_not_import_tests():
    bad = {path.name: sorted(n for n in _imports_of(path) if _under(n, ("tests",)))
           for path in sorted((REPO / "tools").glob("*.py"))}
    assert {name: names for name, names in bad.items() if names} == {}
