"""The default tier cannot start ranks (``tests/helpers/tiers.py``, enforced by ``tests/conftest.py``), and markers are
strict: these tests are themselves in the default tier."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers.ranks import REPO
from tests.helpers.tiers import rank_launch


@pytest.mark.parametrize("args, env, why", [
    (["deepspeed", "--num_gpus", "2", "bert_ds/runtime/pretrain.py"], None, "the deepspeed launcher"),
    (["/usr/bin/mpirun", "-np", "2", "python", "x.py"], None, "the mpirun launcher"),
    ("sbatch --wait slurm/pretrain_large.sh", None, "the sbatch launcher"),
    ([sys.executable, "-m", "bert_ds.runtime.pretrain", "--recipe", "r.json"], None, "a rank entry point"),
    ([sys.executable, "-u", "-m", "deepspeed.launcher.launch"], None, "a rank entry point"),
    ([sys.executable, "worker.py"], {"RANK": "1", "WORLD_SIZE": "2"}, "a process given ['RANK', 'WORLD_SIZE']"),
])
def test_rank_launches_are_recognised(args, env, why):
    assert (rank_launch(args, env) or "").startswith(why)


@pytest.mark.parametrize("args", [[sys.executable, "-c", "print(1)"], ["bert-ds-finetune", "--help"],
                                  "git status", [sys.executable, "tools/convert_checkpoint.py", "--help"],
                                  ["deepspeed", "--help"], [sys.executable, "-m", "bert_ds.runtime.pretrain", "-h"]])
def test_plain_subprocesses_are_not_rank_launches(args):
    assert rank_launch(args, {"PATH": "/usr/bin"}) is None


def test_this_default_tier_test_cannot_start_ranks():
    with pytest.raises(RuntimeError, match=r"is not marked e2e but starts the deepspeed launcher"):
        subprocess.run(["deepspeed", "--num_gpus", "2", "nothing.py"], capture_output=True, check=False)
    assert subprocess.run([sys.executable, "-c", "pass"], check=False).returncode == 0  # a plain one still runs


def test_markers_are_registered_and_strict():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^addopts = ".*--strict-markers.*"$', pyproject, re.M)
    markers = pyproject[pyproject.index("markers = ["):]
    registered = set(re.findall(r'^    "(\w+):', markers[:markers.index("]")], re.M))
    assert registered == {"e2e", "slow", "mpi", "slurm", "gpu", "waits"}  # waits: the order, not the tier
    makefile = (REPO / "Makefile").read_text()
    assert '-m "not e2e and not slow and not slurm and not gpu"' in makefile



@pytest.mark.parametrize("states, up", [(["idle"], True), (["mixed"], True), (["allocated"], True),
                                        (["allocated*"], True), (["down*", "drained"], False), ([], False)])
def test_a_busy_slurm_node_counts_as_up(tmp_path, monkeypatch, states, up):
    # Another test worker's job may hold the one node when this worker probes: the tests then queue, not skip.
    from tests.helpers import tiers

    lines = "".join(f"echo '{state}'\n" for state in states)
    for name, body in (("sbatch", "exit 0\n"), ("sinfo", lines)):
        tool = tmp_path / name
        tool.write_text(f"#!/bin/sh\n{body}")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert tiers.slurm_up() is up
