"""Bad input through the real CLI: each fails before any compute (or, for non-finite losses, stops cleanly), exits
with a distinct code and names the field."""

from __future__ import annotations

import json

import pytest
import torch

from bert_ds.checkpoint import consolidated_state_dict
from bert_ds.data.synthetic import write_synthetic_shards
from bert_ds.runtime.pretrain import EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_PREEMPTED, preflight
from tests.helpers import HANG_GUARD_S
from tests.helpers.runs import SMALL_RECIPE, run_pretrain, run_until_signalled, write_recipe


def _fails(args, nprocs=1, code=EXIT_BAD_INPUT):
    proc = run_pretrain(args, nprocs=nprocs, check=False, timeout=HANG_GUARD_S)
    if nprocs == 1:
        assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:  # the launcher reports a failed rank with its own non-zero code
        assert proc.returncode != 0
    return proc.stdout + proc.stderr


def _refused(args: list[str], world_size: int = 1) -> str:
    """Pre-flight of ``bert_ds.runtime.pretrain`` in-process, as rank 0 of ``world_size`` (what ``main`` runs before
    any rank joins a process group): the refusal ``main`` would print and turn into exit 2. The CLI's mapping of this
    error to exit 2 on real ranks is tested by test_resume_with_different_recipe and the fault tables."""
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        preflight(args, rank=0, world_size=world_size)
    return str(info.value)


def test_recipe_typo(synthetic_data, tmp_path):
    bad = {**SMALL_RECIPE, "optimizer": {"name": "lamb", "weight_decya": 0.01}}
    recipe = write_recipe(tmp_path / "typo.json", base=bad)
    out = _refused(["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--tokenizer",
                    str(synthetic_data[0].parent / "tokenizer"), "--output", str(tmp_path / "run")])
    assert "optimizer.weight_decya" in out and "typo.json" in out
    assert not (tmp_path / "run").exists()


def test_batch_inconsistent_with_world_size(synthetic_data, tmp_path):
    phases = json.loads(json.dumps(SMALL_RECIPE["phases"]))
    phases[0].update(global_batch_size=2, micro_batch_size=2)  # fine on 1 rank, 2 x 2 ranks > 2 on two
    recipe = write_recipe(tmp_path / "r.json", phases=phases)
    args = ["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--tokenizer",
            str(synthetic_data[0].parent / "tokenizer"), "--output", str(tmp_path / "run")]
    preflight(args, rank=0, world_size=1)
    out = _refused(args, world_size=2)
    assert "phases[0].global_batch_size=2 is not divisible by phases[0].micro_batch_size=2 x world size 2" in out
    assert not (tmp_path / "run").exists()


def test_tokenizer_is_required(synthetic_data, tmp_path, capsys):
    """Without it, export would later miss tokenizer/vocab.txt and dynamic masking would guess [MASK]'s id."""
    with pytest.raises(SystemExit) as info:
        preflight(["--recipe", str(write_recipe(tmp_path / "r.json")), "--data", *map(str, synthetic_data),
                   "--output", str(tmp_path / "run")])
    assert info.value.code == EXIT_BAD_INPUT and "--tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_shards_with_wrong_seq_len(synthetic_data, tmp_path):
    s128, s512 = synthetic_data
    recipe = write_recipe(tmp_path / "r.json")
    out = _refused(["--recipe", str(recipe), "--data", str(s512), str(s128), "--tokenizer",
                    str(s128.parent / "tokenizer"), "--output", str(tmp_path / "run")])
    assert "field 'seq_len' is 512 but the run expects 128" in out and "phases[0]" in out


def test_shards_with_other_vocab(synthetic_data, tmp_path):
    other = tmp_path / "other512"
    write_synthetic_shards(other, num_samples=20, samples_per_shard=10, seq_len=512, max_predictions=80,
                           vocab_size=12000, seed=3, vocab_sha256="another-vocabulary", cls_id=2, sep_id=3,
                           mask_id=4)
    recipe = write_recipe(tmp_path / "r.json")
    out = _refused(["--recipe", str(recipe), "--data", str(synthetic_data[0]), str(other), "--tokenizer",
                    str(synthetic_data[0].parent / "tokenizer"), "--output", str(tmp_path / "run")])
    assert "field 'vocab_sha256'" in out and "phases[1]" in out


@pytest.mark.e2e
def test_resume_with_different_recipe(synthetic_data, tmp_path):
    run = tmp_path / "run"
    data = ["--data", *map(str, synthetic_data), "--output", str(run)]
    run_pretrain(["--recipe", str(write_recipe(tmp_path / "a.json")), *data, "--max-steps", "1"])
    phases = json.loads(json.dumps(SMALL_RECIPE["phases"]))
    phases[0]["warmup_fraction"] = 0.5  # changes the numbers (lr alone may change: the non-finite guard's advice)
    changed = write_recipe(tmp_path / "b.json", phases=phases, logging={"interval": 2})
    out = _fails(["--recipe", str(changed), *data, "--resume", "auto"])
    assert "phases[0].warmup_fraction" in out and "logging" not in out.split("field(s)")[1].split("differ")[0]
    out = _fails(["--recipe", str(write_recipe(tmp_path / "a.json")), *data])  # no --resume: refuses to overwrite
    assert "--resume auto" in out


@pytest.mark.e2e
@pytest.mark.parametrize("phase2_steps, interval", [(8, 1), (2, 0)], ids=["periodic-save", "phase-end"])
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(synthetic_data, tmp_path, phase2_steps, interval):
    """LAMB's trust ratio pinned at 1e20: phase 1 (lr 1e-25) moves the weights by ~1e-5, phase 2 (lr 1e20) makes
    them overflow float32 in its first update, while that step's loss (computed before the update) is still finite.
    Neither a periodic save nor the end of a 2-step phase (whose last loss is non-finite) may keep those weights or
    pass silently: the run stops with the non-finite exit and ``latest`` stays at phase 1's end, whose weights are
    finite."""
    phases = json.loads(json.dumps(SMALL_RECIPE["phases"]))
    phases[0].update(steps=1, warmup_fraction=0.0, lr=1e-25)
    phases[1].update(lr=1e20, steps=phase2_steps, checkpoint_interval=interval)
    recipe = write_recipe(tmp_path / "r.json", phases=phases, deepspeed={"zero_stage": 0},
                          optimizer={"name": "lamb", "trust_clamp": [1e20, 1e20]})
    run = tmp_path / "run"
    out = _fails(["--recipe", str(recipe), "--data", *map(str, synthetic_data), "--output", str(run)],
                 code=EXIT_NONFINITE)
    assert "non-finite" in out
    assert "logging.max_nonfinite_steps=2" in out
    latest = (run / "checkpoints" / "latest").read_text()
    assert latest == "phase1-step000001" and f"last good checkpoint: {latest}" in out
    assert sorted(p.name for p in (run / "checkpoints").glob("phase*")) == ["phase1-step000001"]
    ckpt = run / "checkpoints"
    state = consolidated_state_dict(ckpt, latest)
    assert all(torch.isfinite(t).all() for t in state.values())


@pytest.mark.e2e
def test_sigusr1_checkpoints_and_exits_with_preempted_code(synthetic_data, tmp_path):
    phases = json.loads(json.dumps(SMALL_RECIPE["phases"]))
    phases[0]["steps"] = 500
    run = tmp_path / "run"
    code, lines = run_until_signalled(write_recipe(tmp_path / "r.json", phases=phases), synthetic_data, run)
    assert code == EXIT_PREEMPTED, "".join(lines[-40:])
    tag = (run / "checkpoints" / "latest").read_text()
    state = json.loads((run / "checkpoints" / tag / "run_state.json").read_text())
    assert state["phase"] == 0 and 1 <= state["step"] < 500 and not state["phase_done"]
    assert any("pre-empted" in line for line in lines)
