"""The hang watchdog's decisions, in-process (``bert_ds.lifecycle.hang_watchdog``): the bound, the slow stretches,
time a stopped process did not run, who is named, the line, the exit. A fake clock drives it; no thread sleeps for
a bound.
The real launch (one rank SIGSTOPped, the job ends 124 naming it) is ``tests/faults/test_fault_table_stall.py``."""

from __future__ import annotations

import json
import threading

import pytest

from bert_ds import checkpoint as ckpt
from bert_ds.exit_codes import ExitCode
from bert_ds.lifecycle import hang_watchdog
from bert_ds.lifecycle.hang_watchdog import Heartbeat, StallWatchdog, allowed_s, stalled_ranks, step_bound
from bert_ds.runtime.preflight import RunArgs
from bert_ds.runtime.pretrain import parse_args


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Exited(BaseException):
    pass


def _watchdog(tmp_path, step_timeout=None, rank=0, world_size=2, **kw):
    clock, lines, codes = Clock(), [], []

    def exit_(code: int) -> None:
        codes.append(code)
        raise Exited

    wd = StallWatchdog(tmp_path, rank, world_size, step_timeout, clock=clock, exit=exit_, report=lines.append, **kw)
    return wd, clock, lines, codes


def _hb(rank: int, beat: int, seq: int = 5, reporting: bool = False, doing: str = "phase 1 step 7: training step"):
    return Heartbeat(rank=rank, local_rank=rank, host="node0", pid=100 + rank, beat=beat, seq=seq, doing=doing,
                     for_s=3.0, where="trainer.py:99 _micro_batch > linear.py:1 forward", reporting=reporting)


# ---- the bound ------------------------------------------------------------------------------------------------------

def test_default_bound_is_a_floor_or_ten_times_the_slowest_step():
    assert step_bound(None, None) == hang_watchdog.DEFAULT_FLOOR_S == 300
    assert step_bound(None, 12.0) == 300
    assert step_bound(None, 45.0) == 450  # 10 x 45 s
    assert step_bound(20.0, 45.0) == 20  # --step-timeout wins
    assert allowed_s(20.0, slow=True) == hang_watchdog.SLOW_FLOOR_S == 1800 and allowed_s(20.0, slow=False) == 20
    assert allowed_s(7200.0, slow=True) == 7200


def test_the_slowest_step_is_measured_from_the_marks_not_counting_slow_stretches(tmp_path):
    wd, clock, _, _ = _watchdog(tmp_path)
    wd.begin("phase 1 step 1: training step", slow=True)  # the first step: JIT, loader start-up
    clock.now += 500
    wd.begin("phase 1 step 2: training step")
    clock.now += 40
    wd.begin("phase 1 step 2: checkpoint save", slow=True)
    clock.now += 900
    wd.begin("phase 1 step 3: training step")
    assert wd.bound_s == 400  # 10 x 40 s: neither the 500 s first step nor the 900 s save counted


def test_a_step_over_the_bound_is_overdue_a_slow_stretch_is_not(tmp_path):
    wd, clock, _, _ = _watchdog(tmp_path, step_timeout=20)
    wd.begin("phase 1 step 1: training step", slow=True)
    clock.now += 100
    assert wd.overdue(clock.now) is None  # a first step gets SLOW_FLOOR_S
    wd.begin("phase 1 step 2: training step")
    clock.now += 19.5
    assert wd.overdue(clock.now) is None
    clock.now += 1
    assert wd.overdue(clock.now) == pytest.approx(20.5)


def test_time_this_process_did_not_run_is_not_counted(tmp_path):
    """A whole job suspended (every rank SIGSTOPped, then SIGCONT) must not trip on resumption."""
    wd, clock, _, _ = _watchdog(tmp_path, step_timeout=20)
    wd.begin("phase 1 step 2: training step")
    for _ in range(5):
        clock.now += wd.beat_s
        wd.tick(clock.now)
    clock.now += 3600  # the thread did not run for an hour
    wd.tick(clock.now)
    assert wd.overdue(clock.now) is None
    for _ in range(22):  # then runs on time again: the bound counts from where it left off
        clock.now += wd.beat_s
        wd.tick(clock.now)
    assert wd.overdue(clock.now) is not None


# ---- who is named ---------------------------------------------------------------------------------------------------

def test_a_rank_whose_beat_did_not_move_is_named():
    before = {0: _hb(0, 10), 1: _hb(1, 4), 2: _hb(2, 9)}
    after = {0: _hb(0, 13), 1: _hb(1, 4), 2: _hb(2, 12)}
    ranks, why = stalled_ranks(before, after, 3)
    assert ranks == [1] and why.startswith("not responding")


def test_a_rank_that_is_reporting_is_alive_even_if_it_exited_in_between():
    before = {0: _hb(0, 10, reporting=True), 1: _hb(1, 4)}
    after = {0: _hb(0, 10, reporting=True), 1: _hb(1, 4)}
    assert stalled_ranks(before, after, 2)[0] == [1]


def test_a_missing_heartbeat_is_named():
    assert stalled_ranks({0: _hb(0, 1)}, {0: _hb(0, 2), 1: None}, 2)[0] == [1]


def test_with_every_rank_alive_the_ranks_behind_are_named_else_all():
    before = {0: _hb(0, 10, seq=9), 1: _hb(1, 4, seq=8), 2: _hb(2, 9, seq=9)}
    after = {0: _hb(0, 13, seq=9), 1: _hb(1, 7, seq=8), 2: _hb(2, 12, seq=9)}
    ranks, why = stalled_ranks(before, after, 3)
    assert ranks == [1] and "behind" in why
    level = {r: _hb(r, 20 + r, seq=9) for r in range(3)}
    assert stalled_ranks(before, level, 3) == ([0, 1, 2], "every rank stopped at the same point")


# ---- the heartbeat file, the line, the exit ------------------------------------------------------------------------

def test_the_heartbeat_names_host_local_rank_pid_activity_and_frame(tmp_path):
    wd, _, _, _ = _watchdog(tmp_path, step_timeout=20, rank=1, local_rank=1)
    wd.begin("phase 1 step 3: training step")
    wd.start()
    wd.stop()
    record = json.loads(ckpt.heartbeat_file(tmp_path, 1).read_text())
    assert record["rank"] == 1 and record["local_rank"] == 1 and record["pid"] > 0 and record["host"]
    assert record["doing"] == "phase 1 step 3: training step" and record["beat"] >= 1
    assert "test_hang_watchdog.py" in record["where"]  # the main thread's frame, read by another thread
    assert hang_watchdog.read_heartbeats(tmp_path, 2) == {1: Heartbeat(**record), 0: None}


def test_fire_names_the_silent_rank_in_one_line_and_exits_124(tmp_path, monkeypatch):
    """Rank 0 of 2 fires; rank 1's heartbeat never moves: the line names rank 1's host, local rank, pid and what it
    did; ``before_exit`` runs; the exit code is STALLED."""
    flushed = []
    wd, clock, lines, codes = _watchdog(tmp_path, step_timeout=20, before_exit=[lambda: flushed.append(1)])
    frozen = _hb(1, 4, doing="phase 1 step 7: training step")
    path = ckpt.heartbeat_file(tmp_path, 1)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(frozen.__dict__))
    wd.begin("phase 1 step 7: training step")
    monkeypatch.setattr(wd._stop, "wait", lambda s: clock.__setattr__("now", clock.now + max(s, 0.5)))
    with pytest.raises(Exited):
        wd.fire(21.0)
    assert codes == [ExitCode.STALLED] == [124] and flushed == [1] and len(lines) == 1
    line = lines[0]
    assert line.startswith("bert_ds.runtime.pretrain: error: stalled: rank 1 (host node0, local rank 1, pid 101) "
                           "last did 'phase 1 step 7: training step'"), line
    assert "not responding" in line and "seen by rank 0" in line and "exit 124" in line and "\n" not in line


def test_a_stop_ends_the_thread_without_exiting(tmp_path):
    wd, _, _, codes = _watchdog(tmp_path, step_timeout=1)
    wd.start()
    wd.stop()
    assert codes == [] and not any(t.name == "bert_ds-stall-watch" for t in threading.enumerate())


def test_step_timeout_zero_is_no_watchdog_and_writes_nothing(tmp_path):
    wd = hang_watchdog.start_watchdog(tmp_path, 0, 2, 0)
    wd.begin("phase 1 step 1: training step")
    wd.stop()
    assert isinstance(wd, hang_watchdog.NoWatchdog) and not (tmp_path / ckpt.HEARTBEAT_DIR).exists()


# ---- the command line -----------------------------------------------------------------------------------------------

ARGS = ["--recipe", "r.json", "--data", "d", "--output", "o", "--tokenizer", "t"]


@pytest.mark.parametrize("value", ["-1", "0.5", "nan", "inf"])
def test_a_bad_step_timeout_is_one_line_and_exit_2(value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([*ARGS, "--step-timeout", value])
    assert exc.value.code == 2
    assert f"error: --step-timeout {float(value):g}: give the seconds" in capsys.readouterr().err


def test_the_step_timeout_reaches_the_typed_arguments():
    assert parse_args([*ARGS, "--step-timeout", "45"]).step_timeout == 45.0
    assert parse_args([*ARGS, "--step-timeout", "0"]).step_timeout == 0
    assert parse_args(ARGS).step_timeout is None
    with pytest.raises(ValueError, match="--step-timeout -3"):
        RunArgs(recipe="r", data=["d"], output="o", tokenizer="t", step_timeout=-3)


def test_the_stall_line_has_the_ranks_error_prefix():
    from bert_ds.lifecycle import hang_watchdog
    from bert_ds.runtime import pretrain

    assert hang_watchdog.PROG == pretrain.PROG
