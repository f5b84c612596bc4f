"""ZeroAwareLamb on real DeepSpeed CPU ranks (gloo): sharded equals unsharded equals float64, the naive flat-slice
LAMB does not, ZeRO-3 is refused, an unbound ZeRO step is refused, and a ZeRO-2 checkpoint resumes identically."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.lamb_harness import launch, max_rel_diff, reference_lamb

pytestmark = pytest.mark.e2e

STEPS = 20
# fp32 training's own distance from the float64 reference after 20 steps is 1.0e-6 (ZeRO-0 included), sharded vs
# unsharded 4.1e-7: 10x and 24x under EXACT, the same to 4 digits with ATen/oneDNN held to AVX2 (2026-11-25,
# DeepSpeed 0.19). The bugs below land at 0.31 (other convention) and 1.5 (flat-slice LAMB), 3e4x beyond.
EXACT = 1e-5


TWO_RANK_JOBS = ["zero1", "zero2", "zero2_noclip", "zero2_aligned", "zero1_decay_only", "zero2_decay_only", "naive",
                 "ckpt", "ckpt_elastic", "unbound", "stage3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Every DeepSpeed job once per module, in two launches (2 ranks; then 1 rank: ZeRO-0 and the elastic resume)."""
    base = tmp_path_factory.mktemp("lamb_zero")
    out = launch(2, base / "two_ranks", TWO_RANK_JOBS, steps=STEPS)
    out.update(launch(1, base / "one_rank", ["zero0", "resume_universal"], steps=STEPS, ckpt_from=base / "two_ranks"))
    for job, res in out.items():
        params = res["params"]
        if params[0] is not None:
            assert all(torch.equal(params[0][n], p[n]) for p in params[1:] for n in p), f"{job}: ranks disagree"
    return out


def final_params(runs, job: str) -> dict[str, torch.Tensor]:
    return runs[job]["params"][0]


def test_some_tensor_is_cut_between_ranks(runs):
    for job in ("zero1", "zero2", "zero2_aligned"):
        ranks = runs[job]["ranks"]
        assert all(r["bound"] for r in ranks)
        assert all(r["split_tensors"] for r in ranks), f"{job}: no tensor crosses the rank boundary"


def test_alignment_padding_between_tensors_is_exercised(runs):
    assert sum(r["gap_runs"] for r in runs["zero2_aligned"]["ranks"]) > 0
    assert sum(r["gap_runs"] for r in runs["zero2"]["ranks"]) == 0


def test_clip_is_active():
    stats: dict = {}
    reference_lamb(STEPS, stats=stats)
    assert stats.get("clipped_steps", 0) >= STEPS // 2


@pytest.mark.parametrize("job", ["zero0", "zero1", "zero2", "zero2_aligned"])
def test_sharded_lamb_equals_float64_reference(runs, job):
    assert max_rel_diff(final_params(runs, job), reference_lamb(STEPS)) <= EXACT


def test_sharded_lamb_equals_unsharded(runs):
    for job in ("zero1", "zero2"):
        assert max_rel_diff(final_params(runs, job), final_params(runs, "zero0")) <= EXACT, job


@pytest.mark.parametrize("job", ["zero1_decay_only", "zero2_decay_only"])
def test_sharded_decay_only_lamb_equals_float64_reference(runs, job):
    """apex's default convention: wd-0 tensors (biases, LayerNorm) take no trust ratio; still exact when sharded."""
    want = reference_lamb(STEPS, trust_ratio="decay_only")
    assert max_rel_diff(final_params(runs, job), want) <= EXACT
    assert max_rel_diff(final_params(runs, "zero2"), want) > 1e-3  # the convention changes the result


def test_sharded_lamb_without_clipping(runs):
    assert max_rel_diff(final_params(runs, "zero2_noclip"), reference_lamb(STEPS, clip=0.0)) <= EXACT


def test_naive_flat_slice_lamb_differs(runs):
    naive = final_params(runs, "naive")
    assert max_rel_diff(naive, reference_lamb(STEPS)) > 1e-3
    assert max_rel_diff(naive, final_params(runs, "zero0")) > 1e-3


def test_state_is_keyed_like_adam(runs):
    for r in runs["zero2"]["ranks"]:
        assert r["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
        assert r["step"] == STEPS


def test_stage3_is_refused(runs):
    for r in runs["stage3"]["ranks"]:
        assert r["bind_error"] and "stage 3" in r["bind_error"]
        assert r["step_error"] and "not bound" in r["step_error"]


def test_unbound_zero_step_is_refused(runs):
    for r in runs["unbound"]["ranks"]:
        assert r["step_error"] and "bind_optimizer" in r["step_error"]


@pytest.mark.parametrize("job", ["ckpt", "ckpt_elastic"])
def test_zero2_checkpoint_round_trip_continues_identically(runs, job):
    for r in runs[job]["ranks"]:
        assert r["loaded_step"] == STEPS // 2
        assert r["max_abs_diff"] == 0.0


def test_universal_checkpoint_resumes_on_another_world_size(runs):
    """Saved by 2 ranks at step 10, converted with ds_to_universal, resumed on 1 rank: the LAMB moments and step
    re-partition like Adam's and the run continues as the 2-rank run did."""
    assert runs["resume_universal"]["ranks"][0]["loaded_step"] == STEPS // 2
    assert max_rel_diff(final_params(runs, "resume_universal"), final_params(runs, "ckpt")) <= EXACT
