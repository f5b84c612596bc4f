"""A pytest plugin that writes the CPU seconds each test cost, all of its processes counted, to a JSON-lines file;
and (run as a module) the table of those seconds by test file.

    BERT_DS_TEST_CPU=cpu.jsonl PYTEST_ADDOPTS="-p tests.helpers.cpu_per_test" make test
    python -m tests.helpers.cpu_per_test cpu.jsonl [--top 40] [--by test]

A test's CPU is three parts, each a difference between the test's start and end in its xdist worker:
- ``self``: the worker process (the test body, its fixtures, in-process fine-tunes and compiles);
- ``children``: the processes the worker reaped (``RUSAGE_CHILDREN``: tools, launchers and everything under them);
- ``zygote``: the ranks forked by the worker's rank zygotes (:mod:`tests.helpers.rank_zygote`), which the zygote
  reaps, read from its ``/proc`` times (its own and its reaped children's). A zygote the worker reaps during a test
  moves its whole total into ``RUSAGE_CHILDREN``; what was already counted of it is taken off again.
Unlike ``bert_ds.devtools.suite_profile`` (which samples ``/proc`` and misses short processes), nothing is sampled:
a process's CPU reaches the test running when the worker or a zygote reaped it (or reaped its ancestor). Not counted:
what another process reaps (a Slurm job step's, under slurmd; a daemon that left its parent).
Each line: ``[nodeid, worker, start (epoch s), wall s, self s, children s, zygote s]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time
from pathlib import Path

import psutil
import pytest

__all__ = ["ENV", "main", "table"]

ENV = "BERT_DS_TEST_CPU"
"""The JSON-lines file the plugin appends to (every worker writes its own lines; none: the plugin records nothing)."""

def _zygote_totals() -> dict[int, float]:
    """pid -> CPU seconds (own and reaped children's) of each rank zygote this process started."""
    totals = {}
    for child in psutil.Process().children():
        try:
            if "tests.helpers.rank_zygote" in child.cmdline():
                t = child.cpu_times()
                totals[child.pid] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            continue
    return totals


def _rusage() -> tuple[float, float]:
    own, reaped = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item):
    """Around one test's setup, call and teardown, in the process that runs it (never in an xdist controller)."""
    path = os.environ.get(ENV)
    if not path:
        return (yield)
    start, (own0, reaped0), zygotes0 = time.time(), _rusage(), _zygote_totals()
    try:
        return (yield)
    finally:
        own1, reaped1 = _rusage()
        zygotes1 = _zygote_totals()
        forked = sum(total - zygotes0.get(pid, 0.0) for pid, total in zygotes1.items())
        gone = sum(total for pid, total in zygotes0.items() if pid not in zygotes1)  # reaped: now in reaped1
        line = [item.nodeid, os.environ.get("PYTEST_XDIST_WORKER", "main"), round(start, 3),
                round(time.time() - start, 3), round(own1 - own0, 3), round(reaped1 - reaped0 - gone, 3),
                round(forked, 3)]
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")


def table(path: Path, top: int = 40, by: str = "file") -> str:
    """CPU seconds by test file (or by test), most first: total, self, children, zygote, wall, tests."""
    rows = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0])
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for nodeid, _worker, _start, wall, own, reaped, forked in lines:
        row = rows[nodeid if by == "test" else nodeid.split("::")[0]]
        row[0] += own
        row[1] += reaped
        row[2] += forked
        row[3] += wall
        row[4] += 1
    total = sum(r[0] + r[1] + r[2] for r in rows.values())
    out = [f"{len(lines)} tests, {total:.0f} CPU-s: self {sum(r[0] for r in rows.values()):.0f}, children "
           f"{sum(r[1] for r in rows.values()):.0f}, zygote ranks {sum(r[2] for r in rows.values()):.0f}",
           f"{'CPU-s':>7} {'self':>6} {'child':>6} {'zygote':>6} {'wall':>6} {'tests':>5}  {by}"]
    for name, (own, reaped, forked, wall, n) in sorted(rows.items(), key=lambda kv: -sum(kv[1][:3]))[:top]:
        out.append(f"{own + reaped + forked:7.1f} {own:6.1f} {reaped:6.1f} {forked:6.1f} {wall:6.1f} {n:5d}  {name}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.cpu_per_test", description=table.__doc__)
    parser.add_argument("path", type=Path, help=f"the file {ENV} named")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--by", choices=("file", "test"), default="file")
    args = parser.parse_args(argv)
    print(table(args.path, args.top, args.by))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
