"""A session fixture's directory built once per test session, not once per pytest-xdist worker.

``make test`` runs two workers; a ``scope="session"`` fixture is a session of each worker, so a fixture both need
(the shard sets, the fault tables' reference runs, the kernel report) would be built twice. :func:`built_once` builds
it under the directory the workers' base temporary directories share (``<basetemp>/popen-gwN`` under xdist), holding
an exclusive ``flock`` while it builds: the second worker waits for the first and reads what it built. A build that
raised leaves no ``.done`` mark, so the next caller builds again from an empty directory.

What is built this way is read, never written, by the tests (as any session fixture's result already must be).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

__all__ = ["built_once", "session_root"]

DONE = ".done"


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary directory every worker of this test session shares."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """``<session root>/shared-<name>``, after ``build(directory)`` ran once in this session (in whichever worker
    asked first)."""
    target = session_root(tmp_path_factory) / f"shared-{name}"
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (target / DONE).exists():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            build(target)
            (target / DONE).touch()
    return target
