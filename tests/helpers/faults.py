"""The harness of the fault and bad-input table (``tests/faults/test_fault_table.py``): a :class:`Case` record, the
commands it may run (``bert_ds.runtime.pretrain`` on real DeepSpeed CPU ranks, the ``tools/`` CLIs), a fault injected
while the command runs (a :class:`Trigger` fired by an output line), the exit measured, survivors of the process tree
found, and one markdown row per case appended to ``$BERT_DS_FAULT_REPORT``. :func:`run_row` runs and checks a row
for every table (``tests/faults/test_fault_table*.py``).

The table's recipe is the shipped ``ds_configs/tiny_cpu.json`` (dropout 0.1, ZeRO-2, LAMB, two phases) with only the
run length and intervals cut (:func:`fault_recipe`), so a whole run takes seconds on two CPU ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.helpers import HANG_GUARD_S, child_env, environ
from tests.helpers.ranks import REPO, spawn_ranks

TINY_CPU = REPO / "ds_configs" / "tiny_cpu.json"
REPORT_ENV = "BERT_DS_FAULT_REPORT"
ERROR_LINE = r"^(bert_ds\.runtime\.pretrain: error: |error: |bert-ds-[a-z-]+: error: |verification failed: )"
"""How the first line of a refusal starts, for every CLI the table runs (``tools/verify_shards.py`` excepted: its
lines start with the shard set, see the cases)."""
ORPHAN_GRACE_S = 60.0
"""How long the command's processes may take to exit after it did; anything alive after this is an orphan. A
DataLoader worker notices its rank is gone within torch's 5 s status poll (``MP_STATUS_CHECK_INTERVAL``) and then
exits, which on a loaded 2-core machine can take several seconds more. A real orphan -- a rank left training or blocked
in a collective -- lives until its process group times out (DeepSpeed's default 10 minutes, ``default_pg_timeout``),
10x this grace. The wait ends as soon as every process is gone, so a passing case never pays it."""

# Run length of the table's recipe: 6 + 2 steps, a checkpoint every 2 (phase 1) and every step (phase 2), evaluation
# (when --eval-data is given) at the same points, a console line every step so triggers can fire on "step N |".
PHASE1_STEPS, PHASE2_STEPS = 6, 2
FINAL_TAG = f"phase2-step{PHASE2_STEPS:06d}"
PHASE1_END = f"phase1-step{PHASE1_STEPS:06d}"


def fault_recipe(path: Path, **changes) -> Path:
    """``tiny_cpu.json`` (dropout 0.1 from the tiny preset, ZeRO-2, LAMB, 2 phases, keep_last_k 2) with phase 1 cut
    to 6 steps and phase 2 to 2, logging every step; ``changes`` are applied to the result as ``dotted.key=value``
    (``phases.0.lr`` addresses a phase)."""
    recipe = json.loads(TINY_CPU.read_text())
    recipe["logging"]["interval"] = 1
    recipe["phases"][0].update(steps=PHASE1_STEPS, checkpoint_interval=2, eval_interval=2)
    recipe["phases"][1].update(steps=PHASE2_STEPS, checkpoint_interval=1, eval_interval=1)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = recipe
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        node[leaf] = value
    path.write_text(json.dumps(recipe, indent=1))
    return path


def train_fault_run(root: Path, s128: Path, s512: Path, tokenizer: Path, *extra: str) -> Path:
    """``root/run``: :func:`fault_recipe` (as ``root/recipe.json``) trained on 2 DeepSpeed CPU ranks with ``extra``
    flags, asserted to exit 0. The ranks are spawned directly (:func:`~tests.helpers.ranks.spawn_ranks`): this run
    is what a case starts from or compares with; the cases' own commands go through ``bert-ds deepspeed``."""
    args = ["--recipe", str(fault_recipe(root / "recipe.json")), "--data", str(s128), str(s512), "--tokenizer",
            str(tokenizer), "--output", str(root / "run"), *extra]
    spawn_ranks(2, args, check=True)
    return root / "run"


def tool_cmd(script: str, args: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "tools" / script), *args]


def _rank_of(proc: psutil.Process) -> int | None:
    """The local rank a ``bert_ds.runtime.pretrain`` process runs as (``--local_rank=N`` from the deepspeed launcher;
    a bare ``python -m bert_ds.runtime.pretrain`` is rank 0), or None."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return None
    if "bert_ds.runtime.pretrain" in cmd:
        return 0
    if any(a.endswith("pretrain.py") for a in cmd):
        return next((int(a.split("=", 1)[1]) for a in cmd if a.startswith("--local_rank=")), None)
    return None


def ranks(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """The launcher's live rank processes by local rank. A DataLoader worker is forked from its rank and shows the
    same command line: it is told apart by its parent being a rank."""
    found = {}
    for proc in [launcher, *launcher.children(recursive=True)]:
        rank = _rank_of(proc)
        try:
            parent = proc.parent()
        except psutil.Error:
            continue
        if rank is not None and (parent is None or _rank_of(parent) is None):
            found[rank] = proc
    return found


def kill_rank(rank: int, sig: int = signal.SIGKILL) -> Callable[[psutil.Process], str]:
    def act(launcher: psutil.Process) -> str:
        target = ranks(launcher)[rank]
        target.send_signal(sig)
        return f"{signal.Signals(sig).name} to rank {rank} (pid {target.pid})"
    return act


def signal_every_rank(sig: int) -> Callable[[psutil.Process], str]:
    """What ``srun --signal`` / a Slurm pre-emption does: the signal reaches every rank process."""
    def act(launcher: psutil.Process) -> str:
        targets = ranks(launcher)
        for proc in targets.values():
            proc.send_signal(sig)
        return f"{signal.Signals(sig).name} to ranks {sorted(targets)}"
    return act


def kill_loader_worker(rank: int) -> Callable[[psutil.Process], str]:
    """SIGKILL the DataLoader worker process(es) of one rank (what the kernel's OOM killer does to a worker)."""
    def act(launcher: psutil.Process) -> str:
        workers = ranks(launcher)[rank].children()
        for worker in workers:
            worker.kill()
        return f"SIGKILL to rank {rank}'s loader worker(s) {[w.pid for w in workers]}"
    return act


@dataclass
class FaultContext:
    """What every fault-table case works in: its directory, the pytest request, the session's shard sets and
    tokenizer; each table's ``Ctx`` adds its own fields."""

    tmp: Path
    request: object
    """The test's ``pytest.FixtureRequest`` (for fixtures a case needs only sometimes)."""
    s128: Path
    s512: Path
    tokenizer: Path
    culprit: str = ""
    """What the message must name, set by the setup (a shard, a member, a file); ``{culprit}`` in a case's regex."""

    @property
    def run(self) -> Path:
        return self.tmp / "run"

    @property
    def recipe(self) -> Path:
        path = self.tmp / "recipe.json"
        return path if path.exists() else fault_recipe(path)


@dataclass(frozen=True)
class FaultCase:
    """One row of a fault table (every table uses this type): what is broken, the command its ``setup`` returns, the
    exit code and first message line expected, and a ``check`` that nothing was lost."""

    id: str
    item: str
    """The issue's numbered item, "also" (its Also list) or "input" (bad input)."""
    broken: str
    setup: Callable
    """``setup(ctx) -> Launch``: prepares the fault and names the command."""
    exit_code: int = 2
    message: str | None = None
    """Regex the first line of the message must match (``{culprit}``: the escaped ``ctx.culprit``); None: no error
    line at all."""
    check: Callable | None = None
    """``check(ctx, outcome) -> str``: asserts that nothing was lost; returns what it verified, for the report."""
    first_line: str = ERROR_LINE
    """Which output line is the first of the message."""
    marks: tuple = ()
    """pytest marks of the row."""
    level: str = "launched"
    """``launched``: the command runs for real (ranks under ``bert-ds deepspeed``, a tool in its own interpreter; an
    ``e2e`` test). ``in-process``: a refusal pre-flight decides (:func:`decide_in_process`) or a tool's ``main``
    (:func:`call_in_process`), in this process without ranks: the default tier, unless what the row sets up needs a
    trained checkpoint (``marks`` then holds ``e2e``)."""


@dataclass(frozen=True)
class Trigger:
    """Fire ``action(launcher)`` once, on the first output line matching ``pattern``."""

    pattern: str
    action: Callable[[psutil.Process], str]


@dataclass(frozen=True)
class Launch:
    """One command of a case; ``preexec`` runs in the child before exec (resource limits)."""

    cmd: list[str]
    trigger: Trigger | None = None
    env: dict[str, str] = field(default_factory=dict)
    preexec: Callable[[], None] | None = None


@dataclass
class Outcome:
    returncode: int
    seconds: float
    """From the fault (the trigger firing) or, without a trigger, from the start, to the command's exit."""
    lines: list[str]
    """stdout and stderr, interleaved as written."""
    fault: str | None
    """What the trigger did, or None when it never fired."""
    survivors: list[str]
    """Processes of the command's tree still alive ``ORPHAN_GRACE_S`` after it exited (killed by the harness)."""

    def text(self) -> str:
        return "".join(self.lines)

    def first_line(self, pattern: str) -> str | None:
        return next((ln.rstrip("\n") for ln in self.lines if re.search(pattern, ln)), None)


def _tree(root: psutil.Process) -> dict[int, psutil.Process]:
    try:
        return {p.pid: p for p in root.children(recursive=True)}
    except psutil.Error:
        return {}


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap_survivors(seen: dict[int, psutil.Process]) -> list[str]:
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while time.monotonic() < deadline and any(_alive(p) for p in seen.values()):
        time.sleep(0.2)
    survivors = []
    for pid, proc in seen.items():
        if _alive(proc):
            survivors.append(f"pid {pid} {' '.join(proc.cmdline())[:120]}")
            proc.kill()  # a process this test started: do not leave it to the next case
    return survivors


def execute(launch: Launch, timeout: float = HANG_GUARD_S) -> Outcome:
    """Run ``launch`` to its exit, firing its trigger on the way; every process of its tree is watched so that a
    survivor of the exit is reported (and killed)."""
    env = child_env(**launch.env)
    start = time.monotonic()
    proc = subprocess.Popen(launch.cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", preexec_fn=launch.preexec)
    root = psutil.Process(proc.pid)
    lines: list[str] = []
    seen: dict[int, psutil.Process] = {}
    fired: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            seen.update(_tree(root))
            trigger = launch.trigger
            if trigger and not fired and re.search(trigger.pattern, line):
                seen.update(_tree(root))
                fired.append((time.monotonic(), trigger.action(root)))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        returncode = proc.wait()
    end = time.monotonic()
    survivors = _reap_survivors(seen)
    reader.join(timeout=30)
    t0, fault = fired[0] if fired else (start, None)
    return Outcome(returncode=returncode, seconds=end - t0, lines=lines, fault=fault, survivors=survivors)


IN_PROCESS, LAUNCHED = "in-process", "launched"


def _pretrain_at(cmd: list[str]) -> int | None:
    """Where the pre-training script or module stands in ``cmd`` (None: not a pre-training command)."""
    return next((i for i, a in enumerate(cmd) if a.endswith("pretrain.py") or a == "bert_ds.runtime.pretrain"), None)


def _pretrain_argv(cmd: list[str]) -> tuple[int, list[str]]:
    """(ranks, pretrain arguments) of a :func:`~tests.helpers.ranks.rank_command`."""
    at = _pretrain_at(cmd)
    assert at is not None, f"not a pre-training command: {cmd}"
    ranks = int(cmd[cmd.index("--num_gpus") + 1]) if "--num_gpus" in cmd else 1
    return ranks, cmd[at + 1:]


def decide_in_process(launch: Launch) -> Outcome:
    """What the ranks of ``launch`` (a pre-training command) would decide before joining a process group, decided
    here: ``bert_ds.runtime.pretrain.preflight`` as each rank, with ``launch.env``; the first refusal becomes the
    outcome (its exit code and the one line ``run_main`` writes). A command pre-flight accepts is an error: its row
    must be launched."""
    import io

    from bert_ds.errors import error_lines, exit_code_of
    from bert_ds.runtime.pretrain import PROG, preflight

    assert launch.trigger is None and launch.preexec is None, "a trigger or preexec needs a launch"
    ranks, argv = _pretrain_argv(launch.cmd)
    start, stderr = time.monotonic(), io.StringIO()
    with environ(**launch.env):
        for rank in range(ranks):
            try:
                with contextlib.redirect_stderr(stderr):
                    preflight(argv, rank, ranks)
            except SystemExit as exc:  # argparse's refusal: its usage and error lines are already on stderr
                return Outcome(int(exc.code), time.monotonic() - start, stderr.getvalue().splitlines(True), None, [])
            except Exception as exc:
                code = exit_code_of(exc)
                if code is None:
                    raise
                lines = (stderr.getvalue() + error_lines(PROG, str(exc))).splitlines(True)
                return Outcome(int(code), time.monotonic() - start, lines, None, [])
    raise AssertionError(f"pre-flight accepted {argv} on all {ranks} rank(s): this row needs level={LAUNCHED!r}")


def tool_main(cmd: list[str]) -> tuple[Callable[[list[str]], int | None], list[str]]:
    """(the ``main`` a tool command runs, its arguments): ``python tools/X.py ARGS`` (the module the thin script
    imports ``main`` from) or a ``bert-ds-NAME ARGS`` console script (its setup.cfg entry point)."""
    import importlib
    import importlib.metadata

    if len(cmd) > 1 and cmd[1].endswith(".py") and Path(cmd[1]).parent == REPO / "tools":
        found = re.search(r"^from (\S+) import main$", Path(cmd[1]).read_text(), re.MULTILINE)
        assert found, f"{cmd[1]}: not a thin CLI over a module's main"
        return importlib.import_module(found.group(1)).main, cmd[2:]
    name = Path(cmd[0]).name
    points = importlib.metadata.entry_points(group="console_scripts", name=name)
    assert points, f"{cmd[0]}: not a bert_ds console script"
    return next(iter(points)).load(), cmd[1:]


def call_in_process(launch: Launch) -> Outcome:
    """A tool command (not ranks) run as ``main(argv)`` in this process, with ``launch.env``: its exit status (a
    ``SystemExit`` from argparse included) and what it wrote to stdout, stderr and the root logger, interleaved.
    What a console script adds around ``main`` (``sys.exit``) is proven by the launched rows and
    tests/test_console_scripts.py."""
    import io
    import logging

    assert launch.trigger is None and launch.preexec is None, "a trigger or preexec needs a launch"
    body, argv = tool_main(launch.cmd)
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    start = time.monotonic()
    try:
        with environ(**launch.env), contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                code = body(argv)
            except SystemExit as exc:
                code = exc.code
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    code = 0 if code is None else code if isinstance(code, int) else 1
    return Outcome(int(code), time.monotonic() - start, buffer.getvalue().splitlines(True), None, [])


def in_process(launch: Launch) -> Outcome:
    """``launch`` decided without starting a process: a pre-training command by pre-flight
    (:func:`decide_in_process`), a tool by its ``main`` (:func:`call_in_process`)."""
    if _pretrain_at(launch.cmd) is not None:
        return decide_in_process(launch)
    return call_in_process(launch)


def run(case: FaultCase, launch: Launch) -> Outcome:
    """The row's command, at its level."""
    return in_process(launch) if case.level == IN_PROCESS else execute(launch)


def limit_memory(limit_bytes: int) -> Callable[[], None]:
    """``preexec_fn`` capping the address space (RLIMIT_AS): a run that needs more fails instead of swapping."""
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return apply


def limit_file_size(limit_bytes: int) -> Callable[[], None]:
    """``preexec_fn`` capping every file the command (and its ranks: limits are inherited) writes: a write past it
    fails with EFBIG, as on a full disk (SIGXFSZ ignored, which exec keeps)."""
    def apply() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def tree_bytes(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256 of its content): the list and the bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ---- shard surgery ----------------------------------------------------------------------------------------------

def patch_file(path: Path, offset: int, value: bytes) -> None:
    """Overwrite bytes in place (the file's size is unchanged, so only content checks can see it)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value)


def rehash(shard_dir: Path, shard_name: str) -> None:
    """Write ``shard_name``'s real sha256 into ``index.json``: the corruption then passes every checksum."""
    index_path = shard_dir / "index.json"
    index = json.loads(index_path.read_text())
    digest = hashlib.sha256((shard_dir / shard_name).read_bytes()).hexdigest()
    for entry in index["shards"]:
        if entry["name"] == shard_name:
            entry["sha256"] = digest
    index_path.write_text(json.dumps(index, indent=1))


@dataclass(frozen=True)
class Member:
    """Where one sample's ``.pair`` record lies in its shard file."""

    shard: str
    name: str
    offset: int
    length: int
    predictions: int


def first_member(shard_dir: Path, recipe: Path, phase: int = 0, world_size: int = 2) -> Member:
    """The record rank 0 reads first in ``phase`` of a run of ``recipe`` on ``world_size`` ranks (the loader's order
    is a function of the recipe seed and the phase only)."""
    from bert_ds.data.loader import build_loader
    from bert_ds.data.reader import ShardReader
    from bert_ds.recipe import load_recipe

    loaded = load_recipe(recipe)
    ph = loaded.phases[phase]
    loader = build_loader(shard_dir, global_batch_size=ph.global_batch_size, micro_batch_size=ph.micro_batch_size,
                          rank=0, world_size=world_size, seed=loaded.seed + phase, num_workers=0, verify="size",
                          shuffle_window_shards=ph.shuffle_window_shards)
    reader = ShardReader(shard_dir, verify="size")
    shards, indices = reader.locate(loader.sample_ids(0)[:1])
    shard, index = int(shards[0]), int(indices[0])
    handle = reader.open(shard)
    sample = reader.sample(shard, index)
    member = Member(shard=reader.shard_path(shard)[0].name, name=handle.members.names[index],
                    offset=int(handle.members.offsets[index]), length=sample.length,
                    predictions=len(sample.masked_positions))
    reader.close()
    return member


# ---- the report ----------------------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def report_row(case_id: str, item: str, outcome: Outcome, message: str | None, lost: str) -> None:
    """Append the case's row to ``$BERT_DS_FAULT_REPORT`` (a markdown table; header written first)."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    import fcntl

    with open(path, "a", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # test processes running side by side (pytest -n) append to one table
        if os.fstat(f.fileno()).st_size == 0:
            f.write("| case | item | exit | s to exit | first line of the message | what was lost |\n"
                    "|---|---|---|---|---|---|\n")
        f.write(f"| {_cell(case_id)} | {_cell(item)} | {outcome.returncode} | {outcome.seconds:.1f} | "
                f"`{_cell(message or '(none)')}` | {_cell(lost)} |\n")


ANY_ERROR = rf"{ERROR_LINE}|\berror: "
"""An error line anywhere in the output: a CLI's refusal, or ``error:`` inside another tool's line."""


def run_row(case: FaultCase, ctx, *, fields: Callable[[object], dict[str, str]] | None = None,
            one_error: bool = False, tracebacks: bool = False) -> Outcome:
    """The one runner of every fault table's rows: run ``case`` (:func:`run`) in ``ctx`` (the table's context, whose
    ``culprit`` the message must name) and check the exit code; the message (the first line matching
    ``case.first_line``, or with ``one_error`` the first :data:`ANY_ERROR` line, which must then be the only distinct
    one) against ``case.message`` with ``{culprit}`` (escaped) and ``fields(ctx)`` (regex text, read after the setup
    ran) filled in, or no error line at all when ``case.message`` is None; no Traceback unless ``tracebacks``; no
    survivors; then ``case.check``. The row goes to the report (:func:`report_row`) whatever failed."""
    out = run(case, case.setup(ctx))
    errors = [ln.rstrip("\n") for ln in out.lines if re.search(ANY_ERROR, ln)]
    message = (errors[0] if errors else None) if one_error else out.first_line(case.first_line)
    lost = "not checked (an assertion above failed)"
    try:
        assert out.returncode == case.exit_code, f"exit {out.returncode}\n{out.text()[-5000:]}"
        if case.message is None:
            assert not errors, errors
        else:
            pattern = case.message.replace("{culprit}", re.escape(ctx.culprit))
            for key, value in (fields(ctx) if fields else {}).items():
                pattern = pattern.replace(f"{{{key}}}", value)
            assert message is not None, f"no line matches {case.first_line!r}\n{out.text()[-5000:]}"
            assert re.search(pattern, message), f"{message!r} does not match {pattern!r}"
            assert not one_error or len(set(errors)) == 1, f"more than one distinct error line: {errors}"
        assert tracebacks or "Traceback" not in out.text(), out.text()[-5000:]
        assert not out.survivors, f"processes outlived the command: {out.survivors}"
        lost = case.check(ctx, out)
    finally:
        report_row(case.id, case.item, out, message, lost)
    return out
