"""The order ``make test`` hands test files to its workers: heaviest first.

``make test`` runs ``pytest -n 2 --dist loadfile --no-loadscope-reorder``: each file goes whole to one worker (its
module fixtures are built once), in the order of the collected items. xdist's own reorder (on unless
``--no-loadscope-reorder``) sends the files with the most tests first, which for this suite are its cheapest
(hundreds of parametrised in-process cases), and leaves files of a few minute-long launches (the demo, the fine-tune
layouts, the Slurm requeues) for the end, where one worker runs them while the other waits. Sent heaviest first
(longest-processing-time-first), the minutes of short default-tier files come last and fill both workers until the
end.

The weight is a rough prior from the tiers, not a record of timings: a test that launches ranks or fine-tunes
(``e2e``, ``slow``, ``slurm``) costs tens of seconds on 2 cores, the rest a fraction of one.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

__all__ = ["HEAVY_MARKERS", "HEAVY_S", "LIGHT_S", "file_weights", "heaviest_files_first"]

HEAVY_MARKERS = ("e2e", "slow", "slurm")
HEAVY_S = 30.0
"""Seconds a heavy test is counted as (2026-11-28, 2 cores: launched fault rows 15-50 s, fine-tunes 25-80 s)."""
LIGHT_S = 0.3
"""Seconds any other test is counted as (the default tier: ~1,130 tests in ~5 worker-minutes)."""


def _weight(item: pytest.Item) -> float:
    return HEAVY_S if any(item.get_closest_marker(m) is not None for m in HEAVY_MARKERS) else LIGHT_S


def file_weights(items: Sequence[pytest.Item]) -> dict[str, float]:
    """Estimated seconds per test file, in order of first appearance."""
    weights: dict[str, float] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        weights[path] = weights.get(path, 0.0) + _weight(item)
    return weights


def heaviest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: files by descending weight (ties keep collection order), each file's tests in
    their own order."""
    weights = file_weights(items)
    rank = {path: i for i, path in enumerate(sorted(weights, key=lambda p: -weights[p]))}
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])  # stable: a file's tests keep their order
