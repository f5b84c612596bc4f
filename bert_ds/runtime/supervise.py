"""``bert-ds deepspeed ARGS``: DeepSpeed's ``deepspeed`` runner under a supervisor, so that the command a user or a
requeue script runs exits 75 when the job was pre-empted and saved, whichever of its processes got the signal.

Why. DeepSpeed 0.19's runner (``deepspeed/launcher/runner.py``) installs no SIGTERM handler on one node or with
``--no_ssh``: a TERM to it, or to the process group a batch shell, systemd or ``docker stop`` signals, ends it at
once (143), while ``deepspeed.launcher.launch`` and the ranks live on, checkpoint and exit 75 to no one.
``launch.py`` itself answers TERM by TERMing the ranks, KILLing them 30 s later and exiting 1.

What the supervisor does (Linux):

- starts ``python -m deepspeed.launcher.runner ARGS`` in a session of its own, so a signal to the caller's process
  group reaches the supervisor alone, with ``PR_SET_PDEATHSIG`` (the runner gets SIGTERM should the supervisor be
  killed; the ranks then see their runner gone, :mod:`bert_ds.runtime.watchdog`, and checkpoint), and makes itself
  the child subreaper (``PR_SET_CHILD_SUBREAPER``): ``launch.py`` and ranks orphaned by a runner that died are
  re-parented to it, so it can wait for every one of them;
- on SIGTERM, SIGUSR1, SIGINT or SIGHUP sends SIGTERM to the ranks alone (never to the runner or ``launch.py``), once
  each rank has armed its own handler: each rank then checkpoints at its next step boundary (or stops before its
  first step) and exits 75;
- each rank reports that it armed and the code it exits with as files in a private directory
  (``$BERT_DS_SUPERVISOR_DIR``, :func:`arm` and :func:`report_exit`, called by ``bert_ds.runtime.pretrain``);
- exits only when no process it started is left, with the job's code (:func:`exit_code_of`): the runner's when it
  exited by itself (the first failing rank's); when it was killed, the ranks' own: a failure any rank reported (1,
  2, 3, 124), else 75 (a rank exits 75 only after the collective save completed).

Multi-node through ``pdsh`` (``--hostfile`` without ``--no_ssh``): ranks on other nodes are not the supervisor's
descendants; a signal is then passed to the runner, whose own handler (``runner.py`` ``sigkill_handler``) ends every
node's ranks without a checkpoint. Per-node launches (``--no_ssh --node_rank``, one supervisor per node) are covered.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bert_ds.deepspeed_internals import LAUNCH_MODULE, RUNNER_MODULE
from bert_ds.exit_codes import ExitCode

__all__ = ["DIR_ENV", "arm", "exit_code_of", "main", "report_exit"]

DIR_ENV = "BERT_DS_SUPERVISOR_DIR"
"""The directory in which ranks started by a supervisor report ``armed.<pid>`` and ``exit.<pid>``."""
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
UNARMED_AFTER_S = 60.0
"""A rank that never arms (a script other than bert_ds's pre-training) gets the signal once this old."""
LEFTOVER_GRACE_S = 120.0
"""After the runner exits, how long its remaining descendants (a rank still saving, loader workers) may take."""
POLL_S = 0.2
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


# ------------------------------------------------------------------------------------------------- the rank's side
def arm() -> None:
    """Tell the supervisor (if any) that this rank's pre-emption handler is installed."""
    _report("armed", "")


def report_exit(code: int) -> None:
    """Tell the supervisor (if any) the code this rank exits with."""
    _report("exit", str(int(code)))


def _report(kind: str, text: str) -> None:
    directory = os.environ.get(DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return
    path = Path(directory) / f"{kind}.{os.getpid()}"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------- the supervisor's side
def exit_code_of(reports: dict[int, int], runner: int, preempted: bool) -> int:
    """The job's exit code. ``runner``: DeepSpeed's runner's status as ``os.waitstatus_to_exitcode`` gives it (-N:
    killed by signal N); ``reports``: the ranks' reported codes by pid; ``preempted``: the supervisor was signalled.

    A runner that exited by itself passes on the first failing rank's code (``launch.py`` exits with it and ends the
    others), so that is the job's. A runner killed by a signal knows nothing: then a failure a rank reported wins,
    else 75 if a rank reported it or the supervisor was signalled (killed before they could report: every save is
    atomic, so ``--resume auto`` goes on from the last complete checkpoint), else 128 + N."""
    if runner >= 0:
        return runner
    codes = [reports[pid] for pid in sorted(reports)]
    failures = [c for c in codes if c not in (ExitCode.OK, ExitCode.PREEMPTED)]
    if failures:
        return failures[0]
    if ExitCode.PREEMPTED in codes or preempted:
        return ExitCode.PREEMPTED
    return 128 - runner


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _runner_preexec() -> None:
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class _Supervisor:
    def __init__(self, argv: Sequence[str], directory: Path) -> None:
        import psutil

        self.psutil = psutil
        self.dir = directory
        self.pending: int | None = None
        self.signalled: set[int] = set()
        self.runner_code: int | None = None
        """DeepSpeed's runner's status (``os.waitstatus_to_exitcode``) once it was reaped."""
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        env = dict(os.environ, **{DIR_ENV: str(directory)})
        cmd = [sys.executable, "-u", "-m", RUNNER_MODULE, *argv]
        self.runner = psutil.Popen(cmd, env=env, start_new_session=True, preexec_fn=_runner_preexec)
        for sig in FORWARDED:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.pending is None:
            sys.stderr.write(f"bert-ds deepspeed: {signal.Signals(signum).name}: asking the ranks to checkpoint at "
                             f"their next step boundary and exit {int(ExitCode.PREEMPTED)}\n")
            sys.stderr.flush()
        self.pending = signum
        self.signalled.clear()  # a repeated signal is passed on again

    def _ranks(self) -> list:
        """The local ranks: processes whose parent is a ``deepspeed.launcher.launch``."""
        ranks = []
        for proc in self.psutil.Process().children(recursive=True):
            try:
                parent = proc.parent()
                if parent is not None and LAUNCH_MODULE in " ".join(parent.cmdline()):
                    ranks.append(proc)
            except self.psutil.Error:
                continue
        return ranks

    def _uses_pdsh(self) -> bool:
        try:
            return any(p.name() == "pdsh" for p in self.runner.children(recursive=True))
        except self.psutil.Error:
            return False

    def _forward(self) -> None:
        if self.pending is None:
            return
        if self._uses_pdsh():
            if self.runner.pid not in self.signalled and self.runner.is_running():
                self.runner.send_signal(signal.SIGTERM)
                self.signalled.add(self.runner.pid)
            return
        for rank in self._ranks():
            if rank.pid in self.signalled:
                continue
            try:
                ready = (self.dir / f"armed.{rank.pid}").exists() or time.time() - rank.create_time() > UNARMED_AFTER_S
                if ready:
                    rank.send_signal(signal.SIGTERM)
                    self.signalled.add(rank.pid)
            except self.psutil.Error:
                continue

    def _reap(self) -> int | None:
        """Reap every exited child (the runner and re-parented orphans); the runner's code once it exited."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return self.runner_code
            if pid == 0:
                return self.runner_code
            if pid == self.runner.pid:
                self.runner_code = os.waitstatus_to_exitcode(status)

    def _descendants_left(self) -> list:
        try:
            return [p for p in self.psutil.Process().children(recursive=True) if p.status() != "zombie"]
        except self.psutil.Error:
            return []

    def run(self) -> int:
        while self._reap() is None:
            self._forward()
            time.sleep(POLL_S)
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while self._descendants_left() and time.monotonic() < deadline:
            self._forward()
            self._reap()
            time.sleep(POLL_S)
        for proc in self._descendants_left():
            sys.stderr.write(f"bert-ds deepspeed: killing pid {proc.pid} left {LEFTOVER_GRACE_S:.0f} s after the "
                             f"runner exited\n")
            proc.kill()
        self._reap()
        return exit_code_of(self._reports(), self.runner_code, preempted=self.pending is not None)

    def _reports(self) -> dict[int, int]:
        reports = {}
        for path in self.dir.glob("exit.*"):
            if path.suffix != ".tmp":
                reports[int(path.name.split(".")[1])] = int(path.read_text())
        return reports


def main(argv: Sequence[str] | None = None) -> int:
    """Run DeepSpeed's runner with ``argv`` (its own arguments, verbatim) under the supervisor."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [-h] [deepspeed runner options] SCRIPT [script arguments]",
        epilog="The runner's own options: deepspeed --help. Exit codes: the ranks' (README), 75 when pre-empted.")
    parser.add_argument("runner_args", nargs=argparse.REMAINDER,
                        help="DeepSpeed's runner arguments, then the script and its arguments, passed on verbatim")
    parser.parse_known_args(argv[:1] if argv[:1] in (["-h"], ["--help"]) else [])
    if not argv:
        parser.error("give the deepspeed runner's arguments and the script, e.g. --num_gpus 8 "
                     "bert_ds/runtime/pretrain.py --recipe ...")
    with tempfile.TemporaryDirectory(prefix="bert_ds-supervisor-") as directory:
        return _Supervisor(argv, Path(directory)).run()


if __name__ == "__main__":
    sys.exit(main())
