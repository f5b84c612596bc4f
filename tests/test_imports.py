"""Imports point down the data flow.

* Importing the model, the data path, the run directory reader, the exporter, evaluation or the supervisors does not
  import deepspeed (checked in a fresh interpreter): those run on machines and in processes without a DeepSpeed
  process group.
* ``bert_ds/model`` never imports ``bert_ds.export``, ``bert_ds.runtime.engine`` or ``deepspeed``: the model is
  single-device and the Hugging Face import/export sits above it (``bert_ds.export.hf.load_hf_pretrained``).
* ``bert_ds/data`` follows its pipeline: a module imports its own stage or earlier ones, never a later one (the order
  is :data:`DATA_STAGES`). Function-level imports count too.
* ``bert_ds.checkpoint`` owns the run directory: it writes and reads it (resume and hand-off included); export,
  evaluation and the trainer call it, never the other way round, and neither the trainer nor the DeepSpeed internals
  module names a file of the run directory.
* No import cycle anywhere in ``bert_ds`` (module-level and function-level imports: a lazy import only hides a cycle),
  and no arrow up: a room (subpackage or top-level module) imports only rooms declared below it in
  :data:`bert_ds.devtools.house.ROOMS` (``python -m bert_ds.devtools.house`` prints the plan).
* ``tools/`` are thin CLIs over the package: they never import ``tests``.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.devtools.house import ROOMS, from_base, import_cycles, import_graph, main, survey
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
    "remote": 5,  # a shard set at a URL: the store's client (fsspec), retries, errors
    "shard_cache": 5,  # a URL's shards in the node-local cache, verified, once per node
    "create": 6,  # text -> shards (the whole offline pipeline)
    "reader": 6,  # shards -> samples
    "synthetic": 6,  # random shards for tests and benchmarks
    "batch": 7,  # the batch contract: fields, shapes, dtype (what the loader yields and the trainer consumes)
    "dynamic_masking": 7,  # re-masking each epoch inside the loader
    "epoch_order": 7,  # the loader's per-epoch sample order
    "collate": 7,  # samples -> one packed micro batch (read, mask, check)
    "workers": 7,  # the loader's DataLoader worker processes; a dead worker named
    "mix": 7,  # weighted mixes of shard sets: which source each position of a global batch reads
    "prefetch": 7,  # a URL's next shards fetched ahead from the loader's own order
    "loader": 7,  # samples -> batches, rank/worker split, resumable state
}
"""Stage of each ``bert_ds.data`` module in the pipeline text -> tokenizer -> pairs -> masking -> format -> index ->
create/reader -> loader. Modules of the same stage may import each other; none imports a later stage."""

NO_DEEPSPEED = ["bert_ds.deepspeed_internals",
                "bert_ds.model", "bert_ds.data", "bert_ds.data.create", "bert_ds.data.loader", "bert_ds.export",
                "bert_ds.checkpoint", "bert_ds.safe_load", "bert_ds.evaluate", "bert_ds.downstream.finetune",
                "bert_ds.downstream.features", "bert_ds.runtime.memory",
                # the supervisors run DeepSpeed's runner as a child; a rank's pre-emption flag and hang watchdog are
                # armed before DeepSpeed is imported
                "bert_ds.lifecycle.supervise", "bert_ds.lifecycle.supervise_mpirun", "bert_ds.lifecycle.preemption",
                "bert_ds.lifecycle.hang_watchdog"]


def imported_modules(source: str, package: str) -> set[str]:
    """Every module ``source`` (a file of ``package``) imports, at any depth, relative imports resolved."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
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
    readers = ("bert_ds.export", "bert_ds.evaluate", "bert_ds.runtime.engine", "bert_ds.runtime.pretrain",
               "bert_ds.runtime.trainer", "bert_ds.runtime.distributed", "bert_ds.data.loader")
    bad = {path.name: sorted(n for n in _imports_of(path) if _under(n, readers))
           for path in sorted((PACKAGE / "checkpoint").glob("*.py"))}
    assert bad and {name: names for name, names in bad.items() if names} == {}


# ---- no import cycle ------------------------------------------------------------------------------------------------

def test_the_cycle_finder_sees_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    # The cycle this check was written for: the DeepSpeed internals module importing LAMB's exception back, while
    # LAMB imports the internals (function-level, both ways). Put that edge back and the finder reports it.
    graph = import_graph()
    assert "bert_ds.deepspeed_internals" in graph["bert_ds.optim.lamb"]
    graph["bert_ds.deepspeed_internals"].add("bert_ds.optim.lamb")
    assert ["bert_ds.deepspeed_internals", "bert_ds.optim.lamb"] in [sorted(c) for c in import_cycles(graph)]


def test_no_import_cycle_in_bert_ds():
    graph = import_graph()
    assert len(graph) > 50 and "bert_ds.safe_load" in graph
    assert import_cycles(graph) == []


def test_the_house_has_no_arrow_up_and_every_room_is_placed():
    house = survey(import_graph())
    assert house.cycles == [] and house.arrows_up == [] and house.undeclared == []
    assert set(house.rooms) == {room for room, _ in ROOMS}, "ROOMS names a room bert_ds does not have"
    assert house.sound


def test_runtime_is_what_runs_on_a_rank_and_lifecycle_what_runs_around_it():
    rooms = survey(import_graph()).rooms
    assert {m.rsplit(".", 1)[1] for m in rooms["runtime"]} - {"runtime"} == {
        "pretrain", "preflight", "trainer", "engine", "metrics", "distributed", "caches", "memory"}
    assert {m.rsplit(".", 1)[1] for m in rooms["lifecycle"]} - {"lifecycle"} == {
        "supervise", "supervise_mpirun", "restart", "hostfile", "hang_watchdog", "runner_watch", "rank_exit",
        "early_signals", "preemption", "startup_gc"}


def test_the_house_sees_a_planted_cycle_and_a_planted_arrow_up():
    graph = import_graph()
    assert "bert_ds.lifecycle.preemption" in graph["bert_ds.runtime.trainer"]  # runtime arms lifecycle: down
    graph["bert_ds.lifecycle.preemption"].add("bert_ds.runtime.trainer")  # lifecycle reaching up into the loop
    house = survey(graph)
    assert ("bert_ds.lifecycle.preemption", "bert_ds.runtime.trainer") in house.arrows_up
    assert any({"bert_ds.lifecycle.preemption", "bert_ds.runtime.trainer"} <= set(c) for c in house.cycles)
    assert not house.sound
    assert survey(import_graph(), order=[r for r in ROOMS if r[0] != "lifecycle"]).undeclared == ["lifecycle"]


def test_floors_are_the_longest_chain_inside_a_room():
    graph = {"p.r.a": {"p.r.b", "p.r.c"}, "p.r.b": {"p.r.c", "p.s"}, "p.r.c": set(), "p.s": set(), "p.r": {"p.r.a"}}
    house = survey(graph, order=[("p", ""), ("s", ""), ("r", "")])
    assert house.rooms["r"] == {"p.r": 3, "p.r.a": 2, "p.r.b": 1, "p.r.c": 0} and house.arrows_up == []
    assert survey(graph, order=[("p", ""), ("r", ""), ("s", "")]).arrows_up == [("p.r.b", "p.s")]


def test_the_house_tool_reads_a_package_on_disk_and_fails_on_an_arrow_up(tmp_path, capsys):
    """A package of two rooms, ``errors`` importing ``cli`` (declared above it), scanned from its files."""
    pkg = tmp_path / "bert_ds"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "exit_codes.py").write_text("X = 1\n")
    (pkg / "errors.py").write_text("from bert_ds import exit_codes\n")
    (pkg / "cli.py").write_text("from bert_ds.errors import *\n")
    assert main(["--root", str(pkg)]) == 0
    assert "0 import cycles, 0 arrows up" in capsys.readouterr().out
    (pkg / "errors.py").write_text("from bert_ds import exit_codes\n\ndef f():\n    from bert_ds import cli\n")
    assert main(["--root", str(pkg)]) == 1
    out = capsys.readouterr().out
    assert "1 import cycles, 1 arrows up" in out
    assert "arrow up: bert_ds.errors (errors) imports bert_ds.cli (cli)" in out


def test_safe_load_and_the_deepspeed_boundary_are_leaves():
    """The DeepSpeed boundary imports nothing of bert_ds but the error base (an unsupported DeepSpeed is the user's
    environment: BadInput); the safe loader imports only it (DeepSpeed's pickled classes) and the error base (its
    errors are bad input)."""
    graph = import_graph()
    assert graph["bert_ds.deepspeed_internals"] <= {"bert_ds.errors"}
    assert graph["bert_ds.safe_load"] <= {"bert_ds.deepspeed_internals", "bert_ds.errors"}


def test_the_front_door_machinery_is_a_floor_of_leaves():
    """Every command imports the errors and the argument generator, so they import nothing above them: the exit-code
    table and the argument generator import nothing of bert_ds, the errors only the table, the front door only the
    errors, the table and the argument generator (it parses and runs each command by name; each command's module
    imports it for its ``main``)."""
    graph = import_graph()
    assert graph["bert_ds.exit_codes"] == set() and graph["bert_ds.cli_args"] == set()
    assert graph["bert_ds.errors"] == {"bert_ds.exit_codes"}
    assert graph["bert_ds.cli"] <= {"bert_ds.errors", "bert_ds.exit_codes", "bert_ds.cli_args"}


# ---- resume reads the run directory through its owner ---------------------------------------------------------------

_RUN_DIR_FILES = re.compile(r"run_state|latest|rng_rank|zero_pp_rank|mp_rank_|optim_states|model_states|\.pt\b|"
                            r"phase\d+-step")
"""Names of files of the run directory (``bert_ds.checkpoint.layout``)."""
_RUN_DIR_READERS = {"read_run_state", "read_latest", "resolve_tag", "list_tags", "load_rng_state", "rng_file",
                    "load_tensor_file", "deepspeed_loads_weights_only", "consolidated_state_dict", "RUN_STATE_NAME"}
"""``bert_ds.checkpoint`` functions that read single files of a checkpoint: the owner's own building blocks."""


def run_dir_references(source: str, facts: tuple[str, ...] = ()) -> list[str]:
    """String constants naming a run directory file, checkpoint file readers, and ``torch.load`` calls in ``source``;
    the module-level constants named in ``facts`` are left out (DeepSpeed's file names, stated where its facts
    live)."""
    tree = ast.parse(source)
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in facts for t in node.targets):
            prose.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if id(node) in prose:  # docstrings may name files; code may not
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _RUN_DIR_FILES.search(node.value):
            found.append(repr(node.value))
        elif isinstance(node, ast.Attribute) and (node.attr in _RUN_DIR_READERS or node.attr == "load"
                                                  and isinstance(node.value, ast.Name) and node.value.id == "torch"):
            found.append(node.attr)
        elif isinstance(node, ast.alias) and node.name in _RUN_DIR_READERS:
            found.append(node.name)
    return found


@pytest.mark.parametrize(("module", "may_import", "facts"), [
    ("runtime/trainer.py", ("bert_ds.checkpoint",), ()),
    ("deepspeed_internals.py", (), ("MODEL_STATES_NAME", "ZERO_PARTITION_FILE"))])
def test_resume_reads_the_run_directory_through_its_owner(module, may_import, facts):
    """The trainer asks the owner (``restore_run``, ``open_handoff``, ``save_checkpoint``) and names no file of the
    run directory; the DeepSpeed internals module states the names DeepSpeed gives its files (``facts``) but gets
    what the owner has read, and imports neither it nor the loading machinery."""
    path = PACKAGE / module
    found = run_dir_references(path.read_text(encoding="utf-8"), facts)
    assert found == [], f"{module} reads run directory files itself: {found}"
    owners = ("bert_ds.checkpoint", "bert_ds.safe_load")
    assert sorted(n for n in _imports_of(path) if _under(n, owners) and not _under(n, may_import)) == []


def test_the_trainer_resumes_and_hands_off_through_the_checkpoint_package():
    source = (PACKAGE / "runtime" / "trainer.py").read_text(encoding="utf-8")
    assert "ckpt.restore_run(" in source and "ckpt.open_handoff(" in source
    # The scan above sees the old way: the trainer reading run_state.json and each rank's RNG file itself.
    old = ('saved_world = ckpt.read_run_state(plan.ckpt_dir, tag)["world_size"]\n'
           'rng_file = plan.ckpt_dir / tag / f"rng_rank{plan.rank:05d}.pt"\n')
    assert {"read_run_state", "'rng_rank'", "'.pt'"} <= set(run_dir_references(old))


def test_tools_do_not_import_tests():
    bad = {path.name: sorted(n for n in _imports_of(path) if _under(n, ("tests",)))
           for path in sorted((REPO / "tools").glob("*.py"))}
    assert {name: names for name, names in bad.items() if names} == {}


MAX_FUNCTION_LINES = 60
"""Issue 22: no function in bert_ds/ over 60 lines, counted from its ``def`` line to its last line (docstring
included)."""


def test_no_function_over_sixty_lines():
    import ast

    long = []
    for path in sorted((REPO / "bert_ds").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _redefined(source: str) -> list[str]:
    """Top-level functions and classes a module defines more than once (the later silently replaces the earlier
    for every caller, which ruff's F811 misses once the first is used)."""
    names = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef
                                                                    | ast.ClassDef)]
    return sorted({n for n in names if names.count(n) > 1})


def test_the_redefinition_scan_sees_one():
    assert _redefined("def _run(a, b):\n    pass\n\ndef f():\n    _run(1, 2)\n\ndef _run(a):\n    pass\n") == ["_run"]


def test_no_module_defines_a_name_twice():
    found = {str(p.relative_to(REPO)): names for p in sorted((REPO / "bert_ds").rglob("*.py"))
             if (names := _redefined(p.read_text(encoding="utf-8")))}
    assert found == {}, found


def _named_loggers(root: Path) -> list[str]:
    """``getLogger("<literal>")`` calls under ``root``: a module logging under a name not its own."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_module_logs_under_its_own_name(tmp_path):
    """A module logs as ``getLogger(__name__)``, so a log line names the module that wrote it; the scan sees a
    module that borrows another's name."""
    assert _named_loggers(PACKAGE) == []
    (tmp_path / "m.py").write_text('import logging\nlog = logging.getLogger("bert_ds.runtime.pretrain")\n')
    assert _named_loggers(tmp_path) == ["m.py:2"]
