"""Sharded LAMB through bert_ds's engine on real English text with gradient clipping on: ZeRO-1 and ZeRO-2 on 2 CPU
ranks end 12 steps of tiny_cpu (dropout 0) as close to ZeRO-0 on 1 rank as plain data parallelism (ZeRO-0 on 2 ranks)
does, for both trust-ratio conventions; and every stage reports the same gradient norm.

Before bert_ds clipped stage 0 itself, DeepSpeed's stage-0 clip used an fp32 norm (3e-5 off on CPU) while ZeRO 1/2
use fp64: ZeRO-1/2 then ended 1.5e-5 ("all") and 5.3e-5 ("decay_only") from ZeRO-0 against floors of 1.2e-6 and
3.0e-6, and this test failed for every stage and convention.
"""

from __future__ import annotations

import math

import pytest

from tests.helpers.lamb_harness import launch_engine_runs, max_rel_diff, max_rel_diff_excluding

pytestmark = pytest.mark.slow

STEPS = 12
CONVENTIONS = ("all", "decay_only")
# Attention query/key biases: the key bias's true gradient is 0 (softmax cancels it) and the query bias's is tiny, so
# their LAMB updates are rounding noise that differs with any change of reduction order.
NOISE_ONLY = ("attention.self.query.bias", "attention.self.key.bias")
FLOOR_FACTOR = 4.0
"""Sharded runs may sit this many times further from ZeRO-0 x1 than ZeRO-0 x2 does (measured here: <= 2.1x)."""
NOISE_ALLOWANCE = 8e-6
"""...or this far, whichever is larger. The floor is itself one sample of rounding noise, and which tensor is worst
moves with the CPU's matmul kernels: on CI's machine ZeRO-2 "decay_only" ended 3.7e-6 from ZeRO-0 x1 at the pooler
bias (NSP-only gradient, no trust ratio: Adam normalises its rounding noise up) against a floor of 8.7e-7, while here
both sit at 9e-7. The bugs this test exists for measured 1.5e-5 and 5.3e-5 (module docstring), well above it."""


@pytest.fixture(scope="module")
def runs(shards_128, tokenizer_dir, tmp_path_factory) -> dict[str, dict]:
    base = tmp_path_factory.mktemp("lamb_engine")
    vocab = tokenizer_dir / "vocab.txt"
    one = [f"z0-clip-{c}" for c in CONVENTIONS]
    two = [f"z{stage}-clip-{c}" for c in CONVENTIONS for stage in (0, 1, 2)]
    out = {f"{job}x1": res for job, res in launch_engine_runs(1, base / "one", one, STEPS, shards_128, vocab).items()}
    out.update({f"{job}x2": res
                for job, res in launch_engine_runs(2, base / "two", two, STEPS, shards_128, vocab).items()})
    return out


def distance(runs, job: str, ref: str) -> tuple[float, str]:
    return max_rel_diff_excluding(runs[job]["params"], runs[ref]["params"], NOISE_ONLY)


def test_clip_is_active(runs):
    norms = runs["z0-clip-allx1"]["grad_norms"]
    assert sum(n > 1.0 for n in norms) >= STEPS // 2, norms


@pytest.mark.parametrize("trust_ratio", CONVENTIONS)
@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_lamb_is_at_the_data_parallel_floor(runs, trust_ratio, stage):
    ref = f"z0-clip-{trust_ratio}x1"
    floor, _ = distance(runs, f"z0-clip-{trust_ratio}x2", ref)
    got, worst = distance(runs, f"z{stage}-clip-{trust_ratio}x2", ref)
    print(f"trust_ratio={trust_ratio}: ZeRO-0 x2 {floor:.2e}, ZeRO-{stage} x2 {got:.2e} ({worst}) from ZeRO-0 x1")
    assert floor < 2e-5, f"data-parallel floor {floor:.2e} is not a rounding-level difference"
    allowed = max(FLOOR_FACTOR * floor, NOISE_ALLOWANCE)
    assert got <= allowed, f"ZeRO-{stage}: {got:.2e} ({worst}) vs floor {floor:.2e}, allowed {allowed:.2e}"


def test_conventions_differ(runs):
    assert max_rel_diff(runs["z0-clip-allx1"]["params"], runs["z0-clip-decay_onlyx1"]["params"]) > 1e-3


def test_every_stage_reports_the_same_grad_norm(runs):
    """Step 1 starts from the same weights everywhere, so its norm is the same up to rounding at every stage."""
    for job, res in runs.items():
        assert all(n is not None and math.isfinite(n) and n > 0 for n in res["grad_norms"]), (job, res["grad_norms"])
    first = [res["grad_norms"][0] for res in runs.values()]
    assert max(first) / min(first) - 1 <= 1e-6, dict(zip(runs, first, strict=True))


def test_zero0_grad_norm_is_the_norm_of_the_averaged_gradients(runs):
    for job in ("z0-clip-allx1", "z0-clip-allx2", "z0-clip-decay_onlyx2"):
        got, want = runs[job]["grad_norms"], runs[job]["independent_norms"]
        assert len(got) == len(want) == STEPS
        assert all(math.isclose(g, w, rel_tol=1e-12) for g, w in zip(got, want, strict=True)), (job, got, want)
