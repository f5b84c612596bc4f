"""Shared test helpers, imported as ``tests.helpers.<module>`` (pyproject's ``pythonpath = ["."]`` puts the repository
root on ``sys.path``). Nothing here is a test; ``conftest.py`` files only hold fixtures."""

HANG_GUARD_S = 1800
"""Timeout for a subprocess a test starts: a guard against a hang (a stuck launcher, a lock left by a killed
DeepSpeed extension build), never a speed check. Generous so the suite passes on a loaded 2-core machine."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a process group's MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
