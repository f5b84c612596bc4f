"""Ranks forked from one interpreter that has already imported what a rank imports (a "zygote"), for
:mod:`tests.helpers.ranks` (``spawn_ranks``, ``run_ranks``, ``run_module_ranks``).

Why. A tiny CPU rank spends most of its ~7 CPU seconds importing: torch (1.5 s), ``torch._dynamo`` (1.4 s: torch.optim's
``add_param_group`` imports it), DeepSpeed, TensorBoard (``python -X importtime``, 2 cores). DeepSpeed's Muon module is
imported as a rank imports it (:func:`bert_ds.deepspeed_internals.import_muon_compiling_on_first_call`: without
inductor), so a forked rank's heap is a started rank's.
The suite starts a few hundred ranks. Here one interpreter per test worker pays those imports once and forks a child
per rank; the child becomes the rank exactly as ``python -u bert_ds/runtime/pretrain.py --local_rank=I ARGS`` would
(the same environment, working directory, ``sys.argv``, ``sys.path[0]`` and stdout/stderr files, the script run as
``__main__``, its interpreter exit the rank's), so what the rank computes, logs and writes is the same.

What is not the same: the rank's command line in ``/proc`` is this module's (no test finds these ranks by it: the
launch paths, signals and kills are tested through real launchers, :func:`tests.helpers.ranks.rank_command`), and an
import-time read of the launcher's variables (``RANK``, ``MASTER_PORT``, ...) sees none: the zygote runs with the
rank's environment less those (:func:`fork_rank`).

``python -m bert_ds.runtime.pretrain ARGS`` (one rank without a launcher, :func:`tests.helpers.ranks.run_ranks`) is
forked the same way, the module run as ``__main__`` as ``-m`` runs it.

Protocol: the test process writes one JSON request per line on stdin (``id``, ``argv``, ``env``, ``cwd``,
``stdout``, ``stderr``); this process answers ``ready``, then ``pid ID PID`` per fork and ``exit PID CODE`` when a
child ends (``os.waitstatus_to_exitcode``: -N when killed by signal N), and exits when its stdin closes.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bert_ds.deepspeed_internals import MUON_MODULE, import_muon_compiling_on_first_call

__all__ = ["PRELOAD", "SWITCH", "THIRD_PARTY", "ForkedRank", "fork_rank"]

THIRD_PARTY = ("torch", "torch._dynamo", "torch.utils.tensorboard", "deepspeed", "deepspeed.runtime.engine",
               "deepspeed.runtime.zero.stage_1_and_2", MUON_MODULE)
"""The heavy imports every DeepSpeed rank makes (what a zygote for other modules imports before it forks)."""
PRELOAD = (*THIRD_PARTY, "bert_ds.runtime.trainer", "bert_ds.runtime.preflight", "bert_ds.checkpoint")
"""What a zygote for the pre-training script imports before it forks."""

SWITCH = "BERT_DS_TESTS_FORK_RANKS"
"""``0`` in the test process: every rank starts its own interpreter (to compare, or to rule the zygote out)."""
FORKABLE_DIFFERENCES = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "CROSS_RANK", "CROSS_SIZE",
                                  "LOCAL_SIZE", "RANK", "LOCAL_RANK"})
"""The variables a forked rank's environment may differ in from this interpreter's (what ``launch.py`` sets)."""


# ------------------------------------------------------------------------------------------ the zygote's side
def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _serve(preload: list[str]) -> dict:
    """Import ``preload``, then fork one child per request, reporting pids and exits; returns only in a child, its
    request."""
    gc.disable()  # as a rank starts (bert_ds.lifecycle.startup_gc): no collections while importing
    import_muon_compiling_on_first_call()  # as bert_ds.runtime.engine does before deepspeed.initialize
    for name in preload:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    gc.enable()
    _say("ready")
    children, pending = set(), b""
    while True:
        if select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                os._exit(0)  # the test worker closed the pipe: it ended its ranks before
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    return request
                children.add(pid)
                _say(f"pid {request['id']} {pid}")
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")


def _become_rank(request: dict) -> None:
    """In the forked child: what ``python -u SCRIPT ARGS`` would have set up, then the script as ``__main__``."""
    import runpy

    gc.unfreeze()  # the zygote's imports are the child's own heap, collected as a fresh interpreter's would be
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    first, *args = request["argv"]
    if first == "-m":  # python -m MODULE ARGS: sys.path[0] the working directory, argv[0] the module's file
        sys.argv = ["-m", *args[1:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [first, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(first))
        runpy.run_path(first, run_name="__main__")


# ------------------------------------------------------------------------------------------ the test's side
class _Zygote:
    def __init__(self, env: dict[str, str], cwd: Path, preload: tuple[str, ...]) -> None:
        self.env, self.preload = dict(env), preload
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "tests.helpers.rank_zygote", ",".join(preload)],
                                     cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.changed = threading.Condition()
        self.ready, self.pids, self.codes, self.next_id = False, {}, {}, 0
        threading.Thread(target=self._read, name="rank-zygote", daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            kind, *values = raw.decode().split()
            with self.changed:
                if kind == "ready":
                    self.ready = True
                elif kind == "pid":
                    self.pids[int(values[0])] = int(values[1])
                elif kind == "exit":
                    self.codes[int(values[0])] = int(values[1])
                self.changed.notify_all()
        with self.changed:
            self.ready = None  # gone
            self.changed.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None and self.ready is not None

    def fork(self, argv: list[str], env: dict[str, str], cwd: Path, stdout: str, stderr: str,
             timeout: float) -> int:
        with self.changed:
            request_id, self.next_id = self.next_id, self.next_id + 1
        line = json.dumps({"id": request_id, "argv": argv, "env": env, "cwd": str(cwd), "stdout": stdout,
                           "stderr": stderr})
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        with self.changed:
            if not self.changed.wait_for(lambda: request_id in self.pids or self.ready is None, timeout):
                raise RuntimeError(f"the rank zygote did not fork within {timeout:.0f} s")
            if request_id not in self.pids:
                raise RuntimeError("the rank zygote exited")
            return self.pids[request_id]


_ZYGOTE: list[_Zygote] = []


class ForkedRank:
    """A rank forked by the zygote, with the part of ``subprocess.Popen``'s interface ``spawn_ranks`` uses."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    @property
    def returncode(self) -> int | None:
        return self.zygote.codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.zygote.changed:
            if not self.zygote.changed.wait_for(lambda: self.returncode is not None or self.zygote.ready is None,
                                                timeout):
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        if self.returncode is None:
            raise RuntimeError(f"the rank zygote exited before rank pid {self.pid}")
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _close(zygote: _Zygote) -> None:
    """End an idle zygote and reap it: its CPU time, its ranks' included, then counts as this process's children's."""
    with contextlib.suppress(OSError):
        zygote.proc.stdin.close()
    try:
        zygote.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        zygote.proc.kill()
        zygote.proc.wait()


def fork_rank(argv: list[str], env: dict[str, str], cwd: Path, stdout: str, stderr: str, ready_timeout: float,
              preload: tuple[str, ...] = PRELOAD) -> ForkedRank | None:
    """``argv`` (``[SCRIPT, ARGS...]`` or ``["-m", MODULE, ARGS...]``, run as ``python -u`` would run it) with ``env``,
    forked from this test worker's zygote; None when :data:`SWITCH` is ``0`` (the caller then starts an interpreter).

    The zygote imports ``preload`` and runs with ``env`` less the launcher's variables
    (:data:`FORKABLE_DIFFERENCES`) and ``PYTEST_CURRENT_TEST``: a rank whose environment differs from the running
    zygote's in anything else (a test's own cache directory, a variable a test set), or that asks for another
    ``preload``, gets a new zygote started with them, so an import-time read of the environment sees what the rank's
    own interpreter would have. It is called between launches, never while the current zygote's ranks run."""
    if os.environ.get(SWITCH, "1") == "0":
        return None
    base = {k: v for k, v in env.items() if k not in FORKABLE_DIFFERENCES and k != "PYTEST_CURRENT_TEST"}
    if _ZYGOTE and (not _ZYGOTE[0].alive() or _ZYGOTE[0].env != base or _ZYGOTE[0].preload != preload):
        _close(_ZYGOTE.pop())
    if not _ZYGOTE:
        _ZYGOTE.append(_Zygote(base, cwd, preload))
    zygote = _ZYGOTE[0]
    deadline = time.monotonic() + ready_timeout
    with zygote.changed:
        if not zygote.changed.wait_for(lambda: zygote.ready is not False, ready_timeout) or zygote.ready is None:
            raise RuntimeError(f"the rank zygote did not start within {ready_timeout:.0f} s")
    return ForkedRank(zygote, zygote.fork(argv, env, cwd, stdout, stderr, max(1.0, deadline - time.monotonic())))


@atexit.register
def _close_at_exit() -> None:
    if _ZYGOTE:
        _close(_ZYGOTE.pop())


if __name__ == "__main__":
    _become_rank(_serve([name for name in sys.argv[1].split(",") if name]))  # "": nothing preloaded
