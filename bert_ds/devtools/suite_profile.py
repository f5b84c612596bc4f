"""Where a test suite's CPU goes: every process it starts, by kind and by the test that started it (Linux ``/proc``).

``python -m bert_ds.devtools.suite_profile [--json FILE] -- python -m pytest ...`` runs the command and, every
``--interval`` seconds, reads each process's CPU time (user + system, ``/proc/<pid>/stat``), its command line, and
the ``PYTEST_CURRENT_TEST`` it was started with (``/proc/<pid>/environ``; a process without one is charged to its
nearest ancestor that has one). A process is sorted into a kind by its command line (a rank, DeepSpeed's runner or
``launch.py``, the supervisor, a compiler, a pytest worker, another Python program). The report lists CPU seconds
per kind and per test, heaviest first; with ``--json`` every process is written out too.

It samples, so it undercounts: a process that lives less than one interval is never seen, and each process's last
interval is lost; CPU of processes already running at the start is counted from the start only. It is a map of
where time goes, not a meter: compare two runs by the same tool on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Proc", "kind_of", "main", "profile", "report", "charged_test"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_KINDS = (  # first match wins: (kind, regex on the command line)
    ("pytest-worker", r"import sys;exec\(eval\(sys\.stdin"),
    ("supervisor", r"bert_ds\.lifecycle\.supervise|bert-ds-deepspeed|bert-ds-mpirun"),
    ("ds-runner", r"deepspeed\.launcher\.runner|/bin/deepspeed\b"),
    ("ds-launch", r"deepspeed\.launcher\.launch\b"),
    # bert_ds's own test suite forks its spawned ranks from tests.helpers.rank_zygote: they carry its command line
    # and its environment, so they are charged to no test
    ("rank", r"bert_ds/runtime/pretrain\.py|bert_ds\.runtime\.pretrain|bert-ds-pretrain|tests\.helpers\.rank_zygote"),
    ("compiler", r"^\S*(cc1plus|g\+\+|gcc|c\+\+|clang\S*|ld|as|collect2|ptxas|nvdisasm)\b"),
    ("mpi", r"^\S*(mpirun|orterun|prterun|prted|orted)\b"),
    ("python", r"^\S*python[\d.]*\b|/\.venv/bin/"),
)


@dataclass
class Proc:
    pid: int
    ppid: int
    argv: str
    test: str
    """``PYTEST_CURRENT_TEST`` of the process's environment at its first sighting ("" when unset)."""
    cpu_s: float
    """CPU seconds seen (user + system), from the first sighting when the process predates the profile."""
    base_s: float = 0.0


def kind_of(argv: str) -> str:
    """The kind of a process from its command line (``_KINDS``), ``other`` when none matches."""
    return next((kind for kind, pattern in _KINDS if re.search(pattern, argv)), "other")


def _read(pid: str) -> tuple[int, int, float] | None:
    """(start time in ticks, parent pid, CPU seconds) of ``pid``, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[19]), int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


def _describe(pid: str) -> tuple[str, str]:
    """(command line, PYTEST_CURRENT_TEST) of ``pid``; empty strings for what cannot be read."""
    argv = test = ""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"PYTEST_CURRENT_TEST="):
                    test = item.split(b"=", 1)[1].decode(errors="replace")
    except OSError:
        pass
    return argv, test


def _scan(seen: dict[tuple[int, int], Proc], first: bool) -> None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        got = _read(pid)
        if got is None:
            continue
        start, ppid, cpu = got
        proc = seen.get((int(pid), start))
        if proc is None:
            argv, test = _describe(pid)
            proc = seen[(int(pid), start)] = Proc(int(pid), ppid, argv, test, 0.0, cpu if first else 0.0)
        proc.cpu_s = cpu - proc.base_s


def profile(cmd: list[str], interval: float = 0.5) -> tuple[int, list[Proc]]:
    """Run ``cmd`` to its end, sampling every process on the machine each ``interval`` seconds; returns its exit code
    and the processes seen (those running before it started, from their CPU at that moment)."""
    if not Path("/proc/self/stat").exists():
        raise OSError("suite_profile reads /proc: Linux only")
    seen: dict[tuple[int, int], Proc] = {}
    _scan(seen, first=True)
    child = subprocess.Popen(cmd)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval):
            _scan(seen, first=False)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = child.wait()
    done.set()
    sampler.join()
    _scan(seen, first=False)
    return code, [p for p in seen.values() if p.cpu_s > 0]


def charged_test(proc: Proc, by_pid: dict[int, Proc]) -> str:
    """The test ``proc`` ran for: its own ``PYTEST_CURRENT_TEST`` or its nearest ancestor's, without the phase."""
    hops = 0
    while proc is not None and not proc.test and hops < 64:
        proc, hops = by_pid.get(proc.ppid), hops + 1
    return re.sub(r" \((setup|call|teardown)\)$", "", proc.test) if proc is not None else ""


def report(procs: list[Proc], top: int = 30) -> str:
    """CPU seconds by kind, then the ``top`` tests by CPU with their three heaviest kinds."""
    by_pid = {p.pid: p for p in procs}
    kinds, counts, tests = Counter(), Counter(), defaultdict(Counter)
    for proc in procs:
        kind = kind_of(proc.argv)
        kinds[kind] += proc.cpu_s
        counts[kind] += 1
        tests[charged_test(proc, by_pid) or "(no test)"][kind] += proc.cpu_s
    lines = [f"CPU seconds seen: {sum(kinds.values()):.0f} in {len(procs)} processes", "", "  cpu_s  procs  kind"]
    lines += [f"{cpu:7.0f}  {counts[kind]:5d}  {kind}" for kind, cpu in kinds.most_common()]
    lines += ["", "  cpu_s  test (heaviest kinds)"]
    for test, by_kind in sorted(tests.items(), key=lambda item: -sum(item[1].values()))[:top]:
        heaviest = " ".join(f"{k}={v:.0f}" for k, v in by_kind.most_common(3))
        lines.append(f"{sum(by_kind.values()):7.0f}  {test}  ({heaviest})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_ds.devtools.suite_profile",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples (default 0.5)")
    parser.add_argument("--top", type=int, default=30, help="tests listed (default 30)")
    parser.add_argument("--json", type=Path, help="also write every process seen to this file")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run, e.g. python -m pytest tests")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given (… -- python -m pytest tests)")
    if args.interval <= 0:
        parser.error(f"--interval must be > 0, got {args.interval}")
    started = time.monotonic()
    code, procs = profile(cmd, args.interval)
    print(f"\n{' '.join(cmd)}: exit {code} after {time.monotonic() - started:.0f} s")
    print(report(procs, args.top))
    if args.json:
        args.json.write_text(json.dumps([{**asdict(p), "kind": kind_of(p.argv)} for p in procs], indent=0))
    return code


if __name__ == "__main__":
    sys.exit(main())
