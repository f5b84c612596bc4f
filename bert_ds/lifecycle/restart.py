"""Bounded restarts inside the allocation (issue 34): which failures a supervisor restarts, how long it waits, what it
releases first and how it records each restart. Used by both supervisors (:mod:`bert_ds.lifecycle.supervise`:
``bert-ds deepspeed`` and ``bert-ds mpirun``); the Slurm scripts apply the same rule to ``srun``
(``slurm/pretrain_common.sh``: ``restartable``, ``MAX_RESTARTS``, :func:`step_restart`).

What restarts. A rank killed by a signal (``128 + N``, :func:`bert_ds.exit_codes.signal_exit_code`: a flaky node, the
OOM killer), a rank that failed with exit 1 (a loader worker died, a collective failed because a peer vanished) and a
stall (124, :mod:`bert_ds.lifecycle.hang_watchdog`): each leaves the newest sealed checkpoint intact, and ``--resume
auto`` continues from it bit for bit. What never restarts: bad input (2) and a non-finite loss (3), which a restart
would only repeat; a full disk or an I/O error (74), which needs a person; a pre-emption (75) or a signal to the
supervisor itself, because the job is being stopped. torchrun's ``--max-restarts``
(``torch/distributed/elastic/agent/server/api.py``: the agent restarts the worker group after any failure) restarts
them all; here only the failures a restart can cure are.

How. Attempt k + 1 starts only once every resource of attempt k is released: every process of its tree reaped (what
is left SIGKILLed), rank 0's ``MASTER_PORT`` free again (:func:`wait_port_free`: a leftover rank holding it
would make the next start refuse with "MASTER_PORT ... is already in use"), DeepSpeed's CPU all-reduce buffers of that
port unlinked (:func:`release_shm_buffers`: a stale buffer of a dead rank would be opened as if it were the new rank's,
``deepspeed/ops/csrc/cpu/comm/shm.cpp`` ``shm_initialize``); the run lock and the extension build lock are ``flock``
locks, released by the kernel with their holder. The program's arguments get ``--resume auto``
(:func:`resume_args`): attempt 1 may have started fresh, attempt k + 1 must continue. Between attempts the supervisor
waits :func:`backoff_s` (5 s, doubling, at most 60 s): a failure that is the node's, not the job's, gets time to
clear, and a failure that repeats at once cannot spin.

Records. Every restart is one line on stderr and one JSON record in ``RUN_DIR/restarts.jsonl`` (:class:`RestartLog`),
and a text and two scalars in an event file of the supervisor's own in ``RUN_DIR/tensorboard`` (beside the ranks'
events, so TensorBoard shows them in the same run; written by the supervisor because the resumed rank 0 cannot know
why its predecessor died). Exhausted restarts end with the last failure's code and :func:`summary_line`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bert_ds.exit_codes import ExitCode, signal_name, signal_of

__all__ = ["BACKOFF_CAP_S", "DEFAULT_BACKOFF_S", "DEFAULT_MAX_RESTARTS", "LOG_NAME", "NEVER_RESTARTED",
           "OWN_OPTIONS", "PORT_WAIT_S", "Attempt", "Ended", "RestartLog", "Restarts", "backoff_s", "describe_code",
           "mapped_shm_paths", "master_port", "node_rank", "port_free", "release_shm_buffers", "restart_line",
           "resume_args", "retryable", "run_dir_of", "split_own_options", "stalled_ranks_named", "step_restart",
           "summary_line", "wait_port_free", "why_not_restarted"]

log = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 3
"""``--max-restarts``' default: three flaky-node failures in one allocation; a fourth is a pattern for a person."""
DEFAULT_BACKOFF_S = 5.0
"""``--restart-backoff``' default: the wait before the first restart; it doubles for each further one."""
BACKOFF_CAP_S = 60.0
PORT_WAIT_S = 60.0
"""How long a restart waits for rank 0's ``MASTER_PORT`` to be free (a socket of the reaped attempt in the kernel's
hands); after that it starts anyway and the ranks' own refusal names the port."""
LOG_NAME = "restarts.jsonl"
"""In the run directory: one JSON record per restart, and one summary when the restarts ran out."""
NEVER_RESTARTED = {
    ExitCode.BAD_INPUT: "bad input: a restart would repeat it",
    ExitCode.NONFINITE: "a non-finite loss: a restart would repeat it",
    ExitCode.IO_ERROR: "a full disk or an I/O error, which a person must clear (free space, fix the mount)",
    ExitCode.PREEMPTED: "pre-empted: the job is being stopped",
}
OWN_OPTIONS = ("--max-restarts", "--restart-backoff")
"""The supervisor's own options: they come first, before the launcher's arguments."""
_DEFAULT_MASTER_PORT = 29500  # DeepSpeed's and torch.distributed's default (deepspeed/constants.py)
_PRETRAIN = ("bert_ds.runtime.pretrain", "bert-ds-pretrain")


def retryable(code: int) -> bool:
    """A failure a restart from the newest checkpoint can cure: killed by a signal, exit 1, a stall (124)."""
    return code in (ExitCode.FAILED, ExitCode.STALLED) or signal_of(code) is not None


def why_not_restarted(code: int, preempted: bool = False) -> str | None:
    """Why a failure with ``code`` ends the command (None: it is restarted, restarts left). ``preempted``: the
    supervisor itself was signalled."""
    if preempted:
        return "the supervisor was signalled: the job is being stopped"
    if code in NEVER_RESTARTED:
        return NEVER_RESTARTED[ExitCode(code)]
    return None if retryable(code) else f"exit {code} is not a failure a restart cures"


def backoff_s(restart: int, base_s: float = DEFAULT_BACKOFF_S) -> float:
    """The wait before restart ``restart`` (1-based): ``base_s`` doubled for each earlier restart, at most 60 s."""
    return min(BACKOFF_CAP_S, base_s * 2 ** (restart - 1)) if base_s > 0 else 0.0


def describe_code(code: int) -> str:
    """``exit 1``, or ``killed by SIGKILL (exit 137)``."""
    name = signal_name(code)
    return f"killed by {name} (exit {code})" if name else f"exit {code}"


# ---- the command line -----------------------------------------------------------------------------------------------
def split_own_options(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the supervisor's own leading options, the launcher's arguments after them)."""
    argv, at = list(argv), 0
    while at < len(argv) and argv[at].split("=", 1)[0] in OWN_OPTIONS:
        at += 1 if "=" in argv[at] else 2
    return argv[:at], argv[at:]


def node_rank(argv: Sequence[str]) -> int:
    """The launcher's ``--node_rank`` (DeepSpeed's per-node launches with ``--no_ssh``), 0 when not given."""
    for i, arg in enumerate(argv):
        if arg == "--node_rank" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--node_rank="):
            return int(arg.split("=", 1)[1])
    return 0


def _is_pretrain(argv: Sequence[str]) -> bool:
    return any(a.endswith("pretrain.py") or os.path.basename(a) in _PRETRAIN for a in argv) or any(
        a == "bert_ds.cli" and argv[i + 1:i + 2] == ["pretrain"] for i, a in enumerate(argv))


def resume_args(argv: Sequence[str]) -> list[str]:
    """``argv`` for a restart: bert_ds pre-training gets ``--resume auto`` (argparse keeps the last value, so it
    overrides an earlier ``--resume none``); another program is restarted as it was and must resume itself."""
    argv = list(argv)
    if not _is_pretrain(argv) or argv[-2:] == ["--resume", "auto"]:
        return argv
    return [*argv, "--resume", "auto"]


def run_dir_of(argv: Sequence[str]) -> Path | None:
    """The program's ``--output`` (the run directory), the last one given; None when there is none."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--output" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--output="):
            found = arg.split("=", 1)[1]
    return Path(found) if found else None


def master_port(argv: Sequence[str], environ: dict[str, str] | None = None) -> int:
    """The rendezvous port: the launcher's ``--master_port``, else ``MASTER_PORT``, else 29500."""
    environ = os.environ if environ is None else environ
    for i, arg in enumerate(argv):
        if arg == "--master_port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--master_port="):
            return int(arg.split("=", 1)[1])
    return int(environ.get("MASTER_PORT", _DEFAULT_MASTER_PORT))


# ---- releasing the failed attempt's resources -----------------------------------------------------------------------
def port_free(port: int) -> bool:
    """Whether a listener could bind ``port`` now (``SO_REUSEADDR``, as torch's TCPStore binds: a connection of the
    reaped attempt in TIME_WAIT does not count, a live listener does)."""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((addr, port))
            return True
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno in (97, 99):  # no IPv6 here: ask IPv4
                continue
            return False
    return False


def wait_port_free(port: int, timeout_s: float = PORT_WAIT_S, poll_s: float = 0.5) -> float | None:
    """Wait until ``port`` binds; the seconds waited, or None when it was still taken after ``timeout_s``."""
    start = time.monotonic()
    while not port_free(port):
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(poll_s)
    return time.monotonic() - start


def mapped_shm_paths(proc: Path = Path("/proc")) -> set[str]:
    """Every ``/dev/shm`` file a live process maps (``/proc/PID/maps``; unreadable processes skipped)."""
    paths: set[str] = set()
    for maps in proc.glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text(errors="replace").splitlines():
                at = line.find("/dev/shm/")
                if at >= 0:
                    paths.add(line[at:].removesuffix(" (deleted)"))
    return paths


def release_shm_buffers(port: int, shm: Path = Path("/dev/shm")) -> list[Path]:
    """Unlink this user's DeepSpeed CPU all-reduce buffers of rendezvous ``port`` that no live process maps (the
    reaped attempt's; ``bert_ds.deepspeed_internals.SHM_BUFFER_GLOB``). The same name is what the next attempt's
    ranks create and open, so a stale one would hand a new rank its dead predecessor's flags."""
    if not shm.is_dir():
        return []
    mapped, removed = mapped_shm_paths(), []
    for seg in shm.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        if str(seg) not in mapped:
            with contextlib.suppress(OSError):
                seg.unlink()
                removed.append(seg)
    return removed


# ---- the record ---------------------------------------------------------------------------------------------------
@dataclass
class Attempt:
    """One attempt of the job, as the supervisor saw it end."""

    number: int
    """1-based: attempt 1 is the first start, attempt k + 1 follows restart k."""
    code: int
    seconds: float
    """From its start to its end (every process reaped)."""
    failing: str = ""
    """Which rank failed first, where (``rank 1 (host h, local rank 1, pid P)``); empty when unknown."""
    host: str = ""


def restart_line(prog: str, restart: int, max_restarts: int, failed: Attempt, resumed: str | None, lost_s: float,
                 wait_s: float) -> str:
    """The one line of a restart: restart k of N, the failing rank and host, its code or signal, the checkpoint
    resumed, the seconds lost."""
    who = failed.failing or f"a rank on {failed.host or socket.gethostname()}"
    return (f"{prog}: restart {restart} of {max_restarts}: {who} {describe_code(failed.code)}; resuming from "
            f"{resumed or 'the start (no checkpoint yet)'} in {wait_s:.0f} s; {lost_s:.0f} s lost")


def summary_line(prog: str, attempts: Sequence[Attempt], max_restarts: int, reason: str | None = None) -> str:
    """Every attempt in one line, ending with the command's code (the last attempt's)."""
    parts = [f"attempt {a.number}: {a.failing + ' ' if a.failing else ''}{describe_code(a.code)} after "
             f"{a.seconds:.0f} s" for a in attempts]
    why = reason or f"--max-restarts {max_restarts} used up"
    return f"{prog}: {len(attempts)} attempt(s), {why}: {'; '.join(parts)}; exit {attempts[-1].code}"


class RestartLog:
    """``RUN_DIR/restarts.jsonl`` and the supervisor's TensorBoard events (``RUN_DIR/tensorboard``); a run directory
    that cannot be written only loses the record, never the restart."""

    def __init__(self, run_dir: Path | None) -> None:
        self.run_dir = run_dir

    def append(self, record: dict) -> None:
        if self.run_dir is None:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / LOG_NAME, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        except OSError as exc:
            log.warning("cannot write %s: %s", self.run_dir / LOG_NAME, exc)

    def restart(self, restart: int, max_restarts: int, failed: Attempt, resumed: str | None, lost_s: float,
                line: str) -> None:
        self.append({"restart": restart, "of": max_restarts, "attempt": asdict(failed), "signal":
                     signal_name(failed.code), "resumed": resumed, "seconds_lost": round(lost_s, 1), "line": line,
                     "time": time.time()})
        self._tensorboard(restart, lost_s, line)

    def _tensorboard(self, restart: int, lost_s: float, line: str) -> None:
        if self.run_dir is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter

            with SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), filename_suffix=".restarts") as writer:
                writer.add_scalar("restarts/count", restart, global_step=restart)
                writer.add_scalar("restarts/seconds_lost", lost_s, global_step=restart)
                writer.add_text("restarts", line, global_step=restart)
        except Exception as exc:  # noqa: BLE001 - TensorBoard missing or the directory unwritable: the JSON has it
            log.warning("restart %d not written to TensorBoard: %s", restart, exc)


def stalled_ranks_named(run_dir: Path | None) -> str:
    """After a stall (124): the ranks the watchdog blamed, named from ``RUN_DIR/heartbeat`` -- those not among the
    reporting ones (:class:`~bert_ds.lifecycle.hang_watchdog.Heartbeat`); empty when unreadable."""
    if run_dir is None or not (run_dir / "heartbeat").is_dir():
        return ""
    beats = []
    for path in sorted((run_dir / "heartbeat").glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            beats.append(json.loads(path.read_text()))
    silent = [b for b in beats if not b.get("reporting")]
    if not beats or not silent or len(silent) == len(beats):
        return ""
    return "stalled " + ", ".join(f"rank {b['rank']} (host {b['host']}, local rank {b['local_rank']}, pid {b['pid']})"
                                  for b in silent)


@dataclass(frozen=True)
class Ended:
    """How one attempt ended, as the supervisor tells it."""

    code: int
    preempted: bool
    """The supervisor itself was signalled: never restarted."""
    failing: str = ""


def _resumable(run_dir: Path | None) -> tuple[str | None, float | None]:
    """(the newest checkpoint ``--resume auto`` starts from, when ``latest`` moved to it); (None, None) for none.
    A tag that fails its checksums is skipped by the ranks, which name the older one they resume instead."""
    if run_dir is None:
        return None, None
    from bert_ds import checkpoint as ckpt

    ckpt_dir = ckpt.checkpoint_dir(run_dir)
    try:
        tag = ckpt.read_latest(ckpt_dir)
        return (tag, (ckpt_dir / "latest").stat().st_mtime) if tag else (None, None)
    except Exception:  # noqa: BLE001 - a half-written tag: the ranks decide what they resume, and say so
        return None, None


class Restarts:
    """The restart loop around a supervisor's attempts: the policy, the clean-up between them, the records."""

    def __init__(self, prog: str, argv: Sequence[str], max_restarts: int, backoff_base_s: float,
                 hosts_rank0: bool = True) -> None:
        self.prog, self.argv, self.max_restarts, self.base_s = prog, list(argv), max_restarts, backoff_base_s
        self.hosts_rank0 = hosts_rank0
        """This node's supervisor hosts rank 0 (waits for its port, frees its buffers); per-node launches: node 0."""
        self.run_dir = run_dir_of(argv)
        self.log = RestartLog(self.run_dir)
        self.attempts: list[Attempt] = []

    def run(self, attempt: Callable[[list[str], bool], Ended], stopping: Callable[[], bool] = lambda: False) -> int:
        """Run ``attempt(args, restart_follows)`` until it succeeds, fails for good or the restarts run out; the
        command's exit code."""
        args = self.argv
        while True:
            started, wall = time.monotonic(), time.time()
            ended = attempt(args, len(self.attempts) < self.max_restarts)
            failing = ended.failing if ended.code != ExitCode.OK else ""
            if ended.code == ExitCode.STALLED:
                failing = stalled_ranks_named(self.run_dir) or failing
            self.attempts.append(Attempt(len(self.attempts) + 1, ended.code, time.monotonic() - started, failing,
                                         socket.gethostname()))
            reason = why_not_restarted(ended.code, ended.preempted)
            if ended.code == ExitCode.OK or reason is not None or len(self.attempts) > self.max_restarts:
                return self._end(reason)
            if not self._between(wall, stopping):
                return self._end("the supervisor was signalled between attempts")
            args = resume_args(self.argv)

    def _end(self, reason: str | None) -> int:
        last = self.attempts[-1]
        if len(self.attempts) > 1:
            line = (summary_line(self.prog, self.attempts, self.max_restarts, "done") if last.code == ExitCode.OK
                    else summary_line(self.prog, self.attempts, self.max_restarts, reason))
            _say(line)
            self.log.append({"summary": line, "attempts": [asdict(a) for a in self.attempts], "exit": last.code,
                             "time": time.time()})
        return last.code

    def _between(self, wall_start: float, stopping: Callable[[], bool]) -> bool:
        """Release the failed attempt's resources, record the restart, wait the backoff; False when a signal to the
        supervisor came meanwhile."""
        deadline = time.monotonic() + backoff_s(len(self.attempts), self.base_s)
        self.record_restart(wall_start, deadline)
        while time.monotonic() < deadline:
            if stopping():
                return False
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return not stopping()

    def record_restart(self, wall_start: float, deadline: float, restart: int | None = None) -> None:
        """Release rank 0's resources, then one line and one record for restart ``restart`` (default: one per
        attempt so far), after the last attempt (which started at ``wall_start``, epoch seconds; the next starts at
        ``deadline``, monotonic)."""
        self._release()
        restart, failed = restart or len(self.attempts), self.attempts[-1]
        resumed, saved_at = _resumable(self.run_dir)
        wait = max(0.0, deadline - time.monotonic())
        lost = time.time() + wait - max(wall_start, saved_at or wall_start)
        line = restart_line(self.prog, restart, self.max_restarts, failed, resumed, lost, wait)
        _say(line)
        self.log.restart(restart, self.max_restarts, failed, resumed, lost, line)

    def _release(self) -> None:
        """Rank 0's port free and its all-reduce buffers gone (every process of the attempt is reaped by now)."""
        if not self.hosts_rank0:
            return
        port = master_port(self.argv)
        if wait_port_free(port) is None:
            _say(f"{self.prog}: MASTER_PORT {port} still taken {PORT_WAIT_S:.0f} s after the failed attempt ended; "
                 f"starting anyway")
        for seg in release_shm_buffers(port):
            log.info("removed the failed attempt's all-reduce buffer %s", seg)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def step_restart(argv: Sequence[str]) -> int:
    """The Slurm scripts' restart of an ``srun`` step (``slurm/pretrain_common.sh``), between its steps, on the batch
    host (rank 0's node): ``RUN_DIR MASTER_PORT RESTART MAX_RESTARTS CODE STARTED_EPOCH BACKOFF_BASE_S STEP``.
    Releases rank 0's port and buffers, writes the restart's line (stderr) and records, and prints the seconds still
    to wait (stdout); 0."""
    run_dir, port, number, max_restarts, code, started, base_s, step = argv
    loop = Restarts(f"bert_ds (srun step {step})", ["--output", run_dir, "--master_port", port], int(max_restarts),
                    float(base_s))
    loop.attempts = [Attempt(int(number), int(code), time.time() - float(started), "a rank of the step",
                             socket.gethostname())]
    deadline = time.monotonic() + backoff_s(int(number), loop.base_s)
    loop.record_restart(float(started), deadline, int(number))
    print(f"{max(0.0, deadline - time.monotonic()):.1f}")
    return 0
