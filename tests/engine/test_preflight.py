"""Pre-flight in-process: the plan a command line and a run directory produce, and the refusals, before any compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bert_ds.data.loader import build_loader
from bert_ds.errors import BadInput
from bert_ds.recipe import Recipe
from bert_ds.runtime.preflight import StartPoint, plan_run
from bert_ds.runtime.pretrain import parse_args
from tests.helpers.run_state import fake_run_state
from tests.helpers.runs import SMALL_RECIPE, write_recipe


def _plan(tmp_path: Path, data: tuple[Path, Path], *extra: str, recipe: dict | None = None, world_size: int = 1):
    path = write_recipe(tmp_path / "recipe.json", base=recipe)
    args = parse_args(["--recipe", str(path), "--data", *map(str, data), "--tokenizer",
                       str(data[0].parent / "tokenizer"), "--output", str(tmp_path / "run"), *extra])
    return plan_run(args, Recipe.from_dict(json.loads(path.read_text())), rank=0, world_size=world_size)


def _fake_checkpoint(run: Path, tokenizer: Path, phase: int, step: int, done: bool, data: Path | None = None,
                     without: str | None = None) -> str:
    """The two files pre-flight reads of a checkpoint: ``latest`` and the tag's run_state.json, trained with the
    synthetic shards' tokenizer; with ``data`` (a mid-phase tag), the loader position a run over that shard set saves
    after ``step`` steps; ``without`` leaves that field out."""
    tag = f"phase{phase + 1}-step{step:06d}"
    (run / "checkpoints" / tag).mkdir(parents=True)
    recipe = Recipe.from_dict(SMALL_RECIPE)
    loader = {}
    if data is not None:
        p = recipe.phases[phase]
        loader = build_loader(data, global_batch_size=p.global_batch_size, micro_batch_size=p.micro_batch_size,
                              rank=0, world_size=1, seed=recipe.seed + phase, num_workers=0,
                              max_predictions=p.max_predictions, shuffle_window_shards=p.shuffle_window_shards)
        loader = {**loader.state_dict(), "consumed_global_batches": step}
    state = fake_run_state(tokenizer_dir=tokenizer, recipe=recipe.to_dict(), phase=phase, step=step,
                           phase_done=done, loader=loader).to_dict()
    state.pop(without, None)
    (run / "checkpoints" / tag / "run_state.json").write_text(json.dumps(state))
    (run / "checkpoints" / "latest").write_text(tag)
    return tag


def test_fresh_plan(synthetic_data, tmp_path):
    plan = _plan(tmp_path, synthetic_data)
    assert plan.phases == [0, 1] and plan.start == StartPoint(phase=0, step=0, tag=None, handoff=False)
    assert plan.data == {0: str(synthetic_data[0]), 1: str(synthetic_data[1])}
    assert plan.nothing_to_do is None and plan.precision == "fp32" and plan.model_config.vocab_size == 12000
    assert [plan.first_step_of(p) for p in (0, 1)] == [0, SMALL_RECIPE["phases"][0]["steps"]]
    assert not (tmp_path / "run").exists()  # planning writes nothing


def test_resume_points(synthetic_data, tmp_path):
    run, tok = tmp_path / "run", synthetic_data[0].parent / "tokenizer"
    tag = _fake_checkpoint(run, tok, phase=0, step=2, done=False, without="loader")
    with pytest.raises(BadInput, match=r"run_state.json: field 'loader' is missing"):
        _plan(tmp_path, synthetic_data, "--resume", "auto")
    tag = _fake_checkpoint(run, tok, phase=0, step=3, done=False, data=synthetic_data[0])
    assert _plan(tmp_path, synthetic_data, "--resume", "auto").start == StartPoint(0, 3, tag, False)
    with pytest.raises(ValueError, match="--resume auto"):
        _plan(tmp_path, synthetic_data)  # an existing checkpoint is never silently overwritten
    tag = _fake_checkpoint(run, tok, phase=0, step=4, done=True)
    assert _plan(tmp_path, synthetic_data, "--resume", "auto").start == StartPoint(1, 0, tag, True)
    capped = _plan(tmp_path, synthetic_data, "--resume", "auto", "--max-steps", "4")
    assert capped.nothing_to_do and "--max-steps 4" in capped.nothing_to_do
    tag = _fake_checkpoint(run, tok, phase=1, step=2, done=True)
    assert "already finished" in _plan(tmp_path, synthetic_data, "--resume", "auto").nothing_to_do


def test_refusals_name_the_culprit(synthetic_data, tmp_path):
    with pytest.raises(ValueError, match="--phase 2: .* holds no phase-1 checkpoint"):
        _plan(tmp_path, (synthetic_data[1],), "--phase", "2", "--resume", "auto")
    with pytest.raises(ValueError, match=r"--data: got 1 directories for a recipe with 2 phase"):
        _plan(tmp_path, (synthetic_data[0],))
    with pytest.raises(ValueError, match=r"seq_len"):  # shard sets in the wrong order
        _plan(tmp_path, (synthetic_data[1], synthetic_data[0]))
    with pytest.raises(ValueError, match=r"phases\[0\].global_batch_size"):
        _plan(tmp_path, synthetic_data, world_size=3)


def test_the_plan_carries_typed_arguments_not_argparse(synthetic_data, tmp_path):
    """The trainer reads the run's arguments from a frozen RunArgs, never an argparse.Namespace."""
    import argparse
    import dataclasses

    from bert_ds.runtime.preflight import RunArgs

    plan = _plan(tmp_path, synthetic_data, "--max-steps", "3")
    assert type(plan.args) is RunArgs and not isinstance(plan.args, argparse.Namespace)
    assert plan.args.max_steps == 3 and plan.args.resume == "none"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.args.max_steps = 4


def test_the_plan_states_each_phases_expected_memory(synthetic_data, tmp_path, caplog):
    """Pre-flight logs every phase's expected peak memory per GPU (bert_ds.runtime.memory); on CPU ranks it is
    stated, not checked (the refusal on a CUDA device is tests/engine/test_memory_estimate.py's, with a fake device
    size)."""
    import logging

    with caplog.at_level(logging.INFO, logger="bert_ds.runtime.preflight"):
        _plan(tmp_path, synthetic_data, world_size=2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("expected memory: ")]
    assert [line.split(":")[1].strip() for line in lines] == ["phases[0]", "phases[1]"]
    assert "tiny seq 128, micro batch 1, fp32, ZeRO-2 on 2 GPU(s)" in lines[0]
    assert "tiny seq 512, micro batch 1" in lines[1]
    assert all("GiB expected per GPU" in line and "not checked against a device (no CUDA)" in line for line in lines)


def test_other_cpu_ranks_skip_the_estimate_rank_0_states(synthetic_data, tmp_path, monkeypatch):
    """Without a device to check, only rank 0's estimate is used (logged): the others do not compute one."""
    from bert_ds.runtime import memory, preflight

    calls = []
    real = memory.check_recipe_memory
    monkeypatch.setattr(memory, "check_recipe_memory", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    recipe = Recipe.from_dict(SMALL_RECIPE)
    config = recipe.model_config(vocab_size=12000)
    for rank in (1, 0):
        preflight._state_memory(recipe, [0, 1], config, "fp32", 2, rank, "cpu")
    assert calls == [[0, 1]]  # rank 0 only
