"""Pre-flight of a phase that reads a weighted mix of real shard sets: the plan, each check naming the source at
fault, and a resume whose mix changed (refused by name; continued only when asked)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bert_ds.data.loader import build_loader
from bert_ds.data.mix import Source
from bert_ds.recipe import Recipe
from bert_ds.runtime.preflight import plan_run
from bert_ds.runtime.pretrain import parse_args
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


def _mixed_checkpoint(run: Path, sources: list[Source], steps: int) -> None:
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
    state = {"recipe": recipe.to_dict(), "phase": 0, "step": steps, "phase_done": False, "world_size": 1,
             "loader": loader.state_dict()}
    (run / "checkpoints" / tag / "run_state.json").write_text(json.dumps(state))
    (run / "checkpoints" / "latest").write_text(tag)


def test_a_resume_with_another_mix_is_refused_by_name_unless_asked(mix_shards_128, tokenizer_dir, tmp_path):
    lic, std = mix_shards_128["licenses"], mix_shards_128["stdlib"]
    _mixed_checkpoint(tmp_path / "run", [Source(str(lic), 1.0), Source(str(std), 3.0)], steps=2)
    assert _plan(tmp_path, _spec((lic, 1), (std, 3)), tokenizer_dir, "--resume", "auto").start.step == 2
    with pytest.raises(ValueError, match=r"source '.*stdlib128' weight 3.0 -> 1; pass --continue-with-new-mix"):
        _plan(tmp_path, _spec((lic, 1), (std, 1)), tokenizer_dir, "--resume", "auto")
    with pytest.raises(ValueError, match="field 'mix' lists"):
        _plan(tmp_path, str(std), tokenizer_dir, "--resume", "auto")
    plan = _plan(tmp_path, _spec((lic, 1), (std, 1)), tokenizer_dir, "--resume", "auto", "--continue-with-new-mix")
    assert plan.start.step == 2 and plan.args.continue_with_new_mix
