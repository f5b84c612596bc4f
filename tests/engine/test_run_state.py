"""The typed run state (``bert_ds.checkpoint.RunState``), the one loader builder the trainer and pre-flight share, and
pre-flight's check of ``--step-timeout`` against the recipe's process-group timeout.

``assets/run_state/v1_phase1-step000002.json`` is a real ``run_state.json``, written by bert_ds at 3a5c049 (before
``schema_version``) after two steps of ``tests/helpers/runs.py``'s SMALL_RECIPE on the engine tests' synthetic shards.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from bert_ds import checkpoint as ckpt
from bert_ds.errors import BadInput
from bert_ds.recipe import Recipe
from bert_ds.runtime.preflight import plan_run
from bert_ds.runtime.pretrain import parse_args
from tests.helpers.run_state import fake_run_state
from tests.helpers.runs import SMALL_RECIPE, write_recipe

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "run_state"
V1 = ASSETS / "v1_phase1-step000002.json"
TAG = "phase1-step000002"


def _tag_with(tmp_path: Path, data: dict) -> Path:
    """A checkpoint directory whose tag ``TAG`` holds ``data`` as its run_state.json."""
    (tmp_path / TAG).mkdir(parents=True)
    (tmp_path / TAG / ckpt.RUN_STATE_NAME).write_text(json.dumps(data))
    return tmp_path


def test_a_run_state_round_trips_through_its_file(tmp_path):
    state = fake_run_state(phase=1, step=3, phase_done=True, loader={"format": "x", "consumed_global_batches": 3})
    state = ckpt.RunState(**{**state.to_dict(), "time_budget": {"elapsed_s": 12.5}})
    assert state.to_dict()["schema_version"] == ckpt.RUN_STATE_SCHEMA == 2
    read = ckpt.read_run_state(_tag_with(tmp_path, state.to_dict()), TAG)
    assert read.to_dict() == json.loads(json.dumps(state.to_dict()))  # as JSON holds it: tuples are lists
    assert read.time_budget == {"elapsed_s": 12.5} and read.loader["consumed_global_batches"] == 3


@pytest.mark.parametrize(("change", "pattern"), [
    ({"learning_rate": 0.1}, r"unknown field 'learning_rate'"),
    ({"step": None}, r"field 'step' is missing"),
    ({"step": "3"}, r"field 'step' is '3', not an integer"),
    ({"phase_done": 1}, r"field 'phase_done' is 1, not true or false"),
    ({"world_size": True}, r"field 'world_size' is True, not an integer"),
    ({"schema_version": 3}, r"field 'schema_version' is 3; this bert_ds reads versions 1 and 2"),
])
def test_a_field_it_cannot_use_is_refused_by_file_and_name(tmp_path, change, pattern):
    data = {**fake_run_state().to_dict(), **change}
    data = {k: v for k, v in data.items() if v is not None or k == "time_budget"}
    ckpt_dir = _tag_with(tmp_path, data)
    with pytest.raises(BadInput, match=rf"^{tmp_path / TAG / ckpt.RUN_STATE_NAME}: {pattern}"):
        ckpt.read_run_state(ckpt_dir, TAG)


def test_the_run_state_of_a_tag_written_before_schema_version_is_read(tmp_path):
    """Version 1: today's layout without ``schema_version``, ``time_budget`` only in a ``time_linear`` phase. The
    seal (``files``, ``run_state_sha256``) is integrity's, not a run state field."""
    raw = json.loads(V1.read_text())
    assert "schema_version" not in raw and "time_budget" not in raw and {"files", "run_state_sha256"} <= set(raw)
    ckpt_dir = tmp_path / "ckpt"
    (ckpt_dir / TAG).mkdir(parents=True)
    shutil.copyfile(V1, ckpt_dir / TAG / ckpt.RUN_STATE_NAME)
    state = ckpt.read_run_state(ckpt_dir, TAG)
    assert (state.phase, state.step, state.phase_done, state.consumed_samples) == (0, 2, False, 8)
    assert state.loader["consumed_global_batches"] == 2 and state.time_budget is None
    assert state.recipe["name"] == "engine_test" and state.recipe["phases"][0]["steps"] == 4
    assert state.schema_version == 2  # read as the current version: it writes back with every field
    budgeted = {**raw, "time_budget": {"elapsed_s": 1.0}}
    assert ckpt.read_run_state(_tag_with(tmp_path / "b", budgeted), TAG).time_budget == {"elapsed_s": 1.0}
    without = {k: v for k, v in raw.items() if k != "precision"}
    with pytest.raises(BadInput, match=r"field 'precision' is missing \(run state schema_version 1\)"):
        ckpt.read_run_state(_tag_with(tmp_path / "c", without), TAG)


def test_the_tokenizer_check_names_the_field_and_the_first_differing_id(tmp_path):
    from bert_ds.data.tokenizer import load_tokenizer
    from tests.helpers.ds_checkpoint import write_tokenizer_dir

    trained = write_tokenizer_dir(tmp_path / "trained", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"])
    other = write_tokenizer_dir(tmp_path / "other", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "c"])
    ckpt_dir = _tag_with(tmp_path / "ckpt", fake_run_state(tokenizer_dir=trained).to_dict())
    shutil.copyfile(trained / "vocab.txt", ckpt_dir / TAG / ckpt.TAG_VOCAB_NAME)
    assert ckpt.trained_tokenizer_mismatch(ckpt_dir, TAG, load_tokenizer(trained)) is None
    found = ckpt.trained_tokenizer_mismatch(ckpt_dir, TAG, load_tokenizer(other))
    assert found.field == "vocab_sha256" and "id 6: 'b' in" in found.first_difference, found
    cased = _tag_with(tmp_path / "cased", fake_run_state(tokenizer_dir=trained, lowercase=False).to_dict())
    assert ckpt.trained_tokenizer_mismatch(cased, TAG, load_tokenizer(trained)) == ckpt.TokenizerMismatch(
        "lowercase", False, True)


# ------------------------------------------------------------------------------------------------ the loader
def _plan(tmp_path: Path, data: tuple[Path, Path], *extra: str, recipe: dict | None = None):
    path = write_recipe(tmp_path / "recipe.json", base=recipe)
    args = parse_args(["--recipe", str(path), "--data", *map(str, data), "--tokenizer",
                       str(data[0].parent / "tokenizer"), "--output", str(tmp_path / "run"), *extra])
    return plan_run(args, Recipe.from_dict(json.loads(path.read_text())), rank=0, world_size=1)


def test_the_trainer_and_preflight_build_the_same_loader(synthetic_data, tmp_path, monkeypatch):
    """Both ask ``loader_for_phase``: the same keywords but the workers and the verify level (which change how
    batches are made, never which), dynamic masking included. Pre-flight once built its own loader without it, and
    so refused to resume this phase (10 predictions a row, below the shards' static 20, which dynamic masking does not
    use): "max_predictions=10 is below the 20 predictions per sample index.json allows"."""
    import bert_ds.data.loader as loader_module
    from bert_ds.runtime import trainer

    recipe = json.loads(json.dumps(SMALL_RECIPE))
    recipe["phases"][0].update(dynamic_masking=True, masked_lm_prob=0.2, max_predictions=10)
    plan = _plan(tmp_path, synthetic_data, recipe=recipe)
    loader, _ = trainer._build_loaders(plan, 0)
    # a checkpoint of that loader after 2 steps, resumed: pre-flight checks the loader position
    state = fake_run_state(tokenizer_dir=synthetic_data[0].parent / "tokenizer", recipe=plan.recipe.to_dict(),
                           step=2, loader={**loader.state_dict(), "consumed_global_batches": 2})
    (tmp_path / "run" / "checkpoints" / TAG).mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / TAG / ckpt.RUN_STATE_NAME).write_text(json.dumps(state.to_dict()))
    (tmp_path / "run" / "checkpoints" / "latest").write_text(TAG)
    calls, build = [], loader_module.build_loader
    monkeypatch.setattr(loader_module, "build_loader", lambda *a, **kw: calls.append((a, kw)) or build(*a, **kw))
    resumed = _plan(tmp_path, synthetic_data, "--resume", "auto", recipe=recipe)
    assert resumed.start.step == 2 and len(calls) == 1  # pre-flight's resume check
    trainer._build_loaders(resumed, 0)
    (pre_args, pre), (run_args, run) = calls
    assert pre.pop("num_workers") == 0 and pre.pop("verify") == "size"
    assert run.pop("num_workers") == 1 and run.pop("verify") == resumed.loader_verify
    masking = (pre.pop("dynamic_masking"), run.pop("dynamic_masking"))
    assert masking[0] is not None and masking[0].describe() == masking[1].describe()
    assert masking[0].describe()["masked_lm_prob"] == 0.2
    assert (pre_args, pre) == (run_args, run)


def test_one_shard_set_and_a_mix_offer_the_loop_one_surface(mix_shards_128):
    """The step loop uses the same members of either loader; none is missing from the single-set one."""
    from bert_ds.data.loader import MixedShardLoader, ShardLoader, Source, build_loader

    lic, std = str(mix_shards_128["licenses"]), str(mix_shards_128["stdlib"])
    options = dict(global_batch_size=4, micro_batch_size=2, num_workers=0, verify="size")
    single = build_loader([Source(lic, None)], **options)
    mixed = build_loader([Source(lic, 1.0), Source(std, 3.0)], **options)
    assert type(single) is ShardLoader and type(mixed) is MixedShardLoader
    for loader in (single, mixed):
        assert loader.mix_change is None and loader.consumed_global_batches == 0
        assert loader.gradient_accumulation_steps == 2 and callable(loader.load_state_dict)
        assert isinstance(loader.state_dict(), dict) and next(iter(loader))["input_ids"].shape[0] == 2
    assert single.describe(10) == [] and len(mixed.describe(10)) == 3  # a heading, then one line per source


def _loader_sniffs(source: str) -> list[str]:
    """Calls of ``getattr``/``hasattr``/``isinstance`` whose first argument names a loader."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "isinstance") and "loader" in ast.unparse(node.args[0])]


def test_the_trainer_never_asks_which_loader_it_has():
    """No ``getattr``/``hasattr``/``isinstance`` on a loader (training or eval) in the step loop's module."""
    source = (Path(__file__).resolve().parents[2] / "bert_ds" / "runtime" / "trainer.py").read_text()
    assert _loader_sniffs(source) == []
    old = ('if getattr(ph.loader, "mix_change", None): pass\nif hasattr(loader, "describe"): pass\n'
           'if isinstance(ph.eval_loader, dict): pass\n')
    assert len(_loader_sniffs(old)) == 3  # the scan sees the old way


# ------------------------------------------------------------------------------------------------ step timeout
@pytest.mark.parametrize(("timeout", "flag", "pattern"), [
    (60, ["--step-timeout", "90"], r"--step-timeout 90 is not below recipe .*recipe\.json's "
                                   r"deepspeed\.process_group_timeout_s 60: "),
    (60, ["--step-timeout", "60"], r"--step-timeout 60 is not below .*deepspeed\.process_group_timeout_s 60"),
    (200, [], r"the progress watchdog's floor 300 s \(--step-timeout not given; half DeepSpeed's default "
              r"process-group timeout\) is not below recipe .*deepspeed\.process_group_timeout_s 200: .*give "
              r"--step-timeout below 200 \(e\.g\. 100, half of it\)"),
    (None, ["--step-timeout", "900"], r"--step-timeout 900 is not below .*deepspeed\.process_group_timeout_s "
                                      r"\(null: DeepSpeed's default\) 600"),
])
def test_a_step_timeout_not_below_the_process_group_timeout_is_refused(synthetic_data, tmp_path, timeout, flag,
                                                                        pattern):
    recipe = {**SMALL_RECIPE, "deepspeed": {**SMALL_RECIPE["deepspeed"], "process_group_timeout_s": timeout}}
    with pytest.raises(BadInput, match=pattern):
        _plan(tmp_path, synthetic_data, *flag, recipe=recipe)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("timeout", "flag"), [(60, ["--step-timeout", "30"]), (60, ["--step-timeout", "0"]),
                                               (None, []), (301, [])])
def test_a_step_timeout_below_it_or_off_is_planned(synthetic_data, tmp_path, timeout, flag):
    recipe = {**SMALL_RECIPE, "deepspeed": {**SMALL_RECIPE["deepspeed"], "process_group_timeout_s": timeout}}
    assert _plan(tmp_path, synthetic_data, *flag, recipe=recipe).start.tag is None
