"""Hostfiles from a host list or a Slurm allocation (``bert_ds.lifecycle.hostfile``, ``bert-ds make-hostfile``) and
the Slurm facts every launch path shares: the allocation's hosts and slots, the job's rendezvous port. No ranks start
here (how the launch paths use them: tests/launch/test_launch.py and test_launch_paths.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bert_ds.lifecycle.hostfile import (
    format_hostfile,
    hosts_from_list,
    hosts_from_slurm,
    main,
    parse_tasks_per_node,
    slurm_master_port,
    write_hostfile,
)

REPO = Path(__file__).resolve().parents[2]


def _expand(nodelist: str) -> list[str]:
    """A stand-in for ``scontrol show hostnames`` on the two node lists these tests use."""
    return {"gpu[01-02]": ["gpu01", "gpu02"], "cpu[1-3]": ["cpu1", "cpu2", "cpu3"]}[nodelist]


def test_host_list_with_and_without_slots():
    assert hosts_from_list("a:8,b:4") == [("a", 8), ("b", 4)]
    assert hosts_from_list("node0 node1", slots=2) == [("node0", 2), ("node1", 2)]
    assert hosts_from_list("a:1, b", slots=3) == [("a", 1), ("b", 3)]


@pytest.mark.parametrize(("spec", "slots", "message"), [
    ("a,b", None, "no :SLOTS"), ("a:x", None, "not HOST or HOST:SLOTS"), ("a:2,a:2", None, "appears twice"),
    ("a:0", None, "at least 1"), ("", 2, "no hosts"), ("a/b:1", None, "not a host name"),
])
def test_host_list_refuses_bad_input(spec, slots, message):
    with pytest.raises(ValueError, match=message):
        hosts_from_list(spec, slots)


def test_slurm_compressed_task_counts():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="not N or N"):
        parse_tasks_per_node("2(3)")


def test_slurm_slots_prefer_gpus_then_tasks_per_node():
    # The deepspeed launcher starts one rank per GPU however many Slurm tasks run it: GPUs win.
    gpu_job = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1"}
    assert hosts_from_slurm(gpu_job, expand=_expand) == [("gpu01", 8), ("gpu02", 8)]
    cpu_job = {"SLURM_JOB_NODELIST": "cpu[1-3]", "SLURM_NTASKS_PER_NODE": "4", "SLURM_GPUS_ON_NODE": "0"}
    assert hosts_from_slurm(cpu_job, expand=_expand) == [("cpu1", 4), ("cpu2", 4), ("cpu3", 4)]
    uneven = {"SLURM_JOB_NODELIST": "cpu[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert hosts_from_slurm(uneven, expand=_expand) == [("cpu1", 2), ("cpu2", 2), ("cpu3", 1)]
    assert hosts_from_slurm(gpu_job, slots=2, expand=_expand) == [("gpu01", 2), ("gpu02", 2)]


@pytest.mark.parametrize(("env", "message"), [
    ({}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_JOB_NODELIST": "cpu[1-3]"}, "pass --slots"),
    ({"SLURM_JOB_NODELIST": "cpu[1-3]", "SLURM_TASKS_PER_NODE": "2(x2)"}, "gives 2 node"),
])
def test_slurm_hosts_refuse_an_incomplete_environment(env, message):
    with pytest.raises(ValueError, match=message):
        hosts_from_slurm(env, expand=_expand)


def test_hostfile_is_what_deepspeed_reads(tmp_path):
    from deepspeed.launcher.runner import fetch_hostfile

    hosts = [("node0", 8), ("node1", 4)]
    path = write_hostfile(tmp_path / "hostfile", hosts)
    assert path.read_text() == format_hostfile(hosts) == "node0 slots=8\nnode1 slots=4\n"
    assert list(fetch_hostfile(str(path)).items()) == hosts


def test_cli_writes_a_hostfile_and_fails_in_one_line(tmp_path, capsys):
    out = tmp_path / "hosts"
    assert main(["--hosts", "n0,n1", "--slots", "2", "--output", str(out)]) == 0
    assert out.read_text() == "n0 slots=2\nn1 slots=2\n"
    assert "2 node(s), 4 rank(s); node 0 (--master_addr): n0" in capsys.readouterr().err
    assert main(["--hosts", "n0:2,n0:2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "appears twice" in err


def test_slurm_master_port_is_shared_by_a_job_and_differs_between_jobs():
    ports = {slurm_master_port({"SLURM_JOB_ID": str(job)}) for job in range(1000, 1100)}
    assert len(ports) == 100
    # Every task of a job computes the port from its own environment, whose task-local variables differ: the port
    # must not depend on them.
    job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]"}
    tasks = [{**job, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 8), "SLURM_NODEID": str(r // 8),
              "SLURMD_NODENAME": f"gpu{r // 8 + 1:02d}"} for r in range(16)]
    assert {slurm_master_port(task) for task in tasks} == {slurm_master_port(job)}
    # ... and slurm/pretrain_common.sh computes the same port in bash for the ranks it starts.
    rule = next(ln for ln in (REPO / "slurm" / "pretrain_common.sh").read_text().splitlines()
                if ln.startswith("export MASTER_PORT="))
    for job_id in (123, 19_999, 20_000, 987_654):
        proc = subprocess.run(["bash", "-c", f'SLURM_JOB_ID={job_id}; {rule}; echo "$MASTER_PORT"'],
                              env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=60, check=True)
        assert int(proc.stdout) == slurm_master_port({"SLURM_JOB_ID": str(job_id)}), (job_id, proc.stdout)


EPHEMERAL = range(32768, 61000)
"""Linux's default ``net.ipv4.ip_local_port_range`` (32768 60999): the kernel gives outgoing connections (NCCL's and
gloo's among them) ports from it, so a rendezvous port there can be taken by chance."""
RENDEZVOUS_DEFAULTS = range(29000, 30000)
"""Around torchrun's (29400) and DeepSpeed's / torch's (29500) default rendezvous ports, held by other launches."""


def test_slurm_master_port_stays_out_of_the_ephemeral_range_for_every_job_id():
    """Over a million consecutive job ids and a sample of large ones: every port is unprivileged, below the ephemeral
    range and clear of the launchers' defaults, and ``slurm/pretrain_common.sh`` computes the same one in bash."""
    ids = [*range(1_000_000), *range(2**31 - 10_000, 2**31), *(k * 1_000_003 for k in range(1, 2000))]
    ports = [slurm_master_port({"SLURM_JOB_ID": str(job)}) for job in ids]
    assert not [(j, p) for j, p in zip(ids, ports, strict=True)
                if not 1024 < p < EPHEMERAL.start or p in RENDEZVOUS_DEFAULTS]
    assert len(set(ports)) >= 9000  # spread: consecutive jobs on one node get different ports
    rule = next(ln for ln in (REPO / "slurm" / "pretrain_common.sh").read_text().splitlines()
                if ln.startswith("export MASTER_PORT="))
    sample = ids[::997]
    loop = f'for SLURM_JOB_ID in {" ".join(map(str, sample))}; do unset MASTER_PORT; {rule}; echo "$MASTER_PORT"; done'
    proc = subprocess.run(["bash", "-c", loop], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True,
                          timeout=120, check=True)
    assert [int(p) for p in proc.stdout.split()] == [slurm_master_port({"SLURM_JOB_ID": str(j)}) for j in sample]
