"""``compile: true`` end to end: the shipped ``tiny_cpu`` recipe (dropout 0.1, ZeRO-2, LAMB, two phases) with each
encoder layer compiled by inductor (C++ on the CPU) trains on 2 real DeepSpeed ranks, and a run killed with SIGKILL
after a checkpoint resumes to weights bit-identical to an uninterrupted compiled run. The trainer re-seeds torch's
generator before each micro batch and inductor seeds its dropout from it, so the masks after a resume are the ones
the uninterrupted run drew."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.helpers import HANG_GUARD_S
from tests.helpers.faults import Launch, Trigger, execute, fault_recipe, kill_rank
from tests.helpers.ranks import rank_command, spawn_ranks
from tests.helpers.runs import weights

# Three launches that each compile (the first cold unless an earlier test compiled the same graphs, the others from the
# session's inductor cache) on 2 busy cores.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3 * HANG_GUARD_S)]

PHASE1_STEPS = 4
TAGS = (f"phase1-step{PHASE1_STEPS:06d}", "phase2-step000001")


def _args(recipe, run, shards_128, shards_512, tokenizer_dir, *extra):
    return ["--recipe", str(recipe), "--data", str(shards_128), str(shards_512), "--tokenizer", str(tokenizer_dir),
            "--output", str(run), *extra]


def test_compiled_tiny_cpu_resumes_bit_exact_after_kill_9(shards_128, shards_512, tokenizer_dir, compile_cache_env,
                                                           tmp_path):
    recipe = fault_recipe(tmp_path / "recipe.json", compile=True, **{
        "phases.0.steps": PHASE1_STEPS, "phases.1.steps": 1})
    assert json.loads(recipe.read_text())["model"] == "tiny"
    env = compile_cache_env
    common = (shards_128, shards_512, tokenizer_dir)

    # The uninterrupted run and the resume are spawned directly (tests.helpers.ranks.spawn_ranks); the kill needs the
    # launcher's process tree.
    straight = spawn_ranks(2, _args(recipe, tmp_path / "straight", *common), check=True, **env)
    compiles = [int(n) for n in re.findall(r"torch\.compile built (\d+) graph", straight.stdout + straight.stderr)]
    assert len(compiles) == 2 and all(n <= 6 for n in compiles), compiles  # logged once per phase, within the bound

    killed = tmp_path / "killed"
    # "step 3 |" is printed after step 3's compute; the checkpoint of step 2 is complete by then.
    out = execute(Launch(rank_command(2, _args(recipe, killed, *common)), Trigger(r"^step 3 \|", kill_rank(1)),
                         env=env))
    assert out.fault is not None and out.returncode != 0, out.text()[-4000:]
    assert (killed / "checkpoints" / "latest").read_text() == "phase1-step000002"
    spawn_ranks(2, _args(recipe, killed, *common, "--resume", "auto"), check=True, **env)

    for tag in TAGS:
        got, want = weights(killed, tag), weights(tmp_path / "straight", tag)
        assert got.keys() == want.keys() and not any(k.startswith("_orig_mod") or "._orig_mod" in k for k in got)
        differ = [name for name in want if not torch.equal(got[name], want[name])]
        assert not differ, f"{tag}: {len(differ)} of {len(want)} tensors differ after kill -9 and resume"
