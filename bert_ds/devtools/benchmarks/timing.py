"""Alternating timing: every repeat runs each contender once, in turn, so load on a shared machine hits all alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["alternate", "paired_ratio", "summary"]


def alternate(contenders: dict[str, Callable[[int], None]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Wall seconds of ``repeats`` calls of each contender (argument: the repeat index), interleaved; the first
    ``warmup`` rounds (allocators, lazy initialisation) are run but not recorded."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(warmup + repeats):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn(round_)
            if round_ >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> dict[str, float]:
    return {"min_s": min(times), "median_s": statistics.median(times), "repeats": len(times)}


def paired_ratio(baseline: list[float], ours: list[float]) -> dict[str, float]:
    """Speed-up of ``ours`` over ``baseline``: the median of the per-round ratios (each pair ran back to back, under
    the same load) and the ratio of the best times."""
    pairs = [b / o for b, o in zip(baseline, ours, strict=True)]
    return {"median_pair": statistics.median(pairs), "best": min(baseline) / min(ours), "min_pair": min(pairs),
            "max_pair": max(pairs)}
