"""Pre-flight of a phase that reads a weighted mix of real shard sets: the plan, each check naming the source at
fault, and a resume whose mix changed (refused by name; continued only when asked)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from bert_ds.data.loader import build_loader
from bert_ds.data.mix import Source
from bert_ds.recipe import Recipe, load_recipe
from bert_ds.runtime.preflight import plan_run
from bert_ds.runtime.pretrain import parse_args
from tests.helpers.run_state import fake_run_state
from tests.helpers.runs import SMALL_RECIPE, write_recipe


def _plan(tmp_path: Path, data: str, tokenizer: Path, *extra: str):
    path = write_recipe(tmp_path / "recipe.json")
    args = parse_args(["--recipe", str(path), "--phase", "1", "--data", data, "--tokenizer", str(tokenizer),
                       "--output", str(tmp_path / "run"), *extra])
    return plan_run(args, Recipe.from_dict(json.loads(path.read_text())), rank=0, world_size=1)


def _spec(*pairs: tuple[Path, float]) -> str:
    return ",".join(f"{p}:{w:g}" for p, w in pairs)


def _copy(src: Path, dst: Path, **index_changes) -> Path:
    shutil.copytree(src, dst)
    index = json.loads((dst / "index.json").read_text())
    index.update(index_changes)
    (dst / "index.json").write_text(json.dumps(index))
    return dst


def test_the_plan_holds_each_phase_sources(mix_shards_128, tokenizer_dir, tmp_path):
    lic, std = mix_shards_128["licenses"], mix_shards_128["stdlib"]
    plan = _plan(tmp_path, _spec((lic, 1), (std, 3)), tokenizer_dir, "--eval-data", f"{lic},{std}")
    assert plan.data_sources == {0: [Source(str(lic), 1.0), Source(str(std), 3.0)]}
    assert plan.eval_sources == {0: [Source(str(lic)), Source(str(std))]}
    assert plan.data == {0: _spec((lic, 1), (std, 3))}  # the command line as given


@pytest.mark.parametrize("fault, pattern", [
    ("seq_len", r"--data .*/odd \(phases\[0\], source 'odd'\)/index.json: field 'seq_len' is 512"),
    ("vocab", r"--data .*/odd \(phases\[0\], source 'odd'\)/index.json: field 'vocab_sha256'"),
    ("casing", r"--data .*/odd/index.json \(phases\[0\], source 'odd'\): field 'lowercase' is False"),
    ("checksum", r"--data .*/odd \(phases\[0\], source 'odd'\): odd/shard-000000.tar: sha256 mismatch"),
])
def test_each_source_is_checked_and_the_faulty_one_named(mix_shards_128, tokenizer_dir, tmp_path, fault, pattern):
    good = mix_shards_128["stdlib"]
    changes = {"seq_len": {"seq_len": 512}, "vocab": {"vocab_sha256": "0" * 64}, "casing": {"lowercase": False},
               "checksum": {}}[fault]
    odd = _copy(mix_shards_128["licenses"], tmp_path / "odd", **changes)
    if fault == "checksum":
        shard = odd / "shard-000000.tar"
        data = bytearray(shard.read_bytes())
        data[700] ^= 1  # inside the first member's payload: only the checksum sees it
        shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=pattern):
        _plan(tmp_path, _spec((good, 1), (odd, 1)), tokenizer_dir, "--verify-shards", "sha256")


def _mixed_checkpoint(run: Path, sources: list[Source], steps: int, tokenizer: Path) -> None:
    """``latest`` and a mid-phase run_state.json whose loader state is a mix of ``sources`` after ``steps`` steps."""
    tag = f"phase1-step{steps:06d}"
    (run / "checkpoints" / tag).mkdir(parents=True)
    recipe = Recipe.from_dict(SMALL_RECIPE)
    p = recipe.phases[0]
    loader = build_loader(sources, global_batch_size=p.global_batch_size, micro_batch_size=p.micro_batch_size,
                          seed=recipe.seed, num_workers=0, max_predictions=p.max_predictions,
                          shuffle_window_shards=p.shuffle_window_shards, verify="size")
    for _ in zip(range(steps * loader.gradient_accumulation_steps), loader, strict=False):
        pass
    state = fake_run_state(tokenizer_dir=tokenizer, recipe=recipe.to_dict(), step=steps, loader=loader.state_dict())
    (run / "checkpoints" / tag / "run_state.json").write_text(json.dumps(state.to_dict()))
    (run / "checkpoints" / "latest").write_text(tag)


def test_a_resume_with_another_mix_is_refused_by_name_unless_asked(mix_shards_128, tokenizer_dir, tmp_path):
    lic, std = mix_shards_128["licenses"], mix_shards_128["stdlib"]
    _mixed_checkpoint(tmp_path / "run", [Source(str(lic), 1.0), Source(str(std), 3.0)], steps=2,
                      tokenizer=tokenizer_dir)
    assert _plan(tmp_path, _spec((lic, 1), (std, 3)), tokenizer_dir, "--resume", "auto").start.step == 2
    with pytest.raises(ValueError, match=r"source '.*stdlib128' weight 3.0 -> 1; pass --continue-with-new-mix"):
        _plan(tmp_path, _spec((lic, 1), (std, 1)), tokenizer_dir, "--resume", "auto")
    with pytest.raises(ValueError, match="field 'mix' lists"):
        _plan(tmp_path, str(std), tokenizer_dir, "--resume", "auto")
    plan = _plan(tmp_path, _spec((lic, 1), (std, 1)), tokenizer_dir, "--resume", "auto", "--continue-with-new-mix")
    assert plan.start.step == 2 and plan.args.continue_with_new_mix


# ---- the mix in the recipe (phases[0].data) -------------------------------------------------------------------------
def _recipe_plan(tmp_path: Path, data: list[dict], tokenizer: Path, *extra: str):
    """Pre-flight of phase 1 of ``SMALL_RECIPE`` with ``phases[0].data``, the recipe in ``tmp_path/recipes``."""
    recipe = json.loads(json.dumps(SMALL_RECIPE))
    recipe["phases"][0]["data"] = data
    path = tmp_path / "recipes" / "mix.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(recipe))
    args = parse_args(["--recipe", str(path), "--phase", "1", "--tokenizer", str(tokenizer),
                       "--output", str(tmp_path / "run"), *extra])
    return plan_run(args, load_recipe(path), rank=0, world_size=1)


def _relative(directory: Path, tmp_path: Path) -> str:
    return os.path.relpath(directory, tmp_path / "recipes")


def test_the_recipe_mix_is_planned_with_paths_from_the_recipe_directory(mix_shards_128, tokenizer_dir, tmp_path,
                                                                        caplog):
    lic, std = mix_shards_128["licenses"], mix_shards_128["stdlib"]
    (tmp_path / "recipes").mkdir()
    data = [{"path": _relative(lic, tmp_path), "weight": 1}, {"path": str(std), "weight": 3}]
    with caplog.at_level(logging.INFO, logger="bert_ds.runtime.preflight"):
        plan = _recipe_plan(tmp_path, data, tokenizer_dir)
    got = plan.data_sources[0]
    assert [(Path(s.path).resolve(), s.weight) for s in got] == [(lic.resolve(), 1.0), (std.resolve(), 3.0)]
    assert [s.name for s in got] == ["licenses128", "stdlib128"]
    assert "phase 1 trains on recipe" in caplog.text and "phases[0].data" in caplog.text


def test_the_command_line_replaces_the_recipe_mix_and_says_so(mix_shards_128, tokenizer_dir, tmp_path, caplog):
    lic, std = mix_shards_128["licenses"], mix_shards_128["stdlib"]
    with caplog.at_level(logging.WARNING, logger="bert_ds.runtime.preflight"):
        plan = _recipe_plan(tmp_path, [{"path": "no/such/dir", "weight": 1}, {"path": "nor/this", "weight": 1}],
                            tokenizer_dir, "--data", _spec((lic, 2), (std, 1)))
    assert plan.data_sources == {0: [Source(str(lic), 2.0), Source(str(std), 1.0)]}
    assert "--data replaces recipe" in caplog.text and "phases[0].data: the command line wins" in caplog.text


def test_recipe_data_refusals_name_the_file_and_field(mix_shards_128, tokenizer_dir, tmp_path):
    std = mix_shards_128["stdlib"]
    recipe = tmp_path / "recipes" / "mix.json"
    with pytest.raises(ValueError, match=rf"recipe {recipe}: phases\[0\]\.data\[1\]\.path '.*/recipes/gone' is not a "
                                         r"directory \(a relative path is read from the recipe file's directory\)"):
        _recipe_plan(tmp_path, [{"path": str(std), "weight": 1}, {"path": "gone", "weight": 1}], tokenizer_dir)
    _copy(mix_shards_128["licenses"], tmp_path / "odd", seq_len=512)
    with pytest.raises(ValueError, match=rf"recipe {recipe} phases\[0\]\.data .*/odd \(phases\[0\], source 'odd'\)"
                                         r"/index.json: field 'seq_len' is 512"):
        _recipe_plan(tmp_path, [{"path": str(std), "weight": 1}, {"path": "../odd", "weight": 1}], tokenizer_dir)
    plain = write_recipe(tmp_path / "plain.json")
    args = parse_args(["--recipe", str(plain), "--phase", "1", "--tokenizer", str(tokenizer_dir),
                       "--output", str(tmp_path / "run")])
    with pytest.raises(ValueError, match=rf"--data is not given and recipe {plain} has no phases\[0\]\.data"):
        plan_run(args, load_recipe(plain), rank=0, world_size=1)


def test_a_resume_with_another_recipe_mix_is_refused_by_name_unless_asked(mix_shards_128, tokenizer_dir, tmp_path):
    """A checkpoint of the command-line mix resumes from the same mix in the recipe, also with a source moved to
    another directory (the shard sets are matched by content); a recipe whose weights changed is refused like the
    command line's, and goes on with --continue-with-new-mix."""
    lic, std = mix_shards_128["licenses"], mix_shards_128["stdlib"]
    _mixed_checkpoint(tmp_path / "run", [Source(str(lic), 1.0), Source(str(std), 3.0)], steps=2,
                      tokenizer=tokenizer_dir)
    moved = shutil.copytree(lic, tmp_path / "moved" / "licenses128")
    same = [{"path": "../moved/licenses128", "weight": 1}, {"path": str(std), "weight": 3}]
    plan = _recipe_plan(tmp_path, same, tokenizer_dir, "--resume", "auto")
    assert plan.start.step == 2 and Path(plan.data_sources[0][0].path).resolve() == moved.resolve()
    other = [{"path": str(lic), "weight": 1}, {"path": str(std), "weight": 1}]
    with pytest.raises(ValueError, match=r"source '.*stdlib128' weight 3.0 -> 1; pass --continue-with-new-mix"):
        _recipe_plan(tmp_path, other, tokenizer_dir, "--resume", "auto")
    assert _recipe_plan(tmp_path, other, tokenizer_dir, "--resume", "auto", "--continue-with-new-mix").start.step == 2
