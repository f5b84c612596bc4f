"""The house plan of ``bert_ds``: its rooms, their floors, its import cycles and its arrows up, from a static scan.

    python -m bert_ds.devtools.house [--root PATH/bert_ds]

A room is a subpackage (``runtime/``, ``lifecycle/``, ...) or a top-level module (``errors.py``, ...). Every import
counts, at module level or inside a function (a lazy import only hides a dependency), read from the source with
:mod:`ast`, nothing imported. A module's floor is the longest chain of imports inside its room below it: 0 for a module
that imports nothing of its own room. An import cycle is a strongly connected set of modules (Tarjan). An arrow up is
an import from a room to a room declared above it in :data:`ROOMS`. Exit 0 when the house has no cycle, no arrow up
and no room missing from :data:`ROOMS`; 1 otherwise. ``tests/test_imports.py`` holds ``bert_ds`` to that.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bert_ds.cli_args import build_parser, option, parse

__all__ = ["ROOMS", "House", "HouseArgs", "from_base", "import_cycles", "import_graph", "main", "module_name",
           "room_of", "survey"]

PACKAGE = Path(__file__).resolve().parents[1]

ROOMS: tuple[tuple[str, str], ...] = (
    ("bert_ds", "the package's face (its version): imports nothing"),
    ("exit_codes", "the exit-code table every command ends with: imports nothing"),
    ("errors", "typed errors carry their exit code; the one error writer: only the table below it"),
    ("cli_args", "command lines generated from dataclasses, used by every command: imports nothing of ours"),
    ("cli", "the front door: a table of commands by module name, imported only when one runs, so every command "
            "takes its main from it (an alias): it imports only the argument and error floors"),
    ("deepspeed_internals", "every DeepSpeed-version fact, a leaf, so nothing else reads DeepSpeed's private state"),
    ("safe_load", "allow-listed torch.load for every checkpoint file: DeepSpeed's pickled classes and the errors"),
    ("config", "the model's shape in Hugging Face's BertConfig names"),
    ("kernels", "fused ops the model may call: they know only the model's shape"),
    ("model", "single-device BERT on the kernels; no DeepSpeed, no export"),
    ("data", "text -> shards -> batches; it knows no model"),
    ("optim", "LAMB, clipping and schedules over parameters"),
    ("recipe", "what a training is (model, optimizer, phases, DeepSpeed settings): may name anything below it"),
    ("checkpoint", "owns the run directory: writes and reads it, for everything above"),
    ("export", "a checkpoint as a Hugging Face model, verified"),
    ("evaluate", "held-out MLM/NSP accuracy of a checkpoint"),
    ("lifecycle", "the process around a rank: supervisors, hostfiles, signals, the hang watchdog, how a rank ends"),
    ("runtime", "what runs on every rank: pre-flight, engine, step loop; it arms what lifecycle provides"),
    ("downstream", "fine-tuning and features on exported models"),
    ("devtools", "tooling beside the product: demo, GPU checks, benchmarks, this plan"),
)
"""The declared room order, bottom to top, with why each room sits where it does. A room may import the rooms below
it; an import of a room above it is an arrow up."""


@dataclass(frozen=True)
class HouseArgs:
    root: str = option(str(PACKAGE), help="the bert_ds package directory to survey (default: this one)",
                       metavar="PATH")


def module_name(path: Path, root: Path) -> str:
    """``bert_ds.runtime.trainer`` for ``root/runtime/trainer.py``; a package's ``__init__`` is the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def from_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` in ``package`` reads from, relative levels resolved."""
    base = node.module or ""
    if node.level:
        parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
        base = f"{parent}.{base}" if base else parent
    return base


def _targets(tree: ast.AST, package: str, longest_module) -> set[str]:
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(longest_module(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if longest_module(sub) == sub else longest_module(base))
    return targets


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Package module -> the package's modules it imports, at module level or inside functions. ``from P import x`` is
    an edge to ``P.x`` when that is a module, else to ``P`` (a package's ``__init__`` when ``P`` is one); ``import
    a.b.c`` to the longest module it names. Parent packages that a submodule import runs implicitly are not edges:
    every package whose ``__init__`` re-exports its modules would look cyclic."""
    root = Path(root)
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(p, root) for p in paths}

    def longest_module(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for path in paths:
        me = module_name(path, root)
        package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[me] = _targets(tree, package, longest_module) - {"", me}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def room_of(module: str) -> str:
    """``runtime`` for ``bert_ds.runtime.trainer``, ``errors`` for ``bert_ds.errors``, ``bert_ds`` for the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def floors(modules: Sequence[str], graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor in its room: the longest chain of imports inside the room below it (an import that closes
    a cycle ends the chain: the cycle is reported on its own)."""
    inside = set(modules)
    found: dict[str, int] = {}

    def floor(m: str, path: frozenset[str]) -> int:
        if m not in found:
            found[m] = max((floor(t, path | {m}) + 1 for t in graph[m] & inside if t not in path | {m}), default=0)
        return found[m]

    for m in sorted(modules):
        floor(m, frozenset())
    return found


@dataclass(frozen=True)
class House:
    rooms: dict[str, dict[str, int]]
    """room -> module -> floor."""
    cycles: list[list[str]]
    arrows_up: list[tuple[str, str]]
    """(importer, imported): the imported module's room is declared above the importer's."""
    undeclared: list[str]
    """Rooms the package has that :data:`ROOMS` does not place."""

    @property
    def sound(self) -> bool:
        return not (self.cycles or self.arrows_up or self.undeclared)


def survey(graph: dict[str, set[str]], order: Sequence[tuple[str, str]] = ROOMS) -> House:
    """The house ``graph`` (from :func:`import_graph`) builds, against the room order ``order``."""
    rank = {room: i for i, (room, _) in enumerate(order)}
    members: dict[str, list[str]] = {}
    for m in graph:
        members.setdefault(room_of(m), []).append(m)
    rooms = {room: floors(ms, graph) for room, ms in members.items()}
    arrows = sorted((m, t) for m, ts in graph.items() for t in ts
                    if room_of(m) in rank and room_of(t) in rank and rank[room_of(t)] > rank[room_of(m)])
    return House(rooms, import_cycles(graph), arrows, sorted(set(members) - set(rank)))


def _short(module: str) -> str:
    return module.split(".", 2)[2] if module.count(".") >= 2 else "__init__"


def render(house: House, order: Sequence[tuple[str, str]] = ROOMS) -> str:
    """The plan as text: a summary line, the rooms top to bottom with their floors, then cycles and arrows up."""
    modules = sum(len(r) for r in house.rooms.values())
    lines = [f"bert_ds house: {len(house.rooms)} rooms, {modules} modules, {len(house.cycles)} import cycles, "
             f"{len(house.arrows_up)} arrows up"]
    placed = [room for room, _ in order if room in house.rooms] + house.undeclared
    why = dict(order)
    for room in reversed(placed):
        floor_of = house.rooms[room]
        top = max(floor_of.values())
        reason = why.get(room, "NOT IN THE ROOM ORDER")
        if len(floor_of) == 1:
            lines.append(f"  {room}: {reason}")
            continue
        lines.append(f"  {room}/ ({len(floor_of)} modules, {top + 1} floors): {reason}")
        for level in range(top, -1, -1):
            names = sorted(_short(m) for m, f in floor_of.items() if f == level)
            lines.append(f"      floor {level}: {', '.join(names)}")
    lines += [f"  cycle: {' <-> '.join(c)}" for c in house.cycles]
    lines += [f"  arrow up: {a} ({room_of(a)}) imports {b} ({room_of(b)})" for a, b in house.arrows_up]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the plan; exit 0 for a sound house, 1 for one with a cycle, an arrow up or an undeclared room."""
    parser = build_parser(HouseArgs, "python -m bert_ds.devtools.house", __doc__.split("\n\n")[0])
    args = parse(HouseArgs, parser, argv)
    root = Path(args.root)
    if not (root / "__init__.py").is_file():
        parser.error(f"--root {args.root}: not a package directory (no __init__.py)")
    house = survey(import_graph(root))
    sys.stdout.write(render(house))
    return 0 if house.sound else 1


if __name__ == "__main__":
    sys.exit(main())
