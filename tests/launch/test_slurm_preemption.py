"""Pre-emption under a real (one-node) Slurm, end to end: signal -> checkpoint -> exit 75 -> restart -> exact resume.

Two ways a cluster ends a job early and two ways the job comes back, each ending in weights bit-identical to one
uninterrupted 2-rank run of the same recipe (dropout on, so the random streams must resume too):

- USR1 to the batch shell (``--signal=B:USR1@300``), and the job requeues itself with ``scontrol requeue``, keeping
  its node-local compiler caches until it ends for good; both runs log the save's duration;
- TERM alone to every process of the job (what Slurm sends at the time limit without ``--signal``, and all that some
  clusters send), inside a "container" without ``scontrol`` (pyxis#129): ``slurm/submit_chain.sh`` queued follow-up
  jobs (``--dependency=afternotok``), the first resumes, the one left is removed by Slurm.

And the requeue cap: a job pre-empted once more than ``MAX_REQUEUES`` allows ends with exit 75 and one line saying so.

CI starts the cluster with ``.ci/start_slurm.sh``; elsewhere these tests are skipped unless a Slurm controller answers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import HANG_GUARD_S, child_env
from tests.helpers.runs import REPO, SMALL_RECIPE, run_pretrain, weights, write_recipe

# waits: each requeue waits for the job credential to expire (.ci/start_slurm.sh, cred_expire) on no core
pytestmark = [pytest.mark.e2e, pytest.mark.waits]

PHASE1_STEPS = 40
FINAL_TAG = "phase2-step000002"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}





@pytest.fixture(scope="module")
def job_inputs(shards_128, shards_512, tokenizer_dir, tmp_path_factory):
    """A recipe long enough in phase 1 for a signal to land mid-phase (dropout on), and its uninterrupted weights."""
    recipe = {key: value for key, value in SMALL_RECIPE.items() if key != "model_overrides"}  # dropout 0.1
    recipe["phases"] = [{**recipe["phases"][0], "steps": PHASE1_STEPS}, recipe["phases"][1]]
    root = tmp_path_factory.mktemp("slurm_preemption")
    path = write_recipe(root / "recipe.json", recipe)
    run = root / "baseline"
    run_pretrain(["--recipe", str(path), "--data", str(shards_128), str(shards_512), "--tokenizer", str(tokenizer_dir),
                  "--output", str(run)], nprocs=2)
    assert (run / "checkpoints" / "latest").read_text() == FINAL_TAG
    return path, (shards_128, shards_512), tokenizer_dir, weights(run, FINAL_TAG)


def _job_env(job_inputs, run: Path, recipe: Path | None = None, **extra: str) -> dict[str, str]:
    fixture_recipe, (data128, data512), tokenizer, _ = job_inputs
    from bert_ds.runtime.caches import extensions_root

    # TORCH_EXTENSIONS_DIR chosen by the "user" (the machine's build, made once); the Triton cache takes the scripts'
    # node-local default (under $TMPDIR when a test sets it).
    return child_env(RECIPE=str(recipe or fixture_recipe), DATA128=str(data128), DATA512=str(data512),
                     TOKENIZER=str(tokenizer), RUN_DIR=str(run), PYTHON=sys.executable,
                     TORCH_EXTENSIONS_DIR=str(extensions_root()), **extra)


def _sbatch_args(log_pattern: Path) -> list[str]:
    return ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=20", f"--output={log_pattern}",
            f"--chdir={REPO}", str(REPO / "slurm" / "pretrain_base.sh")]


def _job_info(job: str) -> dict[str, str]:
    proc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}


def _wait_for(predicate, what: str, timeout: float = HANG_GUARD_S, poll: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def _wait_for_step(log: Path, job: str, restart: int = 0) -> None:
    """Until the job's run number ``restart`` has logged a training step (so its ranks run and have installed their
    signal handlers)."""
    def stepped():
        if _job_info(job).get("JobState") in TERMINAL:
            raise AssertionError(f"job {job} ended before a step of restart {restart}:\n{_read(log)[-4000:]}")
        _, started, text = _read(log).rpartition(f"(job {job}, restart {restart})")
        return started and re.search(r"^step \d+ \|", text, re.M)
    _wait_for(stepped, f"job {job} to log a step in restart {restart}")


def _wait_for_restart(log: Path, job: str, restart: int) -> None:
    """Until the requeued job's batch script has started again (so the one before it has ended)."""
    _wait_for(lambda: f"(job {job}, restart {restart})" in _read(log), f"job {job} to start restart {restart}",
              poll=0.5)


def _plant_cache(node_tmp: Path, job: str) -> Path:
    """A file in the job's node-local Triton cache, as a kernel compile would leave (CPU ranks compile nothing)."""
    entry = node_tmp / f"bert_ds-{job}" / "triton" / "kernel.json"
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_text("{}")
    return entry


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_until_ended(job: str) -> dict[str, str]:
    """Until Slurm reports the job in a terminal state (a requeued job passes through PENDING and RUNNING again)."""
    return _wait_for(lambda: (info := _job_info(job)) and info.get("JobState") in TERMINAL and info,
                     f"job {job} to end")


def _assert_bit_identical(run: Path, want: dict[str, torch.Tensor], what: str) -> None:
    assert (run / "checkpoints" / "latest").read_text() == FINAL_TAG
    got = weights(run, FINAL_TAG)
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert got.keys() == want.keys() and not differ, f"{what}: {len(differ)} tensors differ, e.g. {differ[:3]}"


def _preempted_at(out: str, phase1_steps: int = PHASE1_STEPS) -> int:
    match = re.search(r"pre-empted: checkpointed at phase 1 step (\d+); exit 75", out)
    assert match, out[-6000:]
    step = int(match.group(1))
    assert 1 <= step < phase1_steps, f"the signal should land inside phase 1, landed at step {step}"
    return step


def _save_seconds(out: str, step: int) -> str:
    """The duration the pre-emption save of ``step`` logged (as printed)."""
    match = re.search(rf"checkpoint save took (\d+\.\d\d) s \(phase1-step{step:06d}, 2 rank\(s\), [\d.,]+ MiB\); "
                      rf"pre-emption grace \(Slurm KillWait / --signal lead time\) must exceed it", out)
    assert match, out[-6000:]
    return match.group(1)


@pytest.mark.slurm
def test_usr1_checkpoints_exits_75_requeues_and_resumes_exactly(job_inputs, tmp_path):
    run, log, node_tmp = tmp_path / "run", tmp_path / "job.out", tmp_path / "node-tmp"
    node_tmp.mkdir()
    proc = subprocess.run(["sbatch", "--parsable", *_sbatch_args(log)], env=_job_env(job_inputs, run,
                          TMPDIR=str(node_tmp)), capture_output=True, text=True, timeout=120, check=True)
    job = proc.stdout.strip().split(";")[0]
    try:
        _wait_for_step(log, job)
        cache_entry = _plant_cache(node_tmp, job)
        # What `--signal=B:USR1@300` does 5 minutes before the time limit: USR1 to the batch shell only.
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=60)
        _wait_for_restart(log, job, 1)
        kept_across_requeue = cache_entry.is_file()
        info = _wait_until_ended(job)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=60)
    out = _read(log)
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", (info, out[-6000:])
    assert "bert_ds: USR1 received: asking the ranks to checkpoint" in out
    step = _preempted_at(out)
    assert f"pre-empted: checkpoint written; job {job} requeued (requeue 1 of at most MAX_REQUEUES=10)" in out
    assert f"(job {job}, restart 1)" in out
    assert f"resumed phase1-step{step:06d}: phase 1 step {step}" in out
    # The pre-emption save logged its duration; the requeued run states it at start-up, before training on.
    seconds = _save_seconds(out, step)
    restarted = out.partition(f"(job {job}, restart 1)")[2]
    assert re.search(rf"the previous run's last checkpoint save took {seconds} s \(phase1-step{step:06d}, 2 rank\(s\)",
                     restarted), restarted[:6000]
    # Node-local caches: kept across the job's own requeue (same job id), removed when it ended for good.
    assert f"TRITON_CACHE_DIR={node_tmp}/bert_ds-{job}/triton" in out
    assert kept_across_requeue, "the requeue removed the job's node-local caches"
    assert not (node_tmp / f"bert_ds-{job}").exists()
    assert f"job {job} ends for good: removed its node-local caches" in out
    assert (run / "slurm" / f"exit-{job}").read_text().strip() == "0"
    _assert_bit_identical(run, job_inputs[3], "USR1 -> exit 75 -> scontrol requeue -> resume")


@pytest.mark.slurm
def test_a_job_preempted_past_max_requeues_stops_with_exit_75(job_inputs, tmp_path):
    """MAX_REQUEUES=1: the first pre-emption requeues the job, the second ends it (exit 75, one line naming the cap, no
    requeue) with its checkpoint written and its node-local caches removed. A phase 1 far longer than the test keeps
    both signals inside it."""
    recipe = {key: value for key, value in SMALL_RECIPE.items() if key != "model_overrides"}
    recipe["phases"] = [{**recipe["phases"][0], "steps": 5000}, recipe["phases"][1]]
    run, log, node_tmp = tmp_path / "run", tmp_path / "job.out", tmp_path / "node-tmp"
    node_tmp.mkdir()
    env = _job_env(job_inputs, run, recipe=write_recipe(tmp_path / "recipe.json", recipe), MAX_REQUEUES="1",
                   TMPDIR=str(node_tmp))
    proc = subprocess.run(["sbatch", "--parsable", *_sbatch_args(log)], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    job = proc.stdout.strip().split(";")[0]
    try:
        _wait_for_step(log, job)
        cache_entry = _plant_cache(node_tmp, job)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=60)
        _wait_for_restart(log, job, 1)
        kept_across_requeue = cache_entry.is_file()
        _wait_for_step(log, job, restart=1)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True, timeout=60)
        # Ended, or requeued a second time (the cap did not hold: fail now rather than train 5000 steps).
        _wait_for(lambda: _job_info(job).get("JobState") in TERMINAL or _read(log).count(f"job {job} requeued") > 1,
                  f"job {job} to end or requeue again")
        info = _job_info(job)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=60)
    out = _read(log)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "75:0" and info.get("Restarts") == "1", \
        (info, out[-6000:])
    first, second = (int(n) for n in re.findall(r"pre-empted: checkpointed at phase 1 step (\d+); exit 75", out))
    assert 1 <= first < second < 5000, (first, second)
    assert out.count(f"job {job} requeued") == 1, out[-6000:]
    assert [line for line in out.splitlines() if "requeue cap" in line] == [
        f"bert_ds: requeue cap reached: job {job} was requeued 1 time(s), MAX_REQUEUES=1; not requeued again, exit 75. "
        f"Resubmit it (--resume auto continues) or raise MAX_REQUEUES"]
    assert (run / "checkpoints" / "latest").read_text() == f"phase1-step{second:06d}"
    assert (run / "slurm" / f"exit-{job}").read_text().strip() == "75"
    assert kept_across_requeue and not (node_tmp / f"bert_ds-{job}").exists()


@pytest.mark.slurm
# workers=1: the loader workers ignore the TERM Slurm sends every process of the step (worker init), so the rank
# checkpoints instead of failing with "a DataLoader worker died".
@pytest.mark.parametrize("workers", [0, 1])
def test_term_only_without_scontrol_follow_up_job_resumes_exactly(job_inputs, tmp_path, workers):
    run = tmp_path / "run"
    # A "container" without scontrol: the script neither requeues nor expands the node list with it.
    env = _job_env(job_inputs, run, SCONTROL=str(tmp_path / "no-scontrol-here"), FOLLOWUPS="2",
                   EXTRA_ARGS=f"--num-workers {workers}")
    proc = subprocess.run([str(REPO / "slurm" / "submit_chain.sh"), *_sbatch_args(tmp_path / "job-%j.out")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, follow_up, spare = proc.stdout.split()
    logs = {job: tmp_path / f"job-{job}.out" for job in (first, follow_up, spare)}
    try:
        _wait_for_step(logs[first], first)
        # What Slurm's time limit does without --signal (and all some clusters send): TERM to the ranks of every step
        # and to the batch shell. (Not `scancel --full`, which also signals srun: srun answers TERM by killing its
        # tasks at once, which the time limit, seen on this cluster, does not do: the ranks had time to exit 75.)
        subprocess.run(["scancel", "--signal=TERM", first], check=True, timeout=60)
        subprocess.run(["scancel", "--signal=TERM", "--batch", first], check=True, timeout=60)
        infos = {job: _wait_until_ended(job) for job in (first, follow_up, spare)}
    finally:
        subprocess.run(["scancel", first, follow_up, spare], capture_output=True, timeout=60)
    out_first, out_follow = _read(logs[first]), _read(logs[follow_up])
    assert infos[first]["JobState"] == "FAILED" and infos[first]["ExitCode"] == "75:0", (infos, out_first[-6000:])
    assert "bert_ds: TERM received: asking the ranks to checkpoint" in out_first
    step = _preempted_at(out_first)
    assert "pre-empted: checkpoint written; exit 75 for a follow-up job (REQUEUE=none)" in out_first
    assert infos[follow_up]["JobState"] == "COMPLETED", (infos, out_follow[-6000:])
    assert f"follow-up of job {first} (exit 75): resuming from the newest checkpoint" in out_follow
    assert f"resumed phase1-step{step:06d}: phase 1 step {step}" in out_follow
    # The spare follow-up can never start once the run succeeded; Slurm removes it (--kill-on-invalid-dep=yes).
    assert infos[spare]["JobState"] == "CANCELLED" and not logs[spare].exists(), infos[spare]
    assert [(run / "slurm" / f"exit-{j}").read_text().strip() for j in (first, follow_up)] == ["75", "0"]
    _assert_bit_identical(run, job_inputs[3], "TERM -> exit 75 -> follow-up job -> resume")


@pytest.mark.parametrize("code", ["2", "3"])
def test_follow_up_job_does_not_resume_after_a_failure_that_would_repeat(tmp_path, code):
    """A follow-up whose predecessor failed on bad input (exit 2) or a non-finite loss (3) stops at once with the same
    code, before srun, so a chain of follow-ups does not repeat the failure."""
    run = tmp_path / "run"
    (run / "slurm").mkdir(parents=True)
    (run / "slurm" / "exit-41").write_text(f"{code}\n")
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2",
           "SLURM_TASKS_PER_NODE": "2", "RUN_DIR": str(run), "BERT_DS_AFTER_JOB": "41",
           "SCONTROL": str(tmp_path / "absent")}
    proc = subprocess.run(["bash", str(REPO / "slurm" / "pretrain_base.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == int(code), proc.stderr
    expected = f"job 41 ended with exit {code}, which a restart would repeat; follow-up job 42 does not resume"
    assert expected in proc.stderr
    assert (run / "slurm" / "exit-42").read_text().strip() == code
