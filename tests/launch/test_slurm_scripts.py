"""What ``slurm/pretrain_common.sh`` decides after its ranks end, without a cluster: the script runs under bash with a
fake ``srun`` (records its arguments, ends with a chosen exit code) and a fake ``scontrol`` (records ``requeue``) on
PATH and the variables Slurm would set. The real one-node Slurm runs of the same paths are in
``tests/launch/test_slurm_preemption.py``; these cover every branch in a second each.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from bert_ds.exit_codes import ExitCode
from tests.helpers.ranks import REPO

FAKE_SRUN = """#!/usr/bin/env bash
# Records its arguments; the rank step ends with $FAKE_SRUN_RC (a list: the k-th rank step ends with the k-th code, the
# last one repeating), a step running another program (the cache cleanup) runs it.
printf '%s\\n' "$*" >> "$FAKE_LOG"
while [[ "${1:-}" == --* ]]; do shift; done
if [ "${1:-}" = "$PYTHON" ]; then
  read -r -a codes <<< "${FAKE_SRUN_RC:-0}"
  n=$(grep -c "bert_ds.runtime.pretrain" "$FAKE_LOG")
  [ "$n" -gt "${#codes[@]}" ] && n=${#codes[@]}
  exit "${codes[$((n - 1))]}"
fi
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
printf 'scontrol %s\\n' "$*" >> "$FAKE_LOG"
if [ "$1 $2" = "show config" ]; then echo "KillWait                = 45 sec"; elif [ "$1" = show ]; then echo node01; fi
exit "${FAKE_REQUEUE_RC:-0}"
"""


@dataclass
class Job:
    rc: int
    stdout: str
    stderr: str
    calls: list[str]
    """Every fake srun / scontrol command line, in order."""
    job_tmp: Path
    """The job's node-local directory (``$TMPDIR/bert_ds-<job id>``)."""

    def srun_rank_step(self) -> str:
        return next(c for c in self.calls if "bert_ds.runtime.pretrain" in c)

    @property
    def requeued(self) -> bool:
        return "scontrol requeue 42" in self.calls


def run_job(tmp_path: Path, ranks_exit: int | str, *, restarts: int = 0, nodes: int = 1, plant_cache: bool = True,
            **env: str) -> Job:
    """``bash slurm/pretrain_base.sh`` as job 42 whose ranks (the fake srun) end with ``ranks_exit`` (``"137 0"``: the
    first step with 137, the next with 0); no restart inside the allocation unless ``MAX_RESTARTS`` is given."""
    bin_dir, node_tmp = tmp_path / "bin", tmp_path / "node-tmp"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job_tmp = node_tmp / "bert_ds-42"
    if plant_cache:  # what a compile left in the job's Triton cache
        (job_tmp / "triton").mkdir(parents=True, exist_ok=True)
        (job_tmp / "triton" / "kernel.cubin").write_bytes(b"\0")
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    base = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NTASKS": str(2 * nodes), "SLURM_TASKS_PER_NODE": f"2(x{nodes})" if nodes > 1 else "2",
            "SLURM_JOB_NODELIST": "node01", "SLURM_RESTART_COUNT": str(restarts), "TMPDIR": str(node_tmp),
            "RUN_DIR": str(tmp_path / "run"), "PYTHON": "python-of-the-ranks", "FAKE_LOG": str(log),
            "FAKE_SRUN_RC": str(ranks_exit), "MAX_RESTARTS": "0"}  # the restarts' own tests set it
    proc = subprocess.run(["bash", str(REPO / "slurm" / "pretrain_base.sh")], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=120)
    calls = log.read_text().splitlines() if log.exists() else []
    return Job(proc.returncode, proc.stdout, proc.stderr, calls, job_tmp)


@pytest.mark.parametrize("code", [ExitCode.PREEMPTED, ExitCode.STALLED])
def test_a_retryable_exit_requeues_and_keeps_the_job_caches(tmp_path, code):
    job = run_job(tmp_path, int(code), restarts=3)
    assert job.rc == code and job.requeued, (job.calls, job.stderr)
    assert "job 42 requeued (requeue 4 of at most MAX_REQUEUES=10)" in job.stderr
    assert (job.job_tmp / "triton" / "kernel.cubin").is_file(), "a requeued job keeps its id and so its caches"
    assert (tmp_path / "run" / "slurm" / "exit-42").read_text().strip() == str(int(code))


@pytest.mark.parametrize("code", [ExitCode.PREEMPTED, ExitCode.STALLED])
def test_the_requeue_cap_stops_the_job_in_one_line(tmp_path, code):
    job = run_job(tmp_path, int(code), restarts=2, MAX_REQUEUES="2")
    assert job.rc == code and not job.requeued, (job.calls, job.stderr)
    cap = [line for line in job.stderr.splitlines() if "requeue cap reached" in line]
    assert cap == [f"bert_ds: requeue cap reached: job 42 was requeued 2 time(s), MAX_REQUEUES=2; not requeued again, "
                   f"exit {int(code)}. Resubmit it (--resume auto continues) or raise MAX_REQUEUES"], job.stderr
    assert not job.job_tmp.exists(), "the job ended for good: its caches go"
    # One below the cap still requeues.
    assert run_job(tmp_path, int(code), restarts=1, MAX_REQUEUES="2").requeued


def test_max_requeues_defaults_to_10_and_refuses_a_non_number(tmp_path):
    assert run_job(tmp_path, 75, restarts=9).requeued
    assert not run_job(tmp_path, 75, restarts=10).requeued
    bad = run_job(tmp_path, 75, MAX_REQUEUES="ten")
    assert bad.rc == 2 and "MAX_REQUEUES=ten is not a number of requeues" in bad.stderr and not bad.calls


@pytest.mark.parametrize("code", [ExitCode.OK, ExitCode.FAILED, ExitCode.BAD_INPUT, ExitCode.NONFINITE])
def test_a_final_exit_removes_the_job_caches_and_does_not_requeue(tmp_path, code):
    job = run_job(tmp_path, int(code))
    assert job.rc == code and not job.requeued, (job.calls, job.stderr)
    assert not job.job_tmp.exists()
    assert f"job 42 ends for good: removed its node-local caches ({job.job_tmp})" in job.stderr


def test_caches_go_when_the_restart_is_left_to_a_follow_up_job_or_requeue_fails(tmp_path):
    chained = run_job(tmp_path, 75, REQUEUE="none")  # slurm/submit_chain.sh: the follow-up is a new job id
    assert chained.rc == 75 and not chained.requeued and not chained.job_tmp.exists()
    refused = run_job(tmp_path, 124, FAKE_REQUEUE_RC="1")
    assert refused.rc == 124 and "scontrol requeue 42" in refused.calls and not refused.job_tmp.exists()
    assert "stalled (exit 124): the newest checkpoint stands; requeue with 'scontrol' impossible here" in refused.stderr


def test_a_user_chosen_cache_outside_the_job_directory_is_left_alone(tmp_path):
    mine = tmp_path / "my-triton-cache"
    (mine / "x").mkdir(parents=True)
    job = run_job(tmp_path, 0, TRITON_CACHE_DIR=str(mine))
    assert job.rc == 0 and (mine / "x").is_dir() and not job.job_tmp.exists()


def test_every_node_removes_its_caches_with_one_task_each(tmp_path):
    job = run_job(tmp_path, 0, nodes=3)
    assert job.calls[-1] == f"--nodes=3 --ntasks=3 --ntasks-per-node=1 --kill-on-bad-exit=0 rm -rf -- {job.job_tmp}"
    assert not job.job_tmp.exists()


def test_srun_is_given_the_jobs_cpus_per_task(tmp_path):
    """Slurm 22.05+ srun no longer reads SLURM_CPUS_PER_TASK: without the flag a rank's step gets one CPU."""
    assert run_job(tmp_path, 0, SLURM_CPUS_PER_TASK="10").srun_rank_step().startswith(
        "--kill-on-bad-exit=0 --wait=60 --cpus-per-task=10 python-of-the-ranks -m bert_ds.runtime.pretrain")
    assert run_job(tmp_path, 0).srun_rank_step().startswith(
        "--kill-on-bad-exit=0 --wait=60 python-of-the-ranks -m bert_ds.runtime.pretrain")


@pytest.mark.parametrize("before, resumes", [(75, True), (124, True), (137, True), (2, False), (3, False)])
def test_a_follow_up_job_resumes_after_a_retryable_exit_only(tmp_path, before, resumes):
    (tmp_path / "run" / "slurm").mkdir(parents=True)
    (tmp_path / "run" / "slurm" / "exit-41").write_text(f"{before}\n")
    job = run_job(tmp_path, 0, REQUEUE="none", BERT_DS_AFTER_JOB="41")
    if resumes:
        assert job.rc == 0 and f"follow-up of job 41 (exit {before}): resuming from the newest checkpoint" in job.stdout
        assert "--resume auto" in job.srun_rank_step()
    else:
        assert job.rc == before and not job.calls, (job.calls, job.stderr)


def test_the_job_states_how_long_a_term_only_preemption_leaves_the_ranks(tmp_path):
    """Slurm's KillWait (TERM to SIGKILL) read from ``scontrol show config``, stated at start-up; no line without
    scontrol (a container), where the cluster's value cannot be read."""
    job = run_job(tmp_path, 0)
    assert "where Slurm sends TERM without --signal, it kills the ranks 45 s later (KillWait): the step and the save " \
           "(each save logs its duration) must fit in that" in job.stdout
    assert "KillWait" not in run_job(tmp_path, 0, SCONTROL=str(tmp_path / "absent")).stdout


def _rank_steps(job: Job) -> int:
    return sum("bert_ds.runtime.pretrain" in c for c in job.calls)


def test_a_crashed_or_killed_step_restarts_inside_the_allocation(tmp_path):
    """Issue 34: 137 (a rank SIGKILLed), then 1, then success: two restarts of the step, no requeue; each restart one
    line from bert_ds.lifecycle.restart (run by the ranks' Python) and one record in RUN_DIR/restarts.jsonl."""
    import json
    import sys

    job = run_job(tmp_path, "137 1 0", MAX_RESTARTS="3", RESTART_BACKOFF="0", PYTHON=sys.executable)
    assert job.rc == 0 and not job.requeued and _rank_steps(job) == 3, (job.calls, job.stderr)
    lines = [ln for ln in job.stderr.splitlines() if ": restart " in ln]
    assert [ln.split(": ")[1] for ln in lines] == ["restart 1 of 3", "restart 2 of 3"], job.stderr
    assert "killed by SIGKILL (exit 137)" in lines[0] and "exit 1;" in lines[1], lines
    assert "bert_ds: 3 attempt(s) in this allocation (MAX_RESTARTS=3): attempt 1: exit 137 after" in job.stderr
    records = [json.loads(ln) for ln in (tmp_path / "run" / "restarts.jsonl").read_text().splitlines()]
    assert [(r["restart"], r["attempt"]["code"]) for r in records] == [(1, 137), (2, 1)]


@pytest.mark.parametrize(("codes", "steps", "rc", "requeued"), [
    ("124", 3, 124, True),  # restarts used up on a stall: what is left is the requeue's, under MAX_REQUEUES
    ("137", 3, 137, False),  # a rank killed at every try: the last code, no requeue
    ("2 0", 1, 2, False), ("3 0", 1, 3, False), ("74 0", 1, 74, False),  # never restarted
    ("75 0", 1, 75, True),  # pre-empted: requeued, never restarted in place
])
def test_restarts_are_bounded_and_only_for_retryable_codes(tmp_path, codes, steps, rc, requeued):
    job = run_job(tmp_path, codes, MAX_RESTARTS="2", RESTART_BACKOFF="0")
    assert (job.rc, _rank_steps(job), job.requeued) == (rc, steps, requeued), (job.calls, job.stderr)
    if steps > 1:  # the ranks' Python is a fake here: the script's own line stands in for bert_ds's
        assert f"bert_ds: restart 2 of 2: the step exited {rc}; resuming from the newest checkpoint" in job.stderr
        assert f"bert_ds: 3 attempt(s) in this allocation (MAX_RESTARTS=2): attempt 1: exit {rc} after " in job.stderr


def test_max_restarts_refuses_a_non_number(tmp_path):
    bad = run_job(tmp_path, 1, MAX_RESTARTS="three")
    assert bad.rc == 2 and "MAX_RESTARTS=three" in bad.stderr and not bad.calls
