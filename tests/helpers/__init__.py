"""Shared test helpers, imported as ``tests.helpers.<module>`` (pyproject's ``pythonpath = ["."]`` puts the repository
root on ``sys.path``). Nothing here is a test; ``conftest.py`` files only hold fixtures."""

HANG_GUARD_S = 1800
"""Timeout for a subprocess a test starts: a guard against a hang (a stuck launcher, a lock left by a killed
DeepSpeed extension build), never a speed check. Generous so the suite passes on a loaded 2-core machine."""
