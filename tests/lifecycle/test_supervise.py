"""``bert-ds deepspeed`` (bert_ds.lifecycle.supervise) and ``bert-ds mpirun`` without ranks: how the job's exit code is
decided, the files a rank reports through, the grace ``mpirun`` is given, and a refusal that starts nothing. The
supervisor with real ranks and real signals: ``tests/faults/test_fault_table_preemption.py`` and
``tests/launch/test_preemption_launchers.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bert_ds.exit_codes import ExitCode
from bert_ds.lifecycle import supervise, supervise_mpirun
from tests.helpers import HANG_GUARD_S


@pytest.mark.parametrize(("reports", "runner", "signalled", "want"), [
    ({}, 0, False, 0),  # a finished run
    ({11: 0, 12: 0}, 0, False, 0),
    ({11: 75, 12: 75}, 75, True, 75),  # pre-empted and saved; the runner passed 75 on
    ({11: 75}, -15, True, 75),  # the runner died of the TERM; rank 12 killed before it reported: 11 saved first
    ({11: 75, 12: 75}, -15, False, 75),  # DeepSpeed's runner alone was TERMed; the ranks saved
    ({}, -15, True, 75),  # every process TERMed during start-up, before any rank armed: nothing written, resubmit
    ({11: 2, 12: 75}, -15, True, 2),  # a failure a rank reported wins over a pre-emption
    ({11: 124, 12: 124}, 124, False, 124),
    # rank 12 SIGKILLed: launch.py passes on its -9 (247, which the supervisor then reports as 137,
    # exit_codes.from_negated_signal); rank 11's later error is moot
    ({11: 2}, 247, False, 247),
    ({}, -9, False, 137),  # the runner itself SIGKILLed, no rank reported
    ({11: 0, 12: 0}, -15, False, 143),
    # launch.py met rank 12's 1 first in its poll, but rank 11 reported its 2 before: 12's 1 was the dead peer
    ({11: 2, 12: 1}, 1, False, 2),
    ({12: 1, 11: 2}, 2, False, 1),  # the other way round: rank 12 failed first
    ({11: 1, 12: 1}, 137, False, 137),  # a rank killed (no report): the runner's signal code stands
    ({11: 75, 12: 2}, 75, True, 75),  # the runner passed on a saved pre-emption: it stands
])
def test_the_job_exit_code(reports, runner, signalled, want):
    assert supervise.exit_code_of(reports, runner, preempted=signalled) == want


@pytest.mark.parametrize(("reports", "runner", "signalled", "want"), [
    ({11: 0, 12: 0}, 0, False, 0),  # a finished run
    ({11: 75}, 1, True, 75),  # mpirun aborted the job after rank 11 exited 75 and killed rank 12 on the way: exit 1
    ({11: 75, 12: 75}, 75, True, 75),
    ({11: 2, 12: 2}, 2, False, 2),
    ({11: 1}, 1, False, 1),  # a loader worker died on rank 11
    ({11: 1}, 137, False, 137),  # rank 12 SIGKILLed first (mpirun's own 137); rank 11's 1 came from the dead peer
    ({}, 137, False, 137),  # a rank SIGKILLed before reporting: mpirun's own code
    ({}, -15, True, 75),  # mpirun TERMed (not through the supervisor) during start-up
    ({11: 75, 12: 75}, 1, False, 75),  # TERM to mpirun alone: Open MPI TERMed the ranks, they saved; mpirun exits 1
    ({11: 0, 12: 0}, 1, False, 1),  # the same, but the run had ended first: mpirun's 1 stands
    ({12: 1, 11: 2}, 1, False, 1),  # rank 12 reported first: its failure is the job's
])
def test_the_job_exit_code_under_mpirun(reports, runner, signalled, want):
    assert supervise.exit_code_of(reports, runner, preempted=signalled, runner_knows=False) == want


def test_reports_are_read_in_the_order_they_were_made(tmp_path, monkeypatch):
    """The report files' modification times order them, not their pids: the job's code is the earliest failure."""
    monkeypatch.setenv(supervise.DIR_ENV, str(tmp_path))
    for pid, code, when in ((300, 1, 2_000), (200, 75, 3_000), (100, 2, 1_000)):
        monkeypatch.setattr(os, "getpid", lambda pid=pid: pid)
        supervise.report_exit(code)
        os.utime(tmp_path / f"exit.{pid}", ns=(when, when))
    (tmp_path / "exit.400.tmp").write_text("3")  # a report being written is not read
    reports = supervise.read_reports(tmp_path)
    assert list(reports.items()) == [(100, 2), (300, 1), (200, 75)]
    assert supervise.exit_code_of(reports, 1, preempted=False) == 2


@pytest.mark.parametrize(("argv", "environ", "want"), [
    (["-np", "2", "prog"], {}, ["--mca", "odls_base_sigkill_timeout", "10"]),
    (["--mca", "odls_base_sigkill_timeout", "60", "-np", "2", "prog"], {}, []),  # the user's value stands
    (["-np", "2", "prog"], {"OMPI_MCA_odls_base_sigkill_timeout": "60"}, []),
    (["--help"], {}, []),
    ([], {}, []),
])
def test_mpirun_gets_a_sigkill_timeout_unless_the_user_set_one(argv, environ, want):
    assert supervise_mpirun.mpirun_options(argv, environ) == want


def test_a_rank_reports_only_under_a_supervisor(tmp_path, monkeypatch):
    monkeypatch.delenv(supervise.DIR_ENV, raising=False)
    supervise.arm()
    supervise.report_exit(75)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(supervise.DIR_ENV, str(tmp_path))
    supervise.arm()
    supervise.report_exit(ExitCode.PREEMPTED)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"armed.{os.getpid()}", f"exit.{os.getpid()}"]
    assert (tmp_path / f"exit.{os.getpid()}").read_text() == "75"


@pytest.mark.parametrize(("module", "launcher"), [("bert_ds.lifecycle.supervise", "deepspeed"),
                                                  ("bert_ds.lifecycle.supervise_mpirun", "mpirun")])
def test_no_arguments_is_refused_before_anything_starts(module, launcher):
    proc = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc
    assert f": error: give {launcher}'s arguments" in proc.stderr
    assert len(proc.stderr.splitlines()) == 2, proc.stderr  # usage and the error: no launcher was started
