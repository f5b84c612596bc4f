"""How ``bert_ds.runtime.distributed`` tells the launch paths apart and maps Slurm's variables, and the checks the
``slurm/`` scripts make before starting anything. No ranks start here (the launches run in test_launch_paths.py;
the hostfile writer's own tests are tests/lifecycle/test_hostfile.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.errors import BadInput
from bert_ds.lifecycle.hostfile import slurm_master_port
from bert_ds.runtime import distributed
from tests.helpers import HANG_GUARD_S, LAUNCHER_VARS, child_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("env", "path"), [
    ({"RANK": "1", "SLURM_STEP_NUM_TASKS": "2", "OMPI_COMM_WORLD_RANK": "0"}, "launcher"),
    # mpirun inside a Slurm job: the ranks inherit the job's SLURM_* variables, which are not theirs.
    ({"OMPI_COMM_WORLD_RANK": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}, "mpirun"),
    ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "srun"),
    # python straight from an sbatch script of 2 tasks: the batch shell is no job step.
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, "single"),
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, "single"),
    ({}, "single"),
])
def test_launch_path(env, path):
    assert distributed.launch_path(env) == path


def test_srun_environment_maps_to_torch_variables(monkeypatch):
    # _env_from_slurm writes os.environ: give it a copy (monkeypatch.delenv of an unset variable restores nothing, and
    # a leaked MASTER_ADDR=gpu01 made later launch tests wait for an unresolvable host).
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS})
    seen = []
    monkeypatch.setattr("bert_ds.lifecycle.hostfile.slurm_hostnames",
                        lambda nodelist: seen.append(nodelist) or ["gpu01", "gpu02"])
    for var, value in {"SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
                       "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_STEP_NODELIST": "gpu[01-02]"}.items():
        monkeypatch.setenv(var, value)
    distributed._env_from_slurm()
    got = {var: os.environ[var] for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                            "LOCAL_WORLD_SIZE")}
    assert seen == ["gpu[01-02]"]
    assert got == {"MASTER_ADDR": "gpu01", "MASTER_PORT": str(slurm_master_port({"SLURM_JOB_ID": "4242"})),
                   "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}


def _run_script(script: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """A ``slurm/`` script run by bash outside Slurm with only ``env`` (and PATH): its checks fail before any srun."""
    return subprocess.run(["bash", str(REPO / "slurm" / script)], cwd=cwd, env={"PATH": os.environ["PATH"], **env},
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", ["pretrain_base.sh", "pretrain_large.sh"])
def test_pretrain_scripts_take_sizes_from_the_allocation(script, tmp_path):
    proc = _run_script(script, REPO)
    assert proc.returncode == 2 and "submit this with sbatch" in proc.stderr
    # 8 GPUs per node but one task per node: srun would start 1 rank per node and leave 7 GPUs idle.
    proc = _run_script(script, REPO, SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="8", SLURM_NTASKS="8",
                       SLURM_TASKS_PER_NODE="1(x8)", SLURM_GPUS_ON_NODE="8")
    assert proc.returncode == 2 and "sbatch --ntasks-per-node=8" in proc.stderr, proc.stderr
    proc = _run_script(script, tmp_path, SLURM_JOB_ID="7")
    assert proc.returncode == 2 and "submit from the bert_ds checkout" in proc.stderr, proc.stderr


def test_create_shards_script_needs_a_slurm_job():
    proc = _run_script("create_shards.sh", REPO)
    assert proc.returncode == 2 and "submit this with sbatch" in proc.stderr


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"RANK": "1 ", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside 0..1 (WORLD_SIZE=2)"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1"),
    ({"LOCAL_RANK": "-1", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_RANK=-1 is outside 0..7 (LOCAL_WORLD_SIZE=8)"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
])
def test_launcher_variables_that_are_not_a_launchers_are_refused_by_name(env, message):
    with pytest.raises(BadInput, match=re.escape(message)):
        distributed.check_launcher_env(env)


def test_launcher_variables_as_launchers_set_them_pass():
    distributed.check_launcher_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                    "MASTER_PORT": "29500"})
    distributed.check_launcher_env({})  # one process: pretrain sets them itself


@pytest.mark.e2e
def test_unresolvable_master_addr_is_refused_at_once(tmp_path):
    """A rank told MASTER_ADDR=a host that does not resolve exits 2 naming it, instead of retrying the rendezvous for
    30 minutes (what a stale export or a leaked test variable did)."""
    with pytest.raises(ValueError, match=r"MASTER_ADDR='gpu01\.invalid' does not resolve"):
        distributed.check_master_addr({"MASTER_ADDR": "gpu01.invalid"})
    distributed.check_master_addr({"MASTER_ADDR": "127.0.0.1"})
    distributed.check_master_addr({})
    env = child_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="gpu01.invalid", MASTER_PORT="29511")
    proc = subprocess.run([sys.executable, "-m", "bert_ds.runtime.pretrain", "--recipe", str(REPO / "ds_configs" /
                           "tiny_cpu.json"), "--data", str(tmp_path), str(tmp_path), "--tokenizer", str(tmp_path),
                           "--output", str(tmp_path / "run")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "bert_ds.runtime.pretrain: error: MASTER_ADDR='gpu01.invalid' does not resolve" in proc.stderr
    assert not (tmp_path / "run").exists()
    env.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE="2x")  # the same start, one launcher variable garbled
    proc = subprocess.run(proc.args, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "bert_ds.runtime.pretrain: error: WORLD_SIZE='2x' is not an integer" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
