"""The progress watchdog: a rank that stops making progress ends the job with exit 124 and a line naming it.

The training loop marks each stretch of work (a phase's set-up, a training step, an evaluation, a checkpoint save) with
:meth:`StallWatchdog.begin`. A daemon thread rewrites this rank's heartbeat (what it is doing and for how long, its
main thread's current Python frame, a beat counter) to ``RUN_DIR/heartbeat/rank<r>.json`` every few seconds and
checks its own rank: a stretch older than its bound (:func:`allowed_s`) is a stall. When any rank stops, every other
rank stops too, in the next collective, so each rank decides alone, on its own clock, without a collective. It then
reads every rank's heartbeat twice a few beats apart and names the ranks whose beat did not move (a stopped process, a
lost node or file system), else the ranks behind the others, else all (:func:`stalled_ranks`), prints one line and
exits 124 with ``os._exit``: a collective is stuck and nothing can unwind it. The heartbeats live on the run directory
because every node already shares it (checkpoints need it) and it stays readable whichever rank is gone; the TCP store
would not, since rank 0 hosts it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from bert_ds import checkpoint as ckpt
from bert_ds.errors import error_lines
from bert_ds.exit_codes import ExitCode

__all__ = ["DEFAULT_FLOOR_S", "EXIT_STALLED", "SLOW_FLOOR_S", "STEP_FACTOR", "Heartbeat", "NoWatchdog",
           "StallWatchdog", "allowed_s", "beat_interval_s", "read_heartbeats", "stall_message", "stalled_ranks",
           "start_watchdog", "step_bound"]

log = logging.getLogger(__name__)

DEFAULT_FLOOR_S = 300.0
"""The default bound's floor: half DeepSpeed's default process-group timeout (10 minutes), so the watchdog names the
stalled rank before that timeout can end the waiting collective with an error that names none."""
STEP_FACTOR = 10.0
"""The default bound is this many times the slowest training step seen so far (above the floor)."""
SLOW_FLOOR_S = 1800.0
"""A phase's set-up, its first step (kernel compilation, loader start-up, the first collective), an evaluation and a
checkpoint save are allowed at least this long, whatever the step bound: they are not steps, and a long save or a
first step's JIT must never end a healthy run."""
EXIT_STALLED = ExitCode.STALLED


def step_bound(step_timeout: float | None, slowest_step_s: float | None) -> float:
    """The longest a training step may take: ``--step-timeout`` when given, else max(``DEFAULT_FLOOR_S``,
    ``STEP_FACTOR`` x the slowest step seen so far)."""
    if step_timeout is not None:
        return step_timeout
    return max(DEFAULT_FLOOR_S, STEP_FACTOR * (slowest_step_s or 0.0))


def allowed_s(bound: float, slow: bool) -> float:
    """How long a stretch may last: the step bound, or at least ``SLOW_FLOOR_S`` for a slow stretch."""
    return max(bound, SLOW_FLOOR_S) if slow else bound


def beat_interval_s(bound: float) -> float:
    """Seconds between heartbeats: a twentieth of the bound, within [0.5, 10] (few writes to a shared file system,
    a stall seen within 5% of the bound)."""
    return min(10.0, max(0.5, bound / 20))


@dataclass(frozen=True)
class Heartbeat:
    """One rank's record in ``RUN_DIR/heartbeat/``, as its watchdog thread last wrote it."""

    rank: int
    local_rank: int
    host: str
    pid: int
    beat: int
    """Rewrites so far: it moves as long as the process runs, whatever its main thread is stuck in."""
    seq: int
    """Stretches begun so far: every rank runs the same loop, so a rank with fewer is behind the others."""
    doing: str
    for_s: float
    """Seconds the main thread had been in ``doing`` when this was written."""
    where: str
    """The main thread's innermost bert_ds frame, then its innermost frame."""
    reporting: bool = False
    """This rank saw a stall and is exiting: alive, whatever its beat does next."""

    def names(self) -> str:
        return f"rank {self.rank} (host {self.host}, local rank {self.local_rank}, pid {self.pid})"


def read_heartbeats(run_dir: str | Path, world_size: int) -> dict[int, Heartbeat | None]:
    """Every rank's heartbeat in ``run_dir`` (None where none is readable)."""
    found: dict[int, Heartbeat | None] = {}
    for rank in range(world_size):
        try:
            found[rank] = Heartbeat(**json.loads(ckpt.heartbeat_file(run_dir, rank).read_text()))
        except (OSError, ValueError, TypeError):
            found[rank] = None
    return found


def _responding(before: Heartbeat | None, after: Heartbeat | None) -> bool:
    return after is not None and (after.reporting or before is None or after.beat != before.beat)


def stalled_ranks(before: dict[int, Heartbeat | None], after: dict[int, Heartbeat | None],
                  world_size: int) -> tuple[list[int], str]:
    """The ranks to blame for a stall, and why, from two readings of the heartbeats a few beats apart: the ranks that
    did not respond (their beat did not move, or no heartbeat is readable); else the ranks behind the others (fewer
    stretches begun: the others wait for them in a collective); else every rank."""
    silent = [r for r in range(world_size) if not _responding(before.get(r), after.get(r))]
    if silent:
        return silent, "not responding: process stopped, or its node or file system is gone"
    seqs = {r: after[r].seq for r in range(world_size)}
    behind = [r for r, s in seqs.items() if s < max(seqs.values())]
    if behind:
        return [r for r in behind if seqs[r] == min(seqs.values())], "behind the others, who wait for it"
    return list(range(world_size)), "every rank stopped at the same point"


PROG = "bert_ds.runtime.pretrain"
"""The error-line prefix of a pre-training rank (``bert_ds.runtime.pretrain.PROG``; this module sits below it)."""


def stall_message(me: Heartbeat, stuck_s: float, bound_s: float, blamed: list[int], why: str,
                  beats: dict[int, Heartbeat | None]) -> str:
    """The one line every live rank prints before it exits 124."""
    parts = []
    for rank in blamed:
        hb = beats.get(rank)
        if hb is None:
            parts.append(f"rank {rank} (no heartbeat readable)")
        else:
            parts.append(f"{hb.names()} last did {hb.doing!r} for {hb.for_s:.0f} s at {hb.where}")
    body = (f"stalled: {'; '.join(parts)} ({why}); seen by rank {me.rank} (pid {me.pid}), in {me.doing!r} for "
            f"{stuck_s:.0f} s, over its bound of {bound_s:.0f} s; exit {int(EXIT_STALLED)}, resume with --resume auto")
    return error_lines(PROG, body).rstrip("\n")


def _frame_of(thread_id: int) -> str:
    """``file:line function`` of the thread's innermost bert_ds frame, then of its innermost frame."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None and frame.f_code.co_filename == __file__:  # a heartbeat the thread writes itself
        frame = frame.f_back
    if frame is None:
        return "(thread gone)"
    inner = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
    own = frame
    while own is not None and f"{os.sep}bert_ds{os.sep}" not in own.f_code.co_filename:
        own = own.f_back
    if own is None or own is frame:
        return inner
    return f"{Path(own.f_code.co_filename).name}:{own.f_lineno} {own.f_code.co_name} > {inner}"


def _stderr_line(line: str) -> None:
    # os.write: the main thread may hold sys.stderr's lock while it is stuck.
    os.write(2, (line + "\n").encode(errors="replace"))


class NoWatchdog:
    """``--step-timeout 0``: marks are ignored, no thread, no heartbeat files."""

    def begin(self, doing: str, slow: bool = False) -> None:
        pass

    def stop(self) -> None:
        pass


class StallWatchdog:
    """This rank's marks and watchdog thread. ``begin`` is called by the training loop (the thread it is created
    in); the thread beats, checks and, on a stall, reports and exits. ``clock``, ``exit`` and ``report`` are
    injectable for tests."""

    def __init__(self, run_dir: str | Path, rank: int, world_size: int, step_timeout: float | None, *,
                 local_rank: int | None = None, before_exit: Iterable[Callable[[], object]] = (),
                 clock: Callable[[], float] = time.monotonic, exit: Callable[[int], object] = os._exit,
                 report: Callable[[str], None] = _stderr_line) -> None:
        self.run_dir, self.rank, self.world_size, self.step_timeout = Path(run_dir), rank, world_size, step_timeout
        self.local_rank = rank if local_rank is None else local_rank
        self.before_exit, self.clock, self.exit, self.report = tuple(before_exit), clock, exit, report
        self._host, self._pid, self._main = socket.gethostname(), os.getpid(), threading.get_ident()
        self._lock = threading.Lock()
        self._doing, self._slow, self._seq, self._started = "start-up", True, 0, clock()
        self._slowest: float | None = None
        self._beat, self._reporting, self._last_tick, self._write_failed = 0, False, None, False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the training loop's side -------------------------------------------------------------------------------
    def begin(self, doing: str, slow: bool = False) -> None:
        """A new stretch starts now (``slow``: set-up, a first step, an evaluation, a save). The stretch it ends, if a
        training step, counts towards the default bound."""
        with self._lock:
            now = self.clock()
            if not self._slow:
                self._slowest = max(self._slowest or 0.0, now - self._started)
            self._doing, self._slow, self._seq, self._started = doing, slow, self._seq + 1, now

    @property
    def bound_s(self) -> float:
        return step_bound(self.step_timeout, self._slowest)

    @property
    def beat_s(self) -> float:
        return beat_interval_s(self.bound_s)

    def start(self) -> StallWatchdog:
        """Write the first heartbeat (before this rank's first collective, so no rank reads a stale one of an earlier
        run once training runs) and start the thread."""
        self._write()
        self._thread = threading.Thread(target=self._watch, name="bert_ds-stall-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # ---- the thread's side --------------------------------------------------------------------------------------
    def heartbeat(self) -> Heartbeat:
        with self._lock:
            doing, seq, for_s = self._doing, self._seq, self.clock() - self._started
        return Heartbeat(rank=self.rank, local_rank=self.local_rank, host=self._host, pid=self._pid, beat=self._beat,
                         seq=seq, doing=doing, for_s=round(for_s, 1), where=_frame_of(self._main),
                         reporting=self._reporting)

    def _write(self) -> None:
        self._beat += 1
        path = ckpt.heartbeat_file(self.run_dir, self.rank)
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(asdict(self.heartbeat())))
            os.replace(tmp, path)
        except OSError as exc:  # never a reason to stop training; the others then see this rank as silent
            if not self._write_failed:
                log.warning("rank %d cannot write its heartbeat %s: %s", self.rank, path, exc)
            self._write_failed = True

    def tick(self, now: float) -> None:
        """Called once per beat. Time this thread did not run (the whole process stopped, a suspended machine) is not
        counted against the stretch: only a rank that runs while its peer does not can judge."""
        if self._last_tick is not None:
            missed = now - self._last_tick - self.beat_s
            if missed > max(5.0, 2 * self.beat_s):
                with self._lock:
                    self._started += missed
        self._last_tick = now

    def overdue(self, now: float) -> float | None:
        """Seconds in the current stretch if that is over its bound, else None."""
        with self._lock:
            age, slow = now - self._started, self._slow
        return age if age > allowed_s(self.bound_s, slow) else None

    def _watch(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                now = self.clock()
                self.tick(now)
                self._write()
                stuck = self.overdue(now)
            except Exception:  # a bad beat must not end the watch: this rank would never report a stall
                log.exception("rank %d: progress watchdog beat failed", self.rank)
                continue
            if stuck is not None and not self._stop.is_set():
                self.fire(stuck)
                return

    def fire(self, stuck_s: float) -> None:
        """Name the stalled ranks (two readings of every heartbeat, at least 3 beats and 5 s apart, beating in
        between), print one line, run ``before_exit`` (10 s at most) and exit 124."""
        self._reporting = True
        self._write()
        before = read_heartbeats(self.run_dir, self.world_size)
        window_end = self.clock() + max(3 * self.beat_s, 5.0)
        while self.clock() < window_end:
            self._stop.wait(min(self.beat_s, max(0.0, window_end - self.clock())))
            self._write()
        after = read_heartbeats(self.run_dir, self.world_size)
        blamed, why = stalled_ranks(before, after, self.world_size)
        me = self.heartbeat()
        bound = allowed_s(self.bound_s, self._slow)
        self.report(stall_message(me, stuck_s, bound, blamed, why, {**before, **{k: v for k, v in after.items()
                                                                                 if v is not None}}))
        self._finish()

    def _finish(self) -> None:
        def flush() -> None:
            for fn in self.before_exit:
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - exiting anyway; say what was not flushed
                    self.report(f"{PROG}: warning: {getattr(fn, '__name__', fn)} failed: {exc}")
            for handler in logging.getLogger().handlers:
                handler.flush()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()

        helper = threading.Thread(target=flush, name="bert_ds-stall-flush", daemon=True)
        helper.start()
        helper.join(timeout=10)  # a flush stuck behind the stuck main thread must not keep the rank alive
        self.exit(int(EXIT_STALLED))


def start_watchdog(run_dir: str | Path, rank: int, world_size: int, step_timeout: float | None,
                   before_exit: Iterable[Callable[[], object]] = ()) -> StallWatchdog | NoWatchdog:
    """This rank's watchdog, started (``step_timeout`` 0: none); its rule is logged once, on rank 0."""
    if step_timeout == 0:
        return NoWatchdog()
    if rank == 0:
        rule = (f"{step_timeout:g} s (--step-timeout)" if step_timeout is not None else
                f"max({DEFAULT_FLOOR_S:.0f} s, {STEP_FACTOR:g} x the slowest step so far)")
        log.info("progress watchdog: a training step may take %s; set-up, a first step, an evaluation or a save at "
                 "least %.0f s; a stall exits %d (--step-timeout 0 turns it off)", rule, SLOW_FLOOR_S,
                 int(EXIT_STALLED))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return StallWatchdog(run_dir, rank, world_size, step_timeout, local_rank=local_rank,
                         before_exit=before_exit).start()
