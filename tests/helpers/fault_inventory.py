"""Every fault-table row, with the tier it runs in and how (issue 22): collected by pytest itself, nothing run.

    python -m tests.helpers.fault_inventory            # a markdown table on stdout

``tier``: ``default`` (``make test-fast``) or the markers that keep the row out of it (``e2e``, ``slow``, ``mpi``,
``slurm``, ``gpu``). ``level``: ``launched`` for an ``e2e`` row (a real process tree of ranks; ``tests/conftest.py``
refuses one anywhere else), ``in-process`` otherwise (the decision called as a function, or one CLI process).
"""

from __future__ import annotations

import contextlib
import io
import sys

import pytest

__all__ = ["inventory"]

TIER_MARKERS = ("e2e", "slow", "mpi", "slurm", "gpu")


class _Collector:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def pytest_collection_modifyitems(self, items) -> None:
        for item in items:
            if not hasattr(item, "callspec"):
                continue  # not a row (a check of the table itself)
            marks = sorted({m.name for m in item.iter_markers()} & set(TIER_MARKERS))
            case = getattr(item, "callspec", None) and item.callspec.params.get("case")
            level = getattr(case, "level", None) or ("launched" if "e2e" in marks else "in-process")
            self.rows.append({
                "row": item.callspec.id if getattr(item, "callspec", None) else item.name,
                "file": item.nodeid.split("::")[0].removeprefix("tests/faults/"),
                "test": item.originalname,
                "item": getattr(case, "item", ""),
                "exit": getattr(case, "exit_code", ""),
                "tier": ", ".join(marks) or "default",
                "level": level,
            })


def inventory(paths: tuple[str, ...] = ("tests/faults",)) -> list[dict]:
    collector = _Collector()
    with contextlib.redirect_stdout(io.StringIO()):  # pytest's own listing
        code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *paths], plugins=[collector])
    if code not in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        raise SystemExit(f"collection failed ({code})")
    return collector.rows


def main() -> int:
    rows = inventory()
    lines = ["| row | table | test | item | exit | tier | level |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['row']} | {r['file']} | {r['test']} | {r['item']} | {r['exit']} | {r['tier']} | {r['level']} |"
              for r in rows]
    by_level = {level: sum(r["level"] == level for r in rows) for level in ("in-process", "launched")}
    lines.append(f"\n{len(rows)} rows: {by_level['in-process']} in-process, {by_level['launched']} launched")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
