"""ZeroAwareLamb without ZeRO (plain torch), argument checks, param groups and the optimizer factory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bert_ds.optim import (
    GlobalNormClip,
    UnsupportedZeroSetup,
    ZeroAwareLamb,
    bind_optimizer,
    build_optimizer,
    no_decay,
    param_groups,
)
from tests.helpers.lamb_harness import (
    BETAS,
    CLIP,
    EPS,
    LR,
    WEIGHT_DECAY,
    batch,
    make_model,
    max_rel_diff,
    reference_lamb,
)


def train_plain(steps: int, clip: float = CLIP, **lamb_kw) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = build_optimizer("lamb", model, lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, eps=EPS, **lamb_kw)
    for step in range(steps):
        opt.zero_grad()
        model(*batch(step)).backward()
        if clip > 0:  # the non-DeepSpeed clipping story: clip the global norm, then step
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("trust_ratio", ["all", "decay_only"])
@pytest.mark.parametrize("clip", [CLIP, 0.0])
def test_plain_lamb_matches_float64_reference(clip, trust_ratio):
    got = train_plain(20, clip=clip, trust_ratio=trust_ratio)
    assert max_rel_diff(got, reference_lamb(20, clip=clip, trust_ratio=trust_ratio)) <= 1e-5


def test_decay_only_takes_plain_steps_on_tensors_without_weight_decay():
    """One step from zero moments: u = g / (|g| + eps) (bias correction), so a wd-0 tensor moves by exactly lr * u
    under ``decay_only`` and by lr * ||w|| / ||u|| * u under ``all``."""
    w0 = torch.tensor([0.5, -1.0, 2.0])
    moved = {}
    for rule in ("all", "decay_only"):
        w = nn.Parameter(w0.clone())
        w.grad = torch.tensor([1e-3, -2e-3, 4e-3])
        ZeroAwareLamb([{"params": [w], "weight_decay": 0.0}], lr=0.1, trust_ratio=rule).step()
        moved[rule] = w0 - w.detach()
    u = torch.tensor([1e-3, -2e-3, 4e-3]) / (torch.tensor([1e-3, 2e-3, 4e-3]) + 1e-6)
    torch.testing.assert_close(moved["decay_only"], 0.1 * u)
    torch.testing.assert_close(moved["all"], 0.1 * w0.norm() / u.norm() * u)


def test_old_state_dict_without_trust_ratio_loads():
    model = make_model()
    opt = build_optimizer("lamb", model, lr=LR, trust_ratio="decay_only")
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["trust_ratio"]
    opt.load_state_dict(saved)
    assert [g["trust_ratio"] for g in opt.param_groups] == ["decay_only", "decay_only"]


def test_global_norm_clip_matches_torch():
    """GlobalNormClip as a step pre-hook clips like torch's clip_grad_norm_ (both divide by norm + 1e-6)."""
    grads, clip = {}, GlobalNormClip(CLIP)
    for way in ("hook", "torch"):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        if way == "hook":
            clip.attach(opt)
        model(*batch(0)).backward()
        if way == "torch":
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
        grads[way] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert clip.last_norm > 10 * CLIP  # the clip is active
    assert clip.last_norm == pytest.approx(norm, rel=1e-6)
    assert max_rel_diff(grads["hook"], grads["torch"]) <= 1e-6


def test_global_norm_clip_measures_only_at_zero():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    clip = GlobalNormClip(0.0).attach(opt)
    model(*batch(0)).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    want = torch.sqrt(sum((g.double() ** 2).sum() for g in before.values()))
    assert clip.last_norm == pytest.approx(float(want), rel=1e-12)
    assert all(torch.equal(before[n], p.grad) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="max_norm"):
        GlobalNormClip(-1.0)


def test_trust_clamp_matches_reference():
    got = train_plain(10, min_trust=0.01, max_trust=0.3)
    ref = reference_lamb(10, min_trust=0.01, max_trust=0.3)
    assert max_rel_diff(got, ref) <= 1e-5
    assert max_rel_diff(got, reference_lamb(10)) > 1e-3  # the clamp is active on this model


def test_zero_weight_tensor_uses_trust_ratio_one():
    w = nn.Parameter(torch.zeros(4))
    w.grad = torch.tensor([1.0, -2.0, 3.0, 0.0])
    ZeroAwareLamb([w], lr=0.1, weight_decay=0.0).step()
    # step 1 with bias correction: u = g / (|g| + eps) = sign(g); r = 1 because ||w|| = 0
    expected = -0.1 * torch.tensor([1.0, -1.0, 1.0, 0.0]) * torch.tensor([1, 2, 3, 1.0]) / (
        torch.tensor([1, 2, 3, 1.0]) + 1e-6)
    torch.testing.assert_close(w.detach(), expected)


def test_state_keys_like_adam():
    model = make_model()
    opt = build_optimizer("lamb", model, lr=LR)
    model(*batch(0)).backward()
    opt.step()
    st = opt.state[model.fc1.weight]
    assert sorted(st) == ["exp_avg", "exp_avg_sq", "step"] and float(st["step"]) == 1
    restored = build_optimizer("lamb", model, lr=LR)
    restored.load_state_dict(opt.state_dict())
    torch.testing.assert_close(restored.state[model.fc1.weight]["exp_avg"], st["exp_avg"])


def test_replaced_params_without_binding_refuse_to_step():
    model = make_model()
    opt = build_optimizer("lamb", model, lr=LR)
    flat = nn.Parameter(torch.cat([p.detach().flatten() for p in opt.param_groups[0]["params"]]))
    flat.grad = torch.ones_like(flat)
    opt.param_groups[0]["params"] = [flat]  # what ZeRO 1/2 does to the client optimizer
    with pytest.raises(RuntimeError, match="bind_optimizer"):
        opt.step()


@pytest.mark.parametrize("kw", [dict(lr=-1.0), dict(betas=(0.9, 1.0)), dict(eps=0.0), dict(weight_decay=-0.1),
                                dict(min_trust=0.5, max_trust=0.1), dict(max_trust=-1.0), dict(trust_ratio="nvlamb")])
def test_bad_arguments_raise(kw):
    with pytest.raises(ValueError):
        ZeroAwareLamb([nn.Parameter(torch.ones(2))], **kw)


class BertLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(10, 4)
        self.LayerNorm = nn.LayerNorm(4)
        self.dense = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 10)
        self.decoder.weight = self.word_embeddings.weight  # tied, as the MLM head
        self.bias = nn.Parameter(torch.zeros(10))  # cls.predictions.bias
        self.scale = nn.Parameter(torch.ones(4))  # any other 1-D param
        self.frozen = nn.Parameter(torch.ones(2, 2), requires_grad=False)


def test_param_groups_no_decay_set():
    model = BertLike()
    groups = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = sorted(names[id(p)] for p in groups[0]["params"])
    plain = sorted(names[id(p)] for p in groups[1]["params"])
    assert groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0
    assert decay == ["dense.weight", "word_embeddings.weight"]  # the tied decoder weight appears once
    assert plain == ["LayerNorm.bias", "LayerNorm.weight", "bias", "decoder.bias", "dense.bias", "scale"]
    assert no_decay("encoder.layer.0.attention.output.LayerNorm.weight", torch.empty(2, 2))


def test_param_groups_drops_empty_group():
    groups = param_groups(nn.LayerNorm(3), 0.01)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.0


def test_build_optimizer_choices():
    model = make_model()
    assert isinstance(build_optimizer("lamb", model, lr=1e-3, zero_stage=2, max_trust=0.3), ZeroAwareLamb)
    adamw = build_optimizer("adamw", model, lr=1e-3, weight_decay=0.01)
    expected = "FusedAdam" if torch.cuda.is_available() else "AdamW"
    assert type(adamw).__name__ == expected
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.01, 0.0]
    with pytest.raises(UnsupportedZeroSetup, match="stage 3"):
        build_optimizer("lamb", model, lr=1e-3, zero_stage=3)
    with pytest.raises(ValueError, match="zero_stage=0"):
        build_optimizer("apex_lamb", model, lr=1e-3, zero_stage=2)
    with pytest.raises(ValueError, match="one of"):
        build_optimizer("sgd", model, lr=1e-3)
    with pytest.raises(ValueError, match="only apply to 'lamb'"):
        build_optimizer("adamw", model, lr=1e-3, max_trust=0.3)


def test_apex_lamb_needs_nvidia_apex(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("apex") is not None:
        pytest.skip("an 'apex' package is installed here")
    with pytest.raises(ImportError, match="NVIDIA apex"):
        build_optimizer("apex_lamb", make_model(), lr=1e-3, zero_stage=0)


def test_bind_optimizer_is_noop_for_adamw_and_zero0():
    model = make_model()
    adamw = build_optimizer("adamw", model, lr=1e-3)
    bind_optimizer(SimpleNamespace(optimizer=adamw, zero_optimization_stage=lambda: 2))
    lamb = build_optimizer("lamb", model, lr=1e-3)
    bind_optimizer(SimpleNamespace(optimizer=lamb, zero_optimization_stage=lambda: 0))
    assert lamb.zero_layout is None


def test_bind_optimizer_refuses_unknown_wrapper():
    lamb = build_optimizer("lamb", make_model(), lr=1e-3)
    wrapper = SimpleNamespace(optimizer=lamb)  # e.g. an fp16 stage-0 wrapper with flat fp32 groups
    with pytest.raises(UnsupportedZeroSetup, match="not supported"):
        bind_optimizer(SimpleNamespace(optimizer=wrapper, zero_optimization_stage=lambda: 0))
    with pytest.raises(UnsupportedZeroSetup, match="stage 3"):
        bind_optimizer(SimpleNamespace(optimizer=wrapper, zero_optimization_stage=lambda: 3))


def test_recipe_trust_ratio_option():
    from bert_ds.optim import TRUST_RATIO_RULES
    from bert_ds.recipe import _TRUST_RATIO_RULES, OptimizerConfig

    assert OptimizerConfig().trust_ratio == "all"  # what recipes saved before the option existed trained with
    # The recipe validates the option with its own list: every rule either side knows, both sides must accept.
    assert set(_TRUST_RATIO_RULES) == set(TRUST_RATIO_RULES)
    for rule in TRUST_RATIO_RULES:
        OptimizerConfig(trust_ratio=rule)
        lamb = build_optimizer("lamb", make_model(), lr=1e-3, trust_ratio=rule)
        assert {group["trust_ratio"] for group in lamb.param_groups} == {rule}
    with pytest.raises(ValueError, match="optimizer.trust_ratio='nvlamb'"):
        OptimizerConfig(trust_ratio="nvlamb")
    with pytest.raises(ValueError, match="LAMB setting"):
        OptimizerConfig(name="adamw", trust_ratio="decay_only")


@pytest.mark.parametrize("name", ["bert_large", "bert_base", "tiny_cpu"])
def test_shipped_recipes_use_nvidia_convention(name):
    """NVIDIA's BERT recipe steps its FusedLAMBAMP (earlier apex FusedLAMB) with the default use_nvlamb=False: no
    trust ratio for wd-0 tensors."""
    from pathlib import Path

    from bert_ds.recipe import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "ds_configs" / f"{name}.json")
    assert recipe.optimizer.name == "lamb" and recipe.optimizer.trust_ratio == "decay_only"


def test_trust_ratio_norms_exact_on_word_embedding_sized_tensors():
    """The trust ratio's norms on a tensor the size of a word-embedding matrix (30,522 x 256 = 7.8M elements): torch's
    fp32 CPU norm drifts with length (4e-4 on the squared norm here, 1.7e-3 on the trust ratio), which scales the whole
    tensor's step. Both paths (per tensor, and per segment of a ZeRO flat partition) must stay at float64 accuracy."""
    from bert_ds.optim.lamb import segment_sq_norms

    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(30_522 * 256, generator=gen) * 0.02
    g = torch.randn(w0.numel(), generator=gen) * 1e-3
    lengths = [w0.numel() - 1_000_000, 999_000, 1_000]
    want = torch.stack([v.double().square().sum() for v in torch.split(w0, lengths)])
    assert ((segment_sq_norms(w0, lengths) / want - 1).abs().max()) < 1e-9

    w = nn.Parameter(w0.clone())
    w.grad = g.clone()
    ZeroAwareLamb([w], lr=0.1, weight_decay=0.01, trust_ratio="all").step()
    u = g.double() / (g.double().abs() + 1e-6) + 0.01 * w0.double()  # step 1 from zero moments (bias-corrected)
    ratio = w0.double().norm() / u.norm()
    moved = (w0.double() - w.detach().double()) / (0.1 * u)
    assert abs(moved.median().item() / ratio.item() - 1) < 1e-6
