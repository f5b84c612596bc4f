"""Every shell command in README.md and docs/*.md is checked as written: it parses, its programs exist, its flags exist.

Which fenced blocks are shell (the rule): a block labelled ``bash``, ``sh``, ``shell`` or ``console`` always is (in a
``console`` block only the lines after a ``$ `` prompt are commands); an unlabelled block is shell when its first
non-blank, non-comment line starts (after ``VAR=value`` prefixes) with a program this test knows (:data:`COMMAND_RE`:
``bert-ds-*``, ``python``, ``make``, ``deepspeed``, ``mpirun``, ``sbatch``, ``srun``, ``pip``, ``sudo``); every other
block (diagrams, printed output, JSON) is prose. Indented code blocks are not read: the docs use fenced blocks.

For each shell block: ``bash -n`` accepts it; each invocation of ``bert-ds-<name>`` (found through the installed
console-script entry points), ``python tools/X.py``, ``python -m bert_ds...``, a ``bert_ds/...py`` script under
``deepspeed``, and ``deepspeed`` itself exists, and every ``--flag`` written after it (up to the next program or
shell operator) appears in that program's ``--help`` (run once per program); ``make T`` names a Makefile target; the
repository paths a command names (``ds_configs/*.json``, ``slurm/*.sh``, ``tools/*.py``, ``.ci/*.sh``, ...) exist.
Anywhere in a document, a full repository path (``bert_ds/...py``, ``tests/...py``, ``ds_configs/...json``, ...) must
exist, and a command quoted inline in prose (a backticked span starting with ``bert-ds-``, ``python tools/``,
``python -m bert_ds`` or ``deepspeed``) gets the program and flag checks. Placeholders (``ARGS``, ``...``, ``NODE0``)
are words, not flags, so they pass.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 220  # issue 14: "README <= ~220 lines"

SHELL_LABELS = {"bash", "sh", "shell", "console"}
COMMAND_RE = re.compile(r"^(?:\$ )?(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*"
                        r"(?:bert-ds-[a-z-]+|python3?|\.venv/bin/python|make|deepspeed|mpirun|sbatch|srun|pip|sudo)\b")
PYTHONS = {"python", "python3", ".venv/bin/python", "$(PY)", "$PY"}
OPERATORS = {"&&", "||", ";", "|", "&", ";;", "(", ")", "|&"}
CONSOLE_SCRIPT_RE = re.compile(r"^bert-ds-[a-z0-9-]+$")
COMMAND_PATH_RE = re.compile(r"(?<![\w/.-])((?:ds_configs|slurm|tools|\.ci|docs)/[\w.-]+\.(?:json|sh|py|md))\b")
DOC_PATH_RE = re.compile(r"(?<![\w/.$-])((?:bert_ds|tests|ds_configs|slurm|tools|docs|\.ci)/[\w/.-]*[\w-]\."
                         r"(?:py|json|sh|md|cfg|toml))(?![\w/])")
MAKE_TARGET_RE = re.compile(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    label: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Invocation:
    """One program started by a command: ``kind`` is console, tool, module, script or deepspeed; ``first`` is its
    first positional argument (a subcommand when the program's --help lists it as one)."""

    kind: str
    name: str
    flags: tuple[str, ...]
    where: str
    first: str = ""


def fenced_blocks(path: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of a Markdown file, with its label and the line its fence opens on."""
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^\s*```(.*)$", lines[i])
        if not m:
            i += 1
            continue
        label, start, body = m.group(1).strip().lower(), i + 1, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        blocks.append(Block(path, start, label, "\n".join(body)))
        i += 1
    return blocks


def is_shell(block: Block) -> bool:
    """The rule in the module docstring."""
    if block.label in SHELL_LABELS:
        return True
    if block.label:
        return False
    first = next((ln.strip() for ln in block.text.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")
    return bool(COMMAND_RE.match(first))


def shell_text(block: Block) -> str:
    """The block's commands: the whole block, or for ``console`` the ``$ `` lines without the prompt."""
    if block.label != "console":
        return block.text
    return "\n".join(ln.strip()[2:] for ln in block.text.splitlines() if ln.strip().startswith("$ "))


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined (comments are dropped by the tokenizer)."""
    return text.replace("\\\n", " ").splitlines()


def tokens_of(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:  # unbalanced quotes: bash -n reports it
        return []


def invocations(tokens: list[str], where: str) -> list[Invocation]:
    """The programs a token list starts, each with the ``--flags`` written after it."""
    found: list[list] = []  # [kind, name, flags, first positional]
    current = None
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok in OPERATORS:
            current = None
        elif " " in tok:  # an argument holding a command: bash -c '...'
            found.extend([inv.kind, inv.name, list(inv.flags), inv.first] for inv in invocations(tokens_of(tok), where))
        elif CONSOLE_SCRIPT_RE.match(Path(tok).name) and "/" not in tok:
            current = ["console", tok, [], ""]
            found.append(current)
        elif tok in PYTHONS and re.match(r"^tools/\w+\.py$", nxt):
            current = ["tool", nxt, [], ""]
            found.append(current)
            i += 1
        elif tok in PYTHONS and nxt == "-m" and i + 2 < len(tokens):
            module = tokens[i + 2]
            current = ["module", module, [], ""] if module.startswith("bert_ds") else None
            if current:
                found.append(current)
            i += 2
        elif tok == "deepspeed":
            current = ["deepspeed", "deepspeed", [], ""]
            found.append(current)
        elif current is not None and current[0] == "deepspeed" and tok.endswith(".py"):
            current = ["script", tok, [], ""]
            found.append(current)
        elif re.match(r"^(slurm|\.ci)/[\w.-]+\.sh$", tok):
            current = None  # a batch script: what follows is its arguments, not the launcher's
        elif tok.startswith("--") and len(tok) > 2 and current is not None:
            current[2].append(tok.split("=", 1)[0])
        elif current is not None and not current[2] and not current[3] and re.match(r"^[a-z][a-z0-9-]*$", tok):
            current[3] = tok
        i += 1
    return [Invocation(k, n, tuple(f), where, first) for k, n, f, first in found]


def make_targets(tokens: list[str]) -> list[str]:
    targets = []
    for i, tok in enumerate(tokens):
        if tok == "make":
            for arg in tokens[i + 1:]:
                if arg in OPERATORS:
                    break
                if not arg.startswith("-") and "=" not in arg:
                    targets.append(arg)
    return targets


def _console_scripts() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group="console_scripts") if ep.name.startswith("bert-ds-")}


def help_command(kind: str, name: str, sub: str = "") -> list[str] | None:
    """The argv that prints ``--help`` for a program (or its subcommand), or None when the program does not exist."""
    argv = _program_argv(kind, name)
    return None if argv is None else [*argv, *([sub] if sub else []), "--help"]


def _program_argv(kind: str, name: str) -> list[str] | None:
    py = sys.executable
    if kind == "console":
        target = _console_scripts().get(name)
        if target is None:
            return None
        module, _, attr = target.partition(":")
        return [py, "-c", f"import sys; sys.argv[0] = {name!r}; from {module} import {attr} as main; "
                          f"sys.exit(main())"]
    if kind in ("tool", "script"):
        return [py, str(ROOT / name)] if (ROOT / name).is_file() else None
    if kind == "module":
        return [py, "-m", name]
    if kind == "deepspeed":
        exe = shutil.which("deepspeed", path=str(Path(py).parent)) or shutil.which("deepspeed")
        return [exe] if exe else None
    raise ValueError(kind)


_HELP: dict[tuple[str, ...], str | None] = {}


def help_texts(programs: set[tuple[str, ...]]) -> dict[tuple[str, ...], str | None]:
    """``--help`` output per (kind, name[, subcommand]) (None: it does not exist or its --help failed), each run once
    per session."""
    todo = [p for p in sorted(programs) if p not in _HELP]

    def run(program: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
        argv = help_command(*program)
        if argv is None:
            return program, None
        # A hang guard, not a speed check: --help imports torch (and deepspeed) on a loaded machine.
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
        return program, (proc.stdout + proc.stderr) if proc.returncode == 0 else None

    with ThreadPoolExecutor(max_workers=4) as pool:
        _HELP.update(pool.map(run, todo))
    return {p: _HELP[p] for p in programs}


def shell_blocks(path: Path, text: str | None = None) -> list[Block]:
    return [b for b in fenced_blocks(path, text) if is_shell(b)]


def document_problems(path: Path, text: str | None = None) -> list[str]:
    """Every problem the checks in the module docstring find in one document (empty: none)."""
    text = path.read_text(encoding="utf-8") if text is None else text
    problems: list[str] = []
    makefile_targets = set(MAKE_TARGET_RE.findall((ROOT / "Makefile").read_text()))
    calls: list[Invocation] = []
    for block in shell_blocks(path, text):
        body = shell_text(block)
        proc = subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            problems.append(f"{block.where}: bash -n: {proc.stderr.strip()}")
        for line in logical_lines(body):
            tokens = tokens_of(line)
            calls.extend(invocations(tokens, block.where))
            problems.extend(f"{block.where}: make target {t!r} is not in the Makefile"
                            for t in make_targets(tokens) if t not in makefile_targets)
            code = line.split(" #", 1)[0]
            problems.extend(f"{block.where}: {p} does not exist" for p in COMMAND_PATH_RE.findall(code)
                            if not (ROOT / p).exists())
    # Commands quoted inline in prose (`bert-ds-evaluate --kernels torch`): the same program and flag checks.
    prose = re.sub(r"(?ms)^\s*```.*?^\s*```\s*$", "", text)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if re.match(r"^(bert-ds-[a-z0-9-]+|python3? (tools/|-m bert_ds)|deepspeed )", span):
            calls.extend(invocations(span.split(), f"{path.relative_to(ROOT)}: `{span}`"))
    helps = help_texts({(c.kind, c.name) for c in calls})
    # A first positional argument the program's --help lists among its subcommands ({a,b}): check the flags
    # against that subcommand's --help.
    subs = {(c.kind, c.name, c.first) for c in calls
            if c.first and helps[(c.kind, c.name)] and re.search(rf"{{[^}}]*\b{re.escape(c.first)}\b[^}}]*}}",
                                                                  helps[(c.kind, c.name)])}
    helps.update(help_texts(subs))
    for call in calls:
        help_text = helps[(call.kind, call.name)]
        if help_text is None:
            problems.append(f"{call.where}: {call.name} ({call.kind}) is not installed or its --help fails")
            continue
        if (call.kind, call.name, call.first) in subs:
            help_text = helps[(call.kind, call.name, call.first)]
            if help_text is None:
                problems.append(f"{call.where}: {call.name} {call.first} --help fails")
                continue
        problems.extend(f"{call.where}: {call.name} has no flag {flag} (not in its --help)" for flag in call.flags
                        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text))
    problems.extend(f"{path.relative_to(ROOT)}: names {p}, which does not exist"
                    for p in sorted(set(DOC_PATH_RE.findall(text))) if not (ROOT / p).exists())
    return problems


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it <= {README_MAX_LINES}, detail in docs/"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_in_the_docs_runs_as_written(path):
    problems = document_problems(path)
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


def test_the_docs_have_commands_to_check():
    """The extraction rule finds the README's commands (a rule that found nothing would pass everything)."""
    blocks = shell_blocks(ROOT / "README.md")
    names = {c.name for b in blocks for ln in logical_lines(shell_text(b)) for c in invocations(tokens_of(ln), "")}
    assert {"bert-ds-convert-checkpoint", "bert-ds-finetune", "deepspeed", "bert_ds/runtime/pretrain.py"} <= names
    assert len(blocks) >= 5


def test_the_rule_for_unlabelled_blocks():
    doc = "```\nraw text -> shards\n```\n```\n# comment\nmake demo\n```\n```json\n{\"a\": 1}\n```\n"
    assert [b.label or is_shell(b) for b in fenced_blocks(ROOT / "README.md", doc)] == [False, True, "json"]


# Mutations: a made-up flag, program, target and path, and a syntax error, each reported (the checks can fail).
MUTANTS = {
    "flag": ("bert-ds-evaluate --checkpoint runs/x --data d/ --made-up-flag 3", "has no flag --made-up-flag"),
    "deepspeed flag": ("deepspeed --num_gpus 2 --no-such-launcher-flag bert_ds/runtime/pretrain.py --recipe r",
                       "deepspeed has no flag --no-such-launcher-flag"),
    "script flag": ("deepspeed --num_gpus 2 bert_ds/runtime/pretrain.py --recipe r --phases all",
                    "pretrain.py has no flag --phases"),
    "program": ("bert-ds-no-such-tool --help", "bert-ds-no-such-tool (console) is not installed"),
    "tool": ("python tools/no_such_tool.py --x", "tools/no_such_tool.py (tool) is not installed"),
    "target": ("make no-such-target", "make target 'no-such-target' is not in the Makefile"),
    "path": ("sbatch --nodes=2 slurm/pretrain_huge.sh", "slurm/pretrain_huge.sh does not exist"),
    "subcommand flag": ("python tools/bench_lamb.py state-bytes --preset base",
                        "tools/bench_lamb.py has no flag --preset"),
    "syntax": ("bert-ds-evaluate --checkpoint 'runs/x --data d/", "bash -n"),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_a_mutated_command_is_reported(name):
    command, expected = MUTANTS[name]
    good = "```bash\nbert-ds-evaluate --checkpoint runs/x --data d/ --batch-size 8\n```\n"
    assert document_problems(ROOT / "README.md", good) == []
    problems = document_problems(ROOT / "README.md", good + f"```bash\n{command}\n```\n")
    assert any(expected in p for p in problems), problems


def test_a_command_quoted_in_prose_is_checked():
    problems = document_problems(ROOT / "README.md", "Run `bert-ds-evaluate --kernelz torch` to pick kernels.\n")
    assert problems == ["README.md: `bert-ds-evaluate --kernelz torch`: bert-ds-evaluate has no flag --kernelz "
                        "(not in its --help)"]


def test_a_path_named_in_prose_must_exist():
    problems = document_problems(ROOT / "README.md", "The loader lives in `bert_ds/data/loaderz.py`.\n")
    assert problems == ["README.md: names bert_ds/data/loaderz.py, which does not exist"]


def test_the_readme_layout_is_the_package():
    """The README's layout block names every module of bert_ds/ and nothing that is not there."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = next(b.text for b in fenced_blocks(ROOT / "README.md", text) if b.text.startswith("bert_ds/\n"))
    package = ROOT / "bert_ds"
    named: set[str] = set()
    folder = None
    for line in layout.splitlines():
        m = re.match(r"^  ([a-z_]+)/\s+(.*)$", line) or (folder and re.match(r"^ {4,}()(\S.*)$", line))
        if m:
            folder, listed = m.group(1) or folder, m.group(2)
            for word in re.findall(r"[a-z_]+(?:\.py|/)?", re.sub(r"\([^)]*\)", "", listed)):
                named.add(f"{folder}/{word if word.endswith(('.py', '/')) else word + '.py'}")
        else:
            folder = None
            named.update(re.findall(r"\b([a-z_]+\.py)\b", line.split("  ", 2)[1] if line.startswith("  ") else ""))
    missing = sorted(n for n in named if not (package / n).exists())
    assert not missing, f"README layout names what bert_ds/ does not have: {missing}"
    actual = {p.relative_to(package).as_posix() for p in package.glob("*.py") if p.name != "__init__.py"}
    actual |= {p.relative_to(package).as_posix() for p in package.glob("*/*.py") if p.name != "__init__.py"}
    actual |= {p.relative_to(package).as_posix() + "/" for p in package.glob("*/*/") if p.name != "__pycache__"}
    unnamed = sorted(actual - named)
    assert not unnamed, f"README layout leaves out: {unnamed}"


def _readme_recipe_rows() -> dict[str, list[tuple[int, int, int, int, int, int, int, int]]]:
    """The README recipe table: recipe -> [(phase, seq, micro, gas, ranks, global, tokens/step, steps)]."""
    rows: dict[str, list] = {}
    name = None
    for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(cells) != 7 or not re.match(r"^\d", cells[2]):
            continue
        name = (re.match(r"^`(\w+)`", cells[0]).group(1)) if cells[0] else name

        def split(cell):
            return [part.strip() for part in cell.split(" / ")]

        phase_seq, batch, global_, tokens, steps = (split(c) for c in cells[2:])
        for ps, b, g, t, s in zip(phase_seq, batch, global_, tokens, steps, strict=True):
            phase, seq = (int(x) for x in re.findall(r"\d+", ps))
            micro, gas, ranks = (int(x) for x in b.split(" x "))
            numbers = (int(x.replace(",", "")) for x in (g, t, s))
            rows.setdefault(name, []).append((phase, seq, micro, gas, ranks, *numbers))
    return rows


def test_the_readme_recipe_table_is_the_recipes():
    """Every ds_configs/*.json has its rows, and each row's batch arithmetic is what bert_ds derives from the file."""
    from bert_ds.recipe import gradient_accumulation_steps, load_recipe

    rows = _readme_recipe_rows()
    recipes = {p.stem: load_recipe(p) for p in sorted((ROOT / "ds_configs").glob("*.json"))}
    assert set(rows) == set(recipes), f"README table {sorted(rows)} vs ds_configs {sorted(recipes)}"
    for name, recipe in recipes.items():
        expected = []
        for number, phase in enumerate(recipe.phases, 1):
            ranks = next(r[4] for r in rows[name] if r[0] == number)
            expected.append((number, phase.seq_len, phase.micro_batch_size,
                             gradient_accumulation_steps(phase, ranks), ranks, phase.global_batch_size,
                             phase.global_batch_size * phase.seq_len, phase.steps))
        assert sorted(rows[name]) == expected, name
