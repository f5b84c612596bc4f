"""The order ``make test`` hands test files to its workers: heaviest first, the files that mostly wait spread out.

``make test`` runs ``pytest -n 3 --dist loadfile --no-loadscope-reorder``: each file goes whole to one worker (its
module fixtures are built once), in the order of the collected items. xdist's own reorder (on unless
``--no-loadscope-reorder``) sends the files with the most tests first, which for this suite are its cheapest
(hundreds of parametrised in-process cases), and leaves files of a few minute-long launches (the demo, the fine-tune
layouts, the Slurm requeues) for the end, where one worker runs them while the others wait. Sent heaviest first
(longest-processing-time-first), the minutes of short default-tier files come last and fill the workers until the
end.

Three workers share two cores because much of a launched test is one process waiting. That only pays while at most
one worker waits: a file whose tests are marked ``waits`` (most of their time is a timer running out: a Slurm requeue,
a collective or step timeout, a launcher's grace period) keeps one worker busy and no core. Sorted by weight alone
those files are among the first (they launch a lot) and run side by side, with the cores idle. So among the heavy
files, the waiting ones are spread evenly by weight through the others (:func:`spread`).

The weight is a rough prior from the tiers, not a record of timings: a test that launches ranks or fine-tunes
(``e2e``, ``slow``, ``slurm``) costs tens of seconds on 2 cores, the rest a fraction of one.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

__all__ = ["HEAVY_MARKERS", "HEAVY_S", "LIGHT_S", "WAITS", "file_weights", "heaviest_files_first", "spread",
           "waiting_files"]

HEAVY_MARKERS = ("e2e", "slow", "slurm")
HEAVY_S = 30.0
"""Seconds a heavy test is counted as (2 cores: launched fault rows 15-50 s, fine-tunes 25-80 s)."""
LIGHT_S = 0.3
"""Seconds any other test is counted as (the default tier: ~1,400 tests in ~5 worker-minutes)."""
WAITS = "waits"
"""The marker of a test that spends most of its time waiting on a timer, not on a core."""


def _weight(item: pytest.Item) -> float:
    return HEAVY_S if any(item.get_closest_marker(m) is not None for m in HEAVY_MARKERS) else LIGHT_S


def file_weights(items: Sequence[pytest.Item]) -> dict[str, float]:
    """Estimated seconds per test file, in order of first appearance."""
    weights: dict[str, float] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        weights[path] = weights.get(path, 0.0) + _weight(item)
    return weights


def waiting_files(items: Sequence[pytest.Item]) -> set[str]:
    """The files whose tests marked :data:`WAITS` are at least half of the file's weight."""
    waiting: dict[str, float] = {}
    for item in items:
        if item.get_closest_marker(WAITS) is not None:
            path = item.nodeid.split("::", 1)[0]
            waiting[path] = waiting.get(path, 0.0) + _weight(item)
    weights = file_weights(items)
    return {path for path, weight in waiting.items() if 2 * weight >= weights[path]}


def spread(paths: Sequence[str], waiting: set[str], weights: dict[str, float]) -> list[str]:
    """``paths`` (heaviest first) with the ``waiting`` ones spread through the others: the next file is a waiting one
    while the waiting files sent so far are no larger a share of all waiting weight than the others sent so far are
    of theirs; each group keeps its order."""
    waits = [p for p in paths if p in waiting]
    others = [p for p in paths if p not in waiting]
    total_w, total_o = sum(weights[p] for p in waits) or 1.0, sum(weights[p] for p in others) or 1.0
    order, sent_w, sent_o = [], 0.0, 0.0
    while waits or others:
        if waits and (not others or sent_w / total_w <= sent_o / total_o):
            path = waits.pop(0)
            sent_w += weights[path]
        else:
            path = others.pop(0)
            sent_o += weights[path]
        order.append(path)
    return order


def heaviest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: files by descending weight (ties keep collection order), the waiting files spread
    through the other heavy files (:func:`spread`), each file's tests in their own order."""
    weights = file_weights(items)
    by_weight = sorted(weights, key=lambda p: -weights[p])
    heavy = [p for p in by_weight if weights[p] >= HEAVY_S]
    order = spread(heavy, waiting_files(items), weights) + by_weight[len(heavy):]
    rank = {path: i for i, path in enumerate(order)}
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])  # stable: a file's tests keep their order
