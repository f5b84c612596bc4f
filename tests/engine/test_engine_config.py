"""Pure functions of the engine: the generated DeepSpeed config, precision resolution, checkpoint tags/retention."""

from __future__ import annotations

import json

import pytest

from bert_ds.checkpoint import list_tags, parse_tag, prune_checkpoints, read_latest, tag_for
from bert_ds.recipe import Recipe
from bert_ds.runtime.engine import deepspeed_config, resolve_precision
from tests.helpers.runs import SMALL_RECIPE


def test_deepspeed_config_is_derived_from_the_phase():
    recipe = Recipe.from_dict(json.loads(json.dumps(SMALL_RECIPE)))
    ds = deepspeed_config(recipe, recipe.phases[0], world_size=2, precision="fp32")
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == \
        (4, 1, 2)
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["elastic_checkpoint"] is True
    assert ds["zero_allow_untested_optimizer"] is True and ds["gradient_clipping"] == 1.0
    assert "bf16" not in ds and "fp16" not in ds and "optimizer" not in ds and "scheduler" not in ds
    fp16 = deepspeed_config(recipe, recipe.phases[0], world_size=1, precision="fp16")
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0  # dynamic
    assert deepspeed_config(recipe, recipe.phases[0], world_size=4, precision="bf16")["bf16"] == {"enabled": True}
    with pytest.raises(ValueError, match="global_batch_size=4 is not divisible"):
        deepspeed_config(recipe, recipe.phases[0], world_size=3, precision="fp32")


def test_precision_resolution():
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("fp16", "cuda") == "fp16"
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"  # DeepSpeed runs bf16 ZeRO-1/2 on CPU (test_lamb_bf16.py)
    assert resolve_precision("fp32", "cpu") == "fp32"
    with pytest.raises(ValueError, match="fp16.*not supported on CPU"):
        resolve_precision("fp16", "cpu")


def test_tags_and_retention(tmp_path):
    assert tag_for(0, 40) == "phase1-step000040" and parse_tag("phase2-step001563") == (1, 1563)
    assert parse_tag("global_step40") is None
    for p, s in ((0, 10), (0, 20), (0, 40), (1, 5), (1, 10)):
        (tmp_path / tag_for(p, s)).mkdir()
        (tmp_path / tag_for(p, s) / "run_state.json").write_text("{}")
    (tmp_path / "phase2-step000015").mkdir()  # incomplete: no run_state.json, never listed
    (tmp_path / "latest").write_text("phase2-step000010")
    assert list_tags(tmp_path) == ["phase1-step000010", "phase1-step000020", "phase1-step000040",
                                   "phase2-step000005", "phase2-step000010"]
    assert prune_checkpoints(tmp_path, keep_last_k=2) == ["phase1-step000010", "phase1-step000020",
                                                          "phase1-step000040"]
    assert read_latest(tmp_path) == "phase2-step000010"
    (tmp_path / "latest").write_text("phase2-step000015")
    with pytest.raises(ValueError, match="run_state.json is missing"):
        read_latest(tmp_path)


def _recipe(**deepspeed) -> Recipe:
    data = json.loads(json.dumps(SMALL_RECIPE))
    data["deepspeed"] = {**data["deepspeed"], **deepspeed}
    return Recipe.from_dict(data)


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_runs_sum_gradients_in_fp32_by_default(stage):
    """Both halves of the sum in fp32 (over micro batches and over ranks); DeepSpeed's own bf16 sums on request, and
    nothing changes for fp32 and fp16 runs (tests/optim/test_grad_accum_bf16.py runs these configs)."""
    recipe = _recipe(precision="auto", zero_stage=stage)
    ds = deepspeed_config(recipe, recipe.phases[0], world_size=2, precision="bf16")
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["communication_data_type"] == "fp32"
    bf16_sums = _recipe(precision="bf16", zero_stage=stage, grad_accum_dtype="bf16")
    for other, precision in ((bf16_sums, "bf16"), (recipe, "fp32"), (recipe, "fp16")):
        ds = deepspeed_config(other, other.phases[0], world_size=2, precision=precision)
        assert "data_types" not in ds and "communication_data_type" not in ds, (precision, ds)


@pytest.mark.parametrize("stage, optimizer", [(0, "adamw"), (3, "adamw")])
def test_fp32_sums_are_refused_where_they_cannot_be_had(stage, optimizer):
    """Without ZeRO DeepSpeed refuses bf16 with fp32 accumulation; ZeRO-3's is not proven: an ``auto`` recipe
    resolved to bf16 (a GPU) is refused before any compute, naming the field; ``bf16`` sums are allowed."""
    from bert_ds.errors import BadInput
    from bert_ds.runtime.engine import check_optimizer_support

    data = json.loads(json.dumps(SMALL_RECIPE))
    data["optimizer"] = {"name": optimizer}
    data["deepspeed"] = {**data["deepspeed"], "precision": "auto", "zero_stage": stage}
    recipe = Recipe.from_dict(data)
    check_optimizer_support(recipe, "fp32")  # auto on a CPU
    with pytest.raises(BadInput, match=rf"grad_accum_dtype='fp32'.*zero_stage is {stage}.*resolved to bf16"):
        check_optimizer_support(recipe, "bf16")
    data["deepspeed"]["grad_accum_dtype"] = "bf16"
    check_optimizer_support(Recipe.from_dict(data), "bf16")
    data["deepspeed"].update(precision="bf16", grad_accum_dtype="fp32")  # explicit bf16: refused at load
    with pytest.raises(ValueError, match=rf"deepspeed.grad_accum_dtype='fp32'.*zero_stage is {stage}"):
        Recipe.from_dict(data)
