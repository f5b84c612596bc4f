"""Benchmarks behind ``tools/benchmark.py``: each figure beside a baseline measured in the same run, alternating,
several repeats, min and median reported. Numbers, not tests: they depend on the machine and its load; the ratios
(against a baseline timed in the same process, step by step) are what carries from one machine to another."""
