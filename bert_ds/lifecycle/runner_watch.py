"""Rank-side watcher of the ``deepspeed`` runner (issue 16 item 4).

SIGTERM to the ``deepspeed`` runner alone (``kill <pid>`` of the command a user started, a supervisor that signals
only its child) is not forwarded in local/--no_ssh mode: DeepSpeed 0.19's runner.py just dies, and its child,
``deepspeed.launcher.launch`` (which does forward TERM to the ranks), keeps running with the ranks, orphaned. A rank
therefore polls the runner, its grandparent, about once a second from a daemon thread and, once it is gone, asks for
a pre-emption: checkpoint at the next step boundary and exit 75. The runner is identified by pid and create time, so
a recycled pid is not mistaken for it.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psutil

from bert_ds.deepspeed_internals import LAUNCH_MODULE

__all__ = ["watch_runner"]

log = logging.getLogger(__name__)


def _runner() -> psutil.Process | None:
    """The ``deepspeed`` runner that started this rank through ``deepspeed.launcher.launch``, or None (another
    launcher: torchrun, srun, mpirun, or a single process)."""
    try:
        launch = psutil.Process().parent()
        if launch is None or LAUNCH_MODULE not in " ".join(launch.cmdline()):
            return None
        return launch.parent()
    except psutil.Error:
        return None


def watch_runner(on_gone: Callable[[], None], poll_s: float = 1.0) -> threading.Thread | None:
    """Call ``on_gone`` once when the runner exits (polled every ``poll_s``); returns the daemon thread, or None
    when this rank was not started by the ``deepspeed`` runner."""
    runner = _runner()
    if runner is None:
        return None
    pid, created = runner.pid, runner.create_time()

    def alive() -> bool:
        try:
            return psutil.Process(pid).create_time() == created
        except psutil.Error:
            return False

    def poll() -> None:
        stop = threading.Event()
        while alive():
            stop.wait(poll_s)
        log.warning("the deepspeed runner (pid %d) is gone: checkpointing at the next step boundary", pid)
        on_gone()

    thread = threading.Thread(target=poll, name="bert_ds-runner-watch", daemon=True)
    thread.start()
    return thread
