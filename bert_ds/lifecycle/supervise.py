"""``bert-ds deepspeed ARGS``: DeepSpeed's ``deepspeed`` runner under a supervisor, so that the command a user or a
requeue script runs exits 75 when the job was pre-empted and saved, whichever of its processes got the signal.

Why. DeepSpeed 0.19's runner (``deepspeed/launcher/runner.py``) installs no SIGTERM handler on one node or with
``--no_ssh``: a TERM to it, or to the process group a batch shell, systemd or ``docker stop`` signals, ends it at
once (143), while ``deepspeed.launcher.launch`` and the ranks live on, checkpoint and exit 75 to no one.
``launch.py`` itself answers TERM by TERMing the ranks, KILLing them 30 s later and exiting 1.

What the supervisor does (Linux):

- starts ``python -m deepspeed.launcher.runner ARGS`` in a session of its own, so a signal to the caller's process
  group reaches the supervisor alone, with ``PR_SET_PDEATHSIG`` (the runner gets SIGTERM should the supervisor be
  killed; the ranks then see their runner gone, :mod:`bert_ds.lifecycle.runner_watch`, and checkpoint), and makes itself
  the child subreaper (``PR_SET_CHILD_SUBREAPER``): ``launch.py`` and ranks orphaned by a runner that died are
  re-parented to it, so it can wait for every one of them;
- on SIGTERM, SIGUSR1, SIGINT or SIGHUP sends SIGTERM to the ranks alone (never to the runner or ``launch.py``), once
  each rank has armed its own handler: each rank then checkpoints at its next step boundary (or stops before its
  first step) and exits 75;
- each rank reports that it armed and the code it exits with as files in a private directory
  (``$BERT_DS_SUPERVISOR_DIR``, :func:`arm` and :func:`report_exit`, called by ``bert_ds.runtime.pretrain``);
- exits only when no process it started is left, with the job's code (:func:`exit_code_of`): the runner's when it
  exited by itself (a failing rank's; the earliest failure the ranks reported when the runner passed on another);
  when it was killed, the ranks' own: the earliest failure a rank reported (1, 2, 3, 124), else 75 (a rank exits 75
  only after the collective save completed).

Restarts (:mod:`bert_ds.lifecycle.restart`): after a retryable failure (a rank killed by signal N, which the command
reports as 128 + N, naming the signal; exit 1; a stall, 124) the supervisor ends what is left of the attempt, frees
rank 0's port and buffers and starts the launcher again with ``--resume auto``, at most ``--max-restarts`` times
(default 3), logging each restart to ``RUN_DIR/restarts.jsonl`` and TensorBoard; docs/cluster.md.

Multi-node through ``pdsh`` (``--hostfile`` without ``--no_ssh``): ranks on other nodes are not the supervisor's
descendants; a signal is then passed to the runner, whose own handler (``runner.py`` ``sigkill_handler``) ends every
node's ranks without a checkpoint. Per-node launches (``--no_ssh --node_rank``, one supervisor per node) are covered.

``bert-ds mpirun ARGS`` is the same supervisor around Open MPI's ``mpirun``, which answers SIGTERM by ending the job
(exit 1 two seconds later, the ranks killed before they save) but forwards SIGUSR1 to every rank on every node and
then exits with the first non-zero rank code (75): a signal to the command or its process group becomes one SIGUSR1 to
``mpirun`` once this node's ranks have armed (so it reaches the ranks on other nodes too), and ``PR_SET_PDEATHSIG``
sends ``mpirun`` SIGUSR1 should the supervisor be killed. A TERM sent to ``mpirun`` itself (``kill <its pid>``, or
Slurm's TERM to every process of a step) never reaches the supervisor: Open MPI TERMs the ranks itself, after the grace
:mod:`bert_ds.lifecycle.supervise_mpirun` sets, and exits 1; the ranks' reports then make the command's 75.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bert_ds.cli import alias
from bert_ds.deepspeed_internals import LAUNCH_MODULE, RUNNER_MODULE
from bert_ds.exit_codes import SIGNAL_BASE, ExitCode, from_negated_signal, signal_name, signal_of
from bert_ds.lifecycle import restart

__all__ = ["DEEPSPEED", "DIR_ENV", "MPIRUN", "Launcher", "arm", "exit_code_of", "main", "read_reports", "report_exit",
           "supervise"]

DIR_ENV = "BERT_DS_SUPERVISOR_DIR"
"""The directory in which ranks started by a supervisor report ``armed.<pid>`` and ``exit.<pid>``."""
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
UNARMED_AFTER_S = 60.0
"""A rank that never arms (a script other than bert_ds's pre-training) gets the signal once this old."""
LEFTOVER_GRACE_S = 120.0
"""After the runner exits, how long its remaining descendants (a rank still saving, loader workers) may take."""
FAILED_GRACE_S = 5.0
"""When a restart follows: how long the ranks of a failed attempt may take to end by themselves (the launcher's own
clean-up) before the supervisor SIGKILLs them -- a stopped rank ignores the launcher's SIGTERM for its 30 s."""
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
def read_reports(directory: Path) -> dict[int, int]:
    """The codes the ranks reported in ``directory`` (:func:`report_exit`) by pid, in the order they were reported
    (each report's modification time, then the pid)."""
    found = sorted((path.stat().st_mtime_ns, int(path.name.split(".")[1]), int(path.read_text()))
                   for path in directory.glob("exit.*") if path.suffix != ".tmp")
    return {pid: code for _, pid, code in found}


def exit_code_of(reports: dict[int, int], runner: int, preempted: bool, runner_knows: bool = True) -> int:
    """The job's exit code. ``runner``: the launcher's status as ``os.waitstatus_to_exitcode`` gives it (-N: killed
    by signal N); ``reports``: the ranks' reported codes by pid, in the order they were reported; ``preempted``: the
    supervisor was signalled; ``runner_knows``: a launcher that exits by itself passes on a failing rank's code.

    DeepSpeed's runner does (``launch.py`` exits with that code and ends the others), so its code is the job's
    whenever it exited by itself, with one correction: ``launch.py`` polls its ranks once a second and passes on the
    first failed one it meets in a set, not the first that failed. When two ranks failed within one poll (rank 0
    refused a token id, exit 2; rank 1's collective then met the dead peer, exit 1) and the runner's code is such a
    failure, the earliest failure a rank reported is the job's: a peer's error comes after the failure that caused it.
    A runner's signal code (a rank killed, which reports nothing) stands.

    ``mpirun`` does not always pass a rank's code on: when one rank exits 75 it aborts the job, and a rank it kills on
    the way can make its own status 1 (measured, 1 run in 3). A launcher killed by a signal knows nothing either. Then
    the earliest failure a rank reported wins, else 75 if a rank reported it or the supervisor was signalled (killed
    before they could report: every save is atomic, so ``--resume auto`` goes on from the last complete checkpoint),
    else the launcher's own code (128 + N when killed). One exception: ``mpirun`` exiting 128 + N by itself, not
    pre-empted, says its first failure was a rank killed by signal N (it exits with the first failing rank's status);
    the failures its peers reported came after, from their collectives (a dead peer: exit 1), so 128 + N stands."""
    failures = [c for c in reports.values() if c not in (ExitCode.OK, ExitCode.PREEMPTED)]
    if runner >= 0 and runner_knows:
        rank_failure = runner not in (ExitCode.OK, ExitCode.PREEMPTED) and runner < SIGNAL_BASE
        return failures[0] if failures and rank_failure else runner
    if failures and signal_of(runner) is not None and not preempted:
        return runner
    if failures:
        return failures[0]
    if ExitCode.PREEMPTED in reports.values() or preempted:
        return ExitCode.PREEMPTED
    return runner if runner >= 0 else 128 - runner


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


@dataclass(frozen=True)
class Launcher:
    """What differs between the launchers a supervisor runs."""

    name: str
    """The command's name in ``bert-ds NAME`` and in the supervisor's lines."""
    command: tuple[str, ...]
    """The launcher's command, before the user's arguments."""
    rank_parents: tuple[str, ...]
    """A process is a local rank when its parent's command line has one of these as an argument (``-m
    deepspeed.launcher.launch``) or as its program's name (``mpirun``, ``orted``)."""
    via_runner: bool
    """True: a signal becomes one SIGUSR1 to the launcher, which passes it to every rank (``mpirun``). False: SIGTERM
    to each local rank, never to the launcher (DeepSpeed's runner and ``launch.py`` would end the ranks)."""
    death_signal: int
    """What the launcher gets should the supervisor be killed (``PR_SET_PDEATHSIG``)."""
    negates_signals: bool = False
    """The launcher exits ``sys.exit(-N)`` for a rank killed by signal N (the byte 256 - N): DeepSpeed's ``launch.py``.
    ``mpirun`` already exits 128 + N."""


DEEPSPEED = Launcher("deepspeed", (sys.executable, "-u", "-m", RUNNER_MODULE), (LAUNCH_MODULE,), False,
                     signal.SIGTERM, negates_signals=True)
MPIRUN = Launcher("mpirun", ("mpirun",), ("mpirun", "orterun", "orted", "prterun", "prted"), True, signal.SIGUSR1)


class _Supervisor:
    def __init__(self, argv: Sequence[str], directory: Path, launcher: Launcher = DEEPSPEED,
                 restart_follows: bool = False) -> None:
        import psutil

        self.psutil = psutil
        self.dir = directory
        self.launcher = launcher
        self.restart_follows = restart_follows
        """A retryable failure will be restarted: end the failed attempt within ``FAILED_GRACE_S``."""
        self.seen: dict[int, str] = {}
        """Every local rank seen alive, by pid: how :meth:`failing` names it."""
        self.gone: list[tuple[float, int]] = []
        """(when, pid) of each rank seen gone, in that order."""
        self.failed_at: float | None = None
        self.pending: int | None = None
        self.signalled: set[int] = set()
        self.runner_code: int | None = None
        """The launcher's status (``os.waitstatus_to_exitcode``) once it was reaped."""
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        env = dict(os.environ, **{DIR_ENV: str(directory)})
        self.runner = psutil.Popen([*launcher.command, *argv], env=env, start_new_session=True,
                                   preexec_fn=lambda: _prctl(_PR_SET_PDEATHSIG, launcher.death_signal))
        for sig in FORWARDED:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.pending is None:
            sys.stderr.write(f"bert-ds {self.launcher.name}: {signal.Signals(signum).name}: asking the ranks to "
                             f"checkpoint at their next step boundary and exit {int(ExitCode.PREEMPTED)}\n")
            sys.stderr.flush()
        self.pending = signum
        self.signalled.clear()  # a repeated signal is passed on again

    def _ranks(self) -> list:
        """The local ranks: processes whose parent is the launcher's rank starter (``launch.py``, ``mpirun``), the
        supervisor itself excepted (its own command line names the launcher)."""
        ranks = []
        for proc in self.psutil.Process().children(recursive=True):
            try:
                parent = proc.parent()
                if parent is None or parent.pid == os.getpid():
                    continue
                cmd = parent.cmdline()
                # one argument, or the program's name: a path that merely contains "mpirun" (a run directory
                # named so) must not make a rank's loader workers ranks
                if cmd and (os.path.basename(cmd[0]) in self.launcher.rank_parents or
                            any(p in cmd for p in self.launcher.rank_parents)):
                    ranks.append(proc)
            except self.psutil.Error:
                continue
        return ranks

    def _ready(self, rank) -> bool:
        """The rank armed its handler, or it is old enough to be a script that never will."""
        return (self.dir / f"armed.{rank.pid}").exists() or time.time() - rank.create_time() > UNARMED_AFTER_S

    def _forward_via_runner(self) -> None:
        """One SIGUSR1 to ``mpirun`` per signal, once every local rank is ready (none local: once the launcher is
        ``UNARMED_AFTER_S`` old), so the ranks on other nodes get it too."""
        if self.runner.pid in self.signalled or self.runner_code is not None:
            return
        try:
            ranks = self._ranks()
            ready = all(self._ready(r) for r in ranks) if ranks else (
                time.time() - self.runner.create_time() > UNARMED_AFTER_S)
            if ready:
                self.runner.send_signal(signal.SIGUSR1)
                self.signalled.add(self.runner.pid)
        except self.psutil.Error:
            return

    def _uses_pdsh(self) -> bool:
        try:
            return any(p.name() == "pdsh" for p in self.runner.children(recursive=True))
        except self.psutil.Error:
            return False

    def _forward(self) -> None:
        if self.pending is None:
            return
        if self.launcher.via_runner:
            self._forward_via_runner()
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
                if self._ready(rank):
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
            self._watch_ranks()
            time.sleep(POLL_S)
        self._watch_ranks()
        grace = FAILED_GRACE_S if self._hastened() else LEFTOVER_GRACE_S
        deadline = time.monotonic() + grace
        while self._descendants_left() and time.monotonic() < deadline:
            self._forward()
            self._reap()
            time.sleep(POLL_S)
        for proc in self._descendants_left():
            sys.stderr.write(f"bert-ds {self.launcher.name}: killing pid {proc.pid} left {grace:.0f} s "
                             f"after the launcher exited\n")
            with contextlib.suppress(self.psutil.Error):
                proc.kill()
        self._reap()
        reports = self._reports()
        runner = self.runner_code
        if self.launcher.negates_signals and runner >= 0:
            runner = from_negated_signal(runner)
        code = exit_code_of(reports, runner, preempted=self.pending is not None,
                            runner_knows=not self.launcher.via_runner)
        if self.launcher.via_runner and code != self.runner_code:
            self._explain(code, reports)
        if signal_name(code) is not None:
            sys.stderr.write(f"bert-ds {self.launcher.name}: {self.failing() or 'a rank or the launcher'} was killed "
                             f"by {signal_name(code)}: exit {code}\n")
            sys.stderr.flush()
        return code

    # ---- which rank failed, and ending a failed attempt fast when a restart follows ------------------------------
    def _describe(self, proc) -> str:
        try:
            env = proc.environ()
        except self.psutil.Error:
            env = {}
        local = env.get("LOCAL_RANK") or env.get("OMPI_COMM_WORLD_LOCAL_RANK") or next(
            (a.split("=", 1)[1] for a in proc.cmdline() if a.startswith("--local_rank=")), "?")
        rank = env.get("RANK") or env.get("OMPI_COMM_WORLD_RANK") or local
        return f"rank {rank} (host {socket.gethostname()}, local rank {local}, pid {proc.pid})"

    def _watch_ranks(self) -> None:
        """Note new ranks and the ones gone; once a rank is gone without reporting success or a pre-emption (killed,
        crashed) or reported a failure, the attempt has failed: with a restart to follow, its ranks left get
        ``FAILED_GRACE_S`` to end, then SIGKILL."""
        live = {}
        for proc in self._ranks():
            with contextlib.suppress(self.psutil.Error):
                live[proc.pid] = proc
                if proc.pid not in self.seen:
                    self.seen[proc.pid] = self._describe(proc)
        now, gone = time.monotonic(), {pid for _, pid in self.gone}
        self.gone += [(now, pid) for pid in self.seen if pid not in live and pid not in gone and not
                      self._alive(pid)]
        if self.failed_at is None and self.failing():
            self.failed_at = now
        if self._hastened() and now - self.failed_at > FAILED_GRACE_S:
            for proc in live.values():
                with contextlib.suppress(self.psutil.Error):
                    for child in [*proc.children(recursive=True), proc]:
                        child.kill()

    def _hastened(self) -> bool:
        return self.restart_follows and self.pending is None and self.failed_at is not None

    def failing(self) -> str:
        """The first rank that failed, named: the first gone without reporting 0 or 75 (killed, crashed), else one
        that reported a failure and still runs; empty when none did."""
        reports = self._reports()
        for _, pid in self.gone:
            if reports.get(pid) not in (ExitCode.OK, ExitCode.PREEMPTED):
                return self.seen[pid]
        failed = [pid for pid, code in reports.items()  # in the order reported
                  if code not in (ExitCode.OK, ExitCode.PREEMPTED) and pid in self.seen]
        return self.seen[failed[0]] if failed else ""

    def _alive(self, pid: int) -> bool:
        try:
            return self.psutil.Process(pid).status() != self.psutil.STATUS_ZOMBIE
        except self.psutil.Error:
            return False

    def _explain(self, code: int, reports: dict[int, int]) -> None:
        """One line when the command's code is not the launcher's: which status and which reports decided it."""
        status = self.runner_code
        said = f"exited {status}" if status >= 0 else f"was killed by signal {-status}"
        ranks = ", ".join(str(reports[pid]) for pid in sorted(reports)) or "nothing"
        sys.stderr.write(f"bert-ds {self.launcher.name}: {self.launcher.name} {said}; the ranks on this node reported "
                         f"{ranks}: exit {code}\n")
        sys.stderr.flush()

    def _reports(self) -> dict[int, int]:
        return read_reports(self.dir)


def _parser(launcher: Launcher) -> argparse.ArgumentParser:
    own = "deepspeed --help" if launcher is DEEPSPEED else f"{launcher.name} --help"
    parser = argparse.ArgumentParser(
        prog=f"bert-ds-{launcher.name}", description=f"{launcher.name}, supervised: the command exits 75 when the "
        "job was pre-empted and saved, whichever of its processes got the signal, restarts the ranks from the newest "
        "intact checkpoint after a retryable failure (a rank killed or crashed, exit 1, a stall, 124), at most "
        "--max-restarts times, and leaves no process behind",
        usage=f"%(prog)s [-h] [--max-restarts N] [--restart-backoff S] [{launcher.name} options] COMMAND [arguments]",
        epilog=f"The launcher's own options: {own}. Exit codes: the ranks' (README), 75 when pre-empted, 128 + N "
        "when a rank was killed by signal N. Restarts: docs/cluster.md.")
    parser.add_argument("--max-restarts", type=int, default=restart.DEFAULT_MAX_RESTARTS, metavar="N",
                        help="restart the ranks at most N times after a retryable failure, each from the newest "
                        "intact checkpoint with --resume auto (0: never; default %(default)s); given before the "
                        "launcher's arguments")
    parser.add_argument("--restart-backoff", type=float, default=restart.DEFAULT_BACKOFF_S, metavar="S",
                        help="seconds before the first restart, doubled for each further one, at most "
                        f"{restart.BACKOFF_CAP_S:.0f} (default %(default)s)")
    parser.add_argument("launcher_args", nargs=argparse.REMAINDER,
                        help=f"{launcher.name}'s arguments, then the program and its arguments, passed on verbatim")
    return parser


def supervise(launcher: Launcher, argv: Sequence[str] | None = None) -> int:
    """Run ``launcher`` with ``argv`` (the supervisor's own options, then the launcher's arguments, verbatim) under
    the supervisor, restarting it after a retryable failure (:mod:`bert_ds.lifecycle.restart`); the job's exit
    code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, argv = restart.split_own_options(argv)
    parser = _parser(launcher)
    options = parser.parse_args(own + (argv[:1] if argv[:1] in (["-h"], ["--help"]) else []))
    if options.max_restarts < 0 or options.restart_backoff < 0:
        parser.error(f"--max-restarts {options.max_restarts} / --restart-backoff {options.restart_backoff:g}: give "
                     f"a count and seconds of at least 0")
    if not argv:
        example = ("--num_gpus 8 bert_ds/runtime/pretrain.py --recipe ..." if launcher is DEEPSPEED else
                   "-np 16 -H node0:8,node1:8 -x MASTER_PORT=29500 bert-ds-pretrain --recipe ...")
        parser.error(f"give {launcher.name}'s arguments and the program, e.g. {example}")
    current: list[_Supervisor] = []

    def attempt(args: list[str], restart_follows: bool) -> restart.Ended:
        with tempfile.TemporaryDirectory(prefix="bert_ds-supervisor-") as directory:
            current[:] = [_Supervisor(args, Path(directory), launcher, restart_follows)]
            code = current[0].run()
            return restart.Ended(code, current[0].pending is not None, current[0].failing())

    policy = restart.Restarts(f"bert-ds {launcher.name}", argv, options.max_restarts, options.restart_backoff,
                              hosts_rank0=launcher.via_runner or restart.node_rank(argv) == 0)
    return policy.run(attempt, stopping=lambda: bool(current) and current[0].pending is not None)


def _run(argv: list[str]) -> int:
    """``bert-ds deepspeed``: DeepSpeed's runner under the supervisor."""
    return supervise(DEEPSPEED, argv)


main = alias("deepspeed")


if __name__ == "__main__":
    sys.exit(main())
