"""`sbatch slurm/pretrain_large.sh` on a real (one-node) Slurm: srun starts one task per rank, both phases run.

CI starts the cluster with `.ci/start_slurm.sh`; elsewhere the test is skipped unless a Slurm controller answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.runtime.caches import extensions_root
from tests.helpers import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e



@pytest.mark.slurm
def test_sbatch_runs_both_phases_with_one_srun_task_per_rank(shards_128, shards_512, tokenizer_dir, tmp_path):
    recipe = json.loads((REPO / "ds_configs" / "tiny_cpu.json").read_text())
    recipe["phases"][0].update(steps=4, global_batch_size=8, micro_batch_size=2, checkpoint_interval=2)
    recipe["phases"][1].update(steps=2, global_batch_size=4, micro_batch_size=1, checkpoint_interval=2)
    recipe_path = tmp_path / "recipe.json"
    recipe_path.write_text(json.dumps(recipe))
    run, log = tmp_path / "run", tmp_path / "job.out"
    env = {**os.environ, "RECIPE": str(recipe_path), "DATA128": str(shards_128), "DATA512": str(shards_512),
           "TOKENIZER": str(tokenizer_dir), "RUN_DIR": str(run), "PYTHON": sys.executable,
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TORCH_EXTENSIONS_DIR": str(extensions_root())}  # reuse this machine's build (not the job's node-local one)
    # The script takes its sizes from the allocation: one node, one task per rank.
    cmd = ["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1",
           "--time=15", f"--output={log}", f"--chdir={REPO}", str(REPO / "slurm" / "pretrain_large.sh")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    out = log.read_text() if log.exists() else ""
    assert proc.returncode == 0, f"sbatch exited {proc.returncode}\n{proc.stderr}\n--- job output\n{out[-6000:]}"
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text() == "phase2-step000002"
    state = json.loads((ckpt / "phase2-step000002" / "run_state.json").read_text())
    assert state["world_size"] == 2 and state["phase_done"]
    assert "| phase 1 |" in out and "| phase 2 |" in out
    assert "bert_ds: 1 node(s) x 2 task(s) = 2 rank(s), 0 GPU(s) per node" in out
