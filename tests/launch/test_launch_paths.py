"""Every launch path gives the same weights, bit for bit, as one ``deepspeed --num_gpus 2`` run of the same recipe:
two ``deepspeed --hostfile --no_ssh --node_rank`` launchers on this machine (two "nodes"), ``mpirun -np 2`` (DeepSpeed's
MPI discovery through mpi4py), and ``srun`` one task per rank (``sbatch slurm/pretrain_base.sh``). Under the one-node
Slurm CI starts (``.ci/start_slurm.sh``) also: a hostfile from the allocation, and ``slurm/create_shards.sh`` with 2
MPI ranks giving the same shards and index.json as 1 process.

Bit-identity holds on CPU because every path runs the same 2 ranks with the same data order and reductions; dropout
is on (its masks are keyed per micro batch, so they do not depend on the launcher)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bert_ds.lifecycle.hostfile import hosts_from_list, write_hostfile
from tests.helpers import HANG_GUARD_S, child_env, free_port
from tests.helpers.ranks import DEEPSPEED, PRETRAIN_SCRIPT, REPO
from tests.helpers.runs import SMALL_RECIPE, run_pretrain, weights, write_recipe

pytestmark = pytest.mark.e2e

FINAL_TAG = "phase2-step000002"  # SMALL_RECIPE: 4 steps of phase 1, 2 of phase 2






@dataclass(frozen=True)
class Case:
    """One small training job every path runs: its recipe and the ``bert_ds.runtime.pretrain`` arguments after
    ``--output``."""

    recipe: Path
    data: tuple[Path, Path]
    tokenizer: Path

    def args(self, run: Path) -> list[str]:
        return ["--recipe", str(self.recipe), "--data", *map(str, self.data), "--tokenizer", str(self.tokenizer),
                "--output", str(run)]


def _env(**extra: str) -> dict[str, str]:
    # One thread per rank on every path: the thread count changes the order of float sums inside matmuls. The torch
    # extensions directory is set explicitly, as a user would, so jobs under Slurm reuse this machine's build instead of
    # building DeepSpeed's CPU op again in their node-local default (bert_ds.runtime.caches.node_local_caches).
    from bert_ds.runtime.caches import extensions_root

    return child_env(TORCH_EXTENSIONS_DIR=str(extensions_root()), **extra)


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text() == FINAL_TAG
    assert json.loads((ckpt / FINAL_TAG / "run_state.json").read_text())["world_size"] == 2
    return weights(run, FINAL_TAG)


def _assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: parameter names differ"
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{what}: {len(differ)} of {len(want)} tensors differ from the deepspeed --num_gpus 2 run, " \
                       f"e.g. {differ[:3]}"


def _run_together(cmds: list[list[str]], env: dict[str, str], logs: list[Path]) -> None:
    """Start ``cmds`` at once (each in its own process group, output to ``logs``); when one fails, end the others'
    groups, which would otherwise wait for the failed peer at the rendezvous."""
    procs = []
    for cmd, log in zip(cmds, logs, strict=True):
        with log.open("w") as out:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0] * len(procs), f"exit codes {codes} (-9: ended here)\n" + "\n".join(
        f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)


def _sbatch(script: str, env: dict[str, str], log: Path, *script_args: str, tasks: int = 2) -> str:
    """``sbatch --wait`` a script of ``slurm/`` on one node with ``tasks`` tasks; returns the job's output."""
    cmd = ["sbatch", "--wait", "--nodes=1", f"--ntasks-per-node={tasks}", "--cpus-per-task=1", "--time=15",
           f"--output={log}", f"--chdir={REPO}", str(REPO / "slurm" / script), *script_args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    out = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, f"sbatch {script} exited {proc.returncode}\n{proc.stderr}\n--- job output\n" \
                                 f"{out[-6000:]}"
    return out


@pytest.fixture(scope="module")
def case(shards_128, shards_512, tokenizer_dir, tmp_path_factory) -> Case:
    recipe = {key: value for key, value in SMALL_RECIPE.items() if key != "model_overrides"}  # dropout 0.1 on
    path = write_recipe(tmp_path_factory.mktemp("launch") / "recipe.json", recipe)
    return Case(path, (shards_128, shards_512), tokenizer_dir)


@pytest.fixture(scope="module")
def baseline(case, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The reference: one ``deepspeed --num_gpus 2`` launcher, both phases."""
    run = tmp_path_factory.mktemp("baseline") / "run"
    run_pretrain(case.args(run), nprocs=2)
    return _final_weights(run)


def test_two_launchers_with_no_ssh_match_one_node(case, baseline, tmp_path):
    # With --no_ssh the hostfile only counts ranks (host names are labels, never resolved): node_rank picks the line.
    hostfile = write_hostfile(tmp_path / "hostfile", hosts_from_list("node0:1,node1:1"))
    port, run = free_port(), tmp_path / "run"
    cmds = [[str(DEEPSPEED), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
             "--master_addr", "127.0.0.1", "--master_port", str(port),
             str(PRETRAIN_SCRIPT), *case.args(run)] for node in (0, 1)]
    _run_together(cmds, _env(), [tmp_path / "node0.log", tmp_path / "node1.log"])
    assert "nnodes=2, num_local_procs=1, node_rank=1" in (tmp_path / "node1.log").read_text()
    _assert_bit_identical(_final_weights(run), baseline, "two deepspeed --no_ssh launchers")


@pytest.mark.mpi
def test_mpirun_matches_one_node(case, baseline, tmp_path):
    run, log = tmp_path / "run", tmp_path / "mpirun.log"
    # MASTER_PORT: DeepSpeed's MPI discovery would take 29500, which another job on this machine may hold.
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_PORT", "-x", "PYTHONPATH",
           "-x", "OMP_NUM_THREADS", sys.executable, "-m", "bert_ds.runtime.pretrain", *case.args(run)]
    _run_together([cmd], _env(MASTER_PORT=str(free_port())), [log])
    _assert_bit_identical(_final_weights(run), baseline, "mpirun -np 2")


@pytest.mark.slurm
def test_srun_one_task_per_rank_matches_one_node(case, baseline, tmp_path):
    run = tmp_path / "run"
    env = _env(RECIPE=str(case.recipe), DATA128=str(case.data[0]), DATA512=str(case.data[1]),
               TOKENIZER=str(case.tokenizer), RUN_DIR=str(run), PYTHON=sys.executable)
    out = _sbatch("pretrain_base.sh", env, tmp_path / "job.out")
    assert "1 node(s) x 2 task(s) = 2 rank(s), 0 GPU(s) per node" in out
    _assert_bit_identical(_final_weights(run), baseline, "srun (slurm/pretrain_base.sh)")


@pytest.mark.slurm
def test_deepspeed_launcher_from_a_slurm_hostfile_matches_one_node(case, baseline, tmp_path):
    """The deepspeed launcher under Slurm without ssh: a hostfile from the allocation, then srun one launcher per node,
    each told its line by SLURM_NODEID."""
    node = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True,
                          check=True).stdout.split()[0]
    hostfile, run = tmp_path / "hostfile", tmp_path / "run"
    deepspeed_flags = shlex.join([str(DEEPSPEED), "--hostfile", str(hostfile), "--no_ssh"])
    script_args = shlex.join(["--master_port", str(free_port()), str(PRETRAIN_SCRIPT),
                              *case.args(run)])
    (tmp_path / "node.sh").write_text(f'exec {deepspeed_flags} --node_rank "$SLURM_NODEID" --master_addr "$master" '
                                      f"{script_args}\n")
    job = tmp_path / "job.sh"
    job.write_text(f"""#!/usr/bin/env bash
set -euo pipefail
{shlex.quote(sys.executable)} tools/make_hostfile.py --slurm --output {shlex.quote(str(hostfile))}
master=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export master
srun --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 bash {shlex.quote(str(tmp_path / "node.sh"))}
""")
    log = tmp_path / "job.out"
    cmd = ["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=15", f"--output={log}",
           f"--chdir={REPO}", str(job)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)
    out = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, f"{proc.stderr}\n--- job output\n{out[-6000:]}"
    assert hostfile.read_text() == f"{node} slots=2\n", out
    _assert_bit_identical(_final_weights(run), baseline, "deepspeed --hostfile (from Slurm) --no_ssh under srun")


@pytest.mark.slurm
@pytest.mark.mpi
def test_create_shards_sh_with_two_mpi_ranks_matches_one_process(english_corpus, tokenizer_dir, tmp_path):
    args = ["--input", str(english_corpus), "--tokenizer", str(tokenizer_dir), "--seq-len", "128", "--seed", "1234",
            "--dupe-factor", "1", "--samples-per-shard", "500"]
    one, two = tmp_path / "one_process", tmp_path / "two_ranks"
    subprocess.run([sys.executable, "-m", "bert_ds.data.create", *args, "--out", str(one)], cwd=REPO, env=_env(),
                   check=True, capture_output=True, timeout=HANG_GUARD_S)
    # Open MPI refuses to run as root unless told; CI's Slurm runs jobs as root.
    env = _env(PYTHON=sys.executable, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    out = _sbatch("create_shards.sh", env, tmp_path / "job.out", *args, "--out", str(two))
    assert "shard creation on 2 MPI rank(s) across 1 node(s)" in out
    # Two ranks that did not find each other would each write the whole set and print this line twice.
    assert out.count("wrote ") == 1, out
    index = json.loads((one / "index.json").read_text())
    assert len(index["shards"]) >= 2, "one chunk only: rank 1 would have had nothing to do"
    assert (two / "index.json").read_bytes() == (one / "index.json").read_bytes()
    for shard in index["shards"]:
        assert (two / shard["name"]).read_bytes() == (one / shard["name"]).read_bytes(), shard["name"]
