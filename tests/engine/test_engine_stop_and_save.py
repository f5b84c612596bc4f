"""Where a run stops and what it saves, through the real CLI on one CPU rank: the ``--max-steps`` cap on a re-run,
pre-emption on a phase's last step, a tag directory written again, a frozen NSP head, recipe-driven dynamic masking."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from bert_ds.checkpoint import CheckpointError, resolve_tag
from bert_ds.config import BertConfig
from bert_ds.recipe import load_recipe
from bert_ds.runtime.pretrain import EXIT_PREEMPTED
from tests.helpers.runs import SMALL_RECIPE, run_pretrain, run_until_signalled, weights, write_recipe

pytestmark = pytest.mark.e2e


def _tags(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir() and p.name.startswith("phase"))


def test_rerun_after_max_steps_trains_nothing(synthetic_data, tmp_path):
    run = tmp_path / "run"
    cmd = ["--recipe", str(write_recipe(tmp_path / "r.json")), "--data", *map(str, synthetic_data),
           "--output", str(run), "--resume", "auto", "--max-steps", "2"]
    run_pretrain(cmd)
    assert _tags(run) == ["phase1-step000002"]
    saved = (run / "checkpoints" / "phase1-step000002" / "mp_rank_00_model_states.pt").stat().st_mtime_ns
    proc = run_pretrain(cmd)
    assert "nothing to do" in proc.stdout and "step 3 " not in proc.stdout
    assert _tags(run) == ["phase1-step000002"] and (run / "checkpoints" / "latest").read_text() == "phase1-step000002"
    assert (run / "checkpoints" / "phase1-step000002" / "mp_rank_00_model_states.pt").stat().st_mtime_ns == saved


def test_stale_files_in_a_reused_tag_dir_are_replaced(synthetic_data, tmp_path):
    """A crash after a 2-rank save began leaves ``phase1-step000004`` with a second rank's ZeRO partition; the
    1-rank resume that saves that step again must leave exactly its own files, so consolidation works."""
    run = tmp_path / "run"
    base = ["--recipe", str(write_recipe(tmp_path / "r.json")), "--data", *map(str, synthetic_data),
            "--output", str(run), "--phase", "1"]
    run_pretrain(base + ["--max-steps", "2"])
    ckpt = run / "checkpoints"
    stale = ckpt / "phase1-step000004"
    stale.mkdir()
    for f in (ckpt / "phase1-step000002").glob("zero_pp_rank_0_*"):
        shutil.copyfile(f, stale / f.name.replace("rank_0_", "rank_1_"))
    # The exporter refuses the incomplete tag by name rather than failing inside DeepSpeed.
    shutil.copyfile(ckpt / "phase1-step000002" / "mp_rank_00_model_states.pt", stale / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="phase1-step000004: no run_state.json, so this checkpoint is incomplete"):
        resolve_tag(ckpt, "phase1-step000004")

    run_pretrain(base + ["--resume", "auto"])
    assert (ckpt / "latest").read_text() == "phase1-step000004"
    assert [f.name for f in stale.glob("zero_pp_rank_*")] == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert all(torch.isfinite(t).all() for t in weights(run, "phase1-step000004").values())
    assert not any(p.name.endswith((".tmp", ".old")) for p in ckpt.iterdir())


def test_nsp_false_leaves_pooler_and_nsp_head_untouched(synthetic_data, tmp_path):
    """Without NSP the pooler and NSP head get no gradient; under ZeRO-2 DeepSpeed would hand LAMB zeros for them
    and weight decay alone (trust ratio 1 / wd) would shrink them by (1 - lr) per step. They are frozen instead."""
    from bert_ds.runtime.engine import build_model

    recipe_path = write_recipe(tmp_path / "r.json", nsp=False)
    run = tmp_path / "run"
    run_pretrain(["--recipe", str(recipe_path), "--data", *map(str, synthetic_data), "--output", str(run),
                  "--max-steps", "3"])
    got = weights(run, "phase1-step000003")
    init = build_model(load_recipe(recipe_path), BertConfig.load(run / "checkpoints" / "model_config.json"))
    for name, value in init.state_dict().items():
        if name.startswith(("bert.pooler.", "cls.seq_relationship.")):
            assert torch.equal(got[name], value), name
    trained = "bert.encoder.layer.0.attention.output.dense.weight"
    assert not torch.equal(got[trained], init.state_dict()[trained])


def test_dynamic_masking_rate_and_shuffle_window_come_from_the_recipe(synthetic_data, tmp_path):
    phases = json.loads(json.dumps(SMALL_RECIPE["phases"]))
    phases[0].update(dynamic_masking=True, masked_lm_prob=0.3, max_predictions=40, shuffle_window_shards=2)
    run = tmp_path / "run"
    run_pretrain(["--recipe", str(write_recipe(tmp_path / "r.json", phases=phases)), "--data",
                  *map(str, synthetic_data), "--output", str(run), "--max-steps", "2"])
    loader = json.loads((run / "checkpoints" / "phase1-step000002" / "run_state.json").read_text())["loader"]
    assert loader["shuffle_window_shards"] == 2 and loader["consumed_global_batches"] == 2
    assert loader["dynamic_masking"]["masked_lm_prob"] == 0.3
    assert loader["dynamic_masking"]["mask_id"] == 4  # from the tokenizer, not Google's 103


def test_signal_during_a_phase_last_step_stops_the_run(synthetic_data, tmp_path):
    """Both phases are 2 and 1 steps long, so the signal sent after step 1 reaches the loop on some phase's last
    step: the run checkpoints that phase's end and exits pre-empted instead of going on."""
    phases = json.loads(json.dumps(SMALL_RECIPE["phases"]))
    phases[0]["steps"], phases[1]["steps"] = 2, 1
    run = tmp_path / "run"
    code, lines = run_until_signalled(write_recipe(tmp_path / "r.json", phases=phases), synthetic_data, run)
    assert code == EXIT_PREEMPTED, "".join(lines[-40:])
    tag = (run / "checkpoints" / "latest").read_text()
    assert tag in ("phase1-step000002", "phase2-step000001")
    assert json.loads((run / "checkpoints" / tag / "run_state.json").read_text())["phase_done"] is True
