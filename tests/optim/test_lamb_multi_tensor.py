"""The multi-tensor ZeroAwareLamb equals the per-tensor one it replaced (frozen in tests/helpers/lamb_per_tensor.py):
100 steps at stage 0 in-process, a one-rank ZeRO layout of BERT-large's tensors in-process, and 100 steps on 2 real
DeepSpeed ranks under ZeRO 1 and 2 (e2e); both trust-ratio conventions, clipping, clamps, bias correction off, and
a per-tensor optimizer's state resumed by the multi-tensor one.

The ops are the same elementwise ops in the same order (foreach ops run them per tensor on the CPU; the trust ratio
reaches the multiply as the same fp32 value), so on the CPU the two agree bit for bit; EQUAL is the issue's bound.
"""

from __future__ import annotations

import copy

import pytest
import torch

from bert_ds.devtools.benchmarks.optimizer_step import zero_step
from bert_ds.optim import ZeroAwareLamb, param_groups
from bert_ds.optim.lamb import segment_sq_norms
from tests.helpers import lamb_per_tensor
from tests.helpers.bert_large_step import one_rank_zero_optimizer
from tests.helpers.lamb_harness import CLIP, LR, WEIGHT_DECAY, batch, launch, make_model, max_rel_diff
from tests.helpers.lamb_per_tensor import PerTensorLamb

EQUAL = 1e-6
STEPS = 100


def train(cls, steps: int, clip: float, start: dict | None = None, **kw) -> tuple[dict, dict]:
    """``steps`` plain-torch steps of the tiny model (clip by the global norm, then step), optionally from a state
    dict; returns the params and the optimizer's state dict."""
    model = make_model()
    opt = cls(param_groups(model, WEIGHT_DECAY), lr=LR, **kw)
    first = 0
    if start is not None:
        start = copy.deepcopy(start)  # load_state_dict keeps the moment tensors it is given: steps would change them
        model.load_state_dict(start["model"])
        opt.load_state_dict(start["opt"])
        first = start["steps"]
    for step in range(first, first + steps):
        opt.zero_grad()
        model(*batch(step)).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, {"model": model.state_dict(), "opt": opt.state_dict(), "steps": first + steps}


STAGE0_CASES = {  # (global-norm clip, optimizer arguments)
    "all": (CLIP, dict(trust_ratio="all")),
    "decay_only": (CLIP, dict(trust_ratio="decay_only")),
    "clamped_noclip": (0.0, dict(trust_ratio="all", min_trust=0.01, max_trust=0.3)),
    "no_bias_correction": (CLIP, dict(trust_ratio="decay_only", bias_correction=False)),
}


@pytest.mark.parametrize("case", sorted(STAGE0_CASES))
def test_stage0_equals_per_tensor(case):
    clip, kw = STAGE0_CASES[case]
    got, _ = train(ZeroAwareLamb, STEPS, clip, **kw)
    want, _ = train(PerTensorLamb, STEPS, clip, **kw)
    assert max_rel_diff(got, want) <= EQUAL


def test_per_tensor_state_resumes_in_multi_tensor():
    """A checkpoint written by the per-tensor optimizer (exp_avg, exp_avg_sq, int step) continues identically."""
    _, half = train(PerTensorLamb, STEPS // 2, CLIP, trust_ratio="decay_only")
    got, state = train(ZeroAwareLamb, STEPS // 2, CLIP, start=half, trust_ratio="decay_only")
    want, _ = train(PerTensorLamb, STEPS // 2, CLIP, start=half, trust_ratio="decay_only")
    assert max_rel_diff(got, want) <= EQUAL
    first = state["opt"]["state"][0]
    assert sorted(first) == ["exp_avg", "exp_avg_sq", "step"] and first["step"] == STEPS


@pytest.mark.parametrize("case", ["all", "decay_only", "clamped_noclip"])
def test_one_rank_zero_layout_equals_per_tensor(case):
    """The flat-partition path over BERT-large's 398 tensors (scaled down; padding at the end of a group)."""
    kw = STAGE0_CASES[case][1]
    flats = {}
    for cls in (ZeroAwareLamb, PerTensorLamb):
        opt, zmap = one_rank_zero_optimizer(cls, 64, **kw)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            for zg in zmap.groups:
                zg.flat.grad = 1e-3 * torch.randn(zg.flat.shape, generator=gen)
            zero_step(opt, zmap)
        flats[cls] = {str(i): zg.flat.detach().clone() for i, zg in enumerate(zmap.groups)}
        assert all(torch.equal(zg.bit16_partition, zg.flat) for zg in zmap.groups)
        assert any(t < 0 for lay in opt.zero_layout.groups for t in lay.run_tensor)  # a padding run is stepped
    assert max_rel_diff(flats[ZeroAwareLamb], flats[PerTensorLamb]) <= EQUAL


def test_float64_norms_on_long_tensors_match_per_tensor():
    """BERT-large's word embeddings (30,522 x 1,024 = 31.3M elements) cut into runs: the one-op float64 norms agree with
    the per-view float64 norms of before to float64 rounding (an fp32 norm is off by 3.9e-3 here)."""
    gen = torch.Generator().manual_seed(0)
    flat = 0.02 * torch.randn(30_522 * 1_024, generator=gen)
    lengths = [flat.numel() - 2_000_000, 1_999_000, 1_000]
    got, want = segment_sq_norms(flat, lengths), lamb_per_tensor.segment_sq_norms(flat, lengths)
    assert ((got / want - 1).abs().max()) < 1e-12
    fp32 = torch.stack([torch.linalg.vector_norm(v).double().square() for v in torch.split(flat, lengths)])
    assert ((fp32 / want - 1).abs().max()) > 1e-6  # what float64 accumulation is for


# ---------------------------------------------------------------------------------------------- 2 real ranks
SHARDED_JOBS = ["zero1", "zero2", "zero2_noclip", "zero2_aligned", "zero1_decay_only", "zero2_decay_only",
                "zero2_clamped"]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict[str, dict]:
    jobs = SHARDED_JOBS + [f"per_tensor_{job}" for job in SHARDED_JOBS]
    return launch(2, tmp_path_factory.mktemp("lamb_multi_tensor"), jobs, steps=STEPS)


@pytest.mark.e2e
@pytest.mark.parametrize("job", SHARDED_JOBS)
def test_sharded_multi_tensor_equals_per_tensor(sharded_runs, job):
    """ZeRO 1/2 on 2 gloo ranks (tensors cut at the rank boundary, round-robin gradients, alignment padding), 100 steps:
    the multi-tensor optimizer against the per-tensor one on the same ranks and data."""
    got, want = sharded_runs[job]["params"], sharded_runs[f"per_tensor_{job}"]["params"]
    assert all(torch.equal(got[0][n], p[n]) for p in got[1:] for n in p), f"{job}: ranks disagree"
    assert all(r["split_tensors"] for r in sharded_runs[job]["ranks"]), f"{job}: no tensor crosses the rank boundary"
    assert max_rel_diff(got[0], want[0]) <= EQUAL
