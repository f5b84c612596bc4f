"""Stop/resume through real DeepSpeed ranks on CPU (fp32, gloo, dropout 0.1 as every shipped recipe): exact on the same
ranks, 1e-5 on other rank counts. One uninterrupted run is what every resumed run here is compared with."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.runs import assert_close_params, run_pretrain, weights, write_recipe

pytestmark = pytest.mark.e2e


def _state(run, tag):
    return json.loads((run / "checkpoints" / tag / "run_state.json").read_text())


def _with_dropout(path):
    """``SMALL_RECIPE`` with the dropout every shipped recipe has (0.1 hidden and attention)."""
    return write_recipe(path, model_overrides={"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1})


@pytest.fixture(scope="module")
def straight(synthetic_data, tmp_path_factory):
    """(recipe, run): one uninterrupted 2-rank run of ``SMALL_RECIPE`` with dropout 0.1, no loader workers: what
    every stopped-and-resumed run below must reproduce."""
    root = tmp_path_factory.mktemp("straight")
    recipe = _with_dropout(root / "recipe.json")
    run_pretrain(["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--num-workers", "0", "--output",
                  str(root / "run")], nprocs=2)
    return recipe, root / "run"


@pytest.fixture(scope="module")
def stopped_at_2(straight, synthetic_data, tmp_path_factory):
    """The same recipe and data on 2 ranks with one loader worker each, stopped by ``--max-steps 2`` (checkpoint
    ``phase1-step000002``): copied by each test below that resumes it."""
    recipe, _ = straight
    run = tmp_path_factory.mktemp("stopped") / "run"
    run_pretrain(["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--num-workers", "1", "--output",
                  str(run), "--max-steps", "2"], nprocs=2)
    assert (run / "checkpoints" / "latest").read_text() == "phase1-step000002"
    assert _state(run, "phase1-step000002")["world_size"] == 2
    return run


def test_resume_is_exact_with_dropout_on(straight, stopped_at_2, synthetic_data, tmp_path):
    """Stopped mid phase 1 (step 2, one loader worker per rank), resumed without workers and stopped again exactly at
    the phase boundary (step 4), finished with workers: the weights are bit-identical to the uninterrupted run (no
    workers), and so are the loader position and the samples consumed. Every random stream a step draws from
    (dropout: torch's generator) continues as if never interrupted, and the worker count changes nothing."""
    recipe, want_run = straight
    stopped = tmp_path / "stopped"
    shutil.copytree(stopped_at_2, stopped)
    common = ["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--output", str(stopped), "--resume",
              "auto"]
    run_pretrain([*common, "--num-workers", "0", "--max-steps", "4"], nprocs=2)
    assert (stopped / "checkpoints" / "latest").read_text() == "phase1-step000004"
    assert _state(stopped, "phase1-step000004")["phase_done"] is True
    run_pretrain([*common, "--num-workers", "1"], nprocs=2)
    for tag in ("phase1-step000004", "phase2-step000002"):
        got, want = weights(stopped, tag), weights(want_run, tag)
        assert got.keys() == want.keys()
        differ = [name for name in want if not torch.equal(got[name], want[name])]
        assert not differ, f"{tag}: {len(differ)} of {len(want)} tensors differ after stop/resume, e.g. {differ[:3]}"
        assert _state(stopped, tag)["loader"] == _state(want_run, tag)["loader"]
        assert _state(stopped, tag)["consumed_samples"] == _state(want_run, tag)["consumed_samples"]


def test_resume_on_other_rank_count_with_dropout_on(straight, stopped_at_2, synthetic_data, tmp_path):
    """A 2-rank ZeRO-2 checkpoint at step 2 resumed on 1 rank: the optimizer state is re-partitioned and the same
    samples are consumed; dropout masks are keyed by (seed, phase, step, micro batch in the global batch), not drawn
    from per-rank streams, so the masks are the same too: both phase ends within the data-parallel rounding floor
    (1e-5, ``param_diffs``) of the uninterrupted 2-rank run, dropout 0.1 on."""
    recipe, want_run = straight
    moved = tmp_path / "moved"
    shutil.copytree(stopped_at_2, moved)
    shutil.rmtree(moved / "tensorboard")
    run_pretrain(["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--output", str(moved), "--resume",
                  "auto"], nprocs=1)
    for tag in ("phase1-step000004", "phase2-step000002"):
        assert _state(moved, tag)["world_size"] == 1
        got_loader, want_loader = _state(moved, tag)["loader"], _state(want_run, tag)["loader"]
        for field in ("consumed_global_batches", "shard_set_sha256", "seed", "global_batch_size"):
            assert got_loader[field] == want_loader[field], field
        assert_close_params(weights(moved, tag), weights(want_run, tag), f"{tag} resumed 2 -> 1 ranks, dropout 0.1")


def test_phase_handoff_carries_moments_and_resets_step(reference_run):
    """Phase 2 starts with phase 1's LAMB moments and step count 0 (NVIDIA's hand-off): 2 steps into phase 2 the
    optimizer has counted 2 steps, not 4 + 2, and its second moments are those of a 6-step history."""
    ckpt = reference_run / "checkpoints"

    def optim_state(tag):
        files = sorted((ckpt / tag).glob("zero_pp_rank_*_optim_states.pt"))
        return [torch.load(f, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"] for f in files]

    end1, end2 = optim_state("phase1-step000004"), optim_state("phase2-step000002")
    assert all(int(group["step"]) == 4 for rank in end1 for group in rank)
    assert all(int(group["step"]) == 2 for rank in end2 for group in rank)
    # A fresh optimizer would give v = (1 - b2^2)-weighted squares of 2 gradients only; the carried v still holds
    # b2^2 times phase 1's v, so v_phase2 >= b2^2 * v_phase1 element-wise.
    for r1, r2 in zip(end1, end2, strict=True):
        for g1, g2 in zip(r1, r2, strict=True):
            assert torch.all(g2["exp_avg_sq"] >= 0.999**2 * g1["exp_avg_sq"] * (1 - 1e-6))


def test_zero0_one_rank_matches_zero2_two_ranks(reference_run, synthetic_data, tmp_path):
    """Sharded LAMB through the real engine: ZeRO-0 on 1 rank vs ZeRO-2 on 2 ranks after phase 1 (4 steps)."""
    recipe = write_recipe(tmp_path / "recipe.json", deepspeed={"zero_stage": 0})
    run = tmp_path / "run"
    run_pretrain(["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--output", str(run),
                  "--phase", "1"], nprocs=1)
    assert_close_params(weights(run, "phase1-step000004"), weights(reference_run, "phase1-step000004"),
                        "ZeRO-0 x1 vs ZeRO-2 x2 after 4 LAMB steps")
