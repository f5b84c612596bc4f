"""Issue 16 item 5: the non-finite guard never checkpoints what it guards against, and its advice works as printed.

Real ranks (2, gloo, DeepSpeed) on the shipped ``tiny_cpu.json`` cut short (dropout 0.1): phase 1 lr 1e3, a checkpoint
every step and ``keep_last_k`` 1, the setting where the NaN steps used to be saved and prune every good tag.
"""
from __future__ import annotations

import re

import pytest
import torch

from bert_ds import checkpoint as ckpt
from bert_ds.evaluate import load_checkpoint_model
from tests.helpers.faults import Launch, execute, fault_recipe
from tests.helpers.ranks import rank_command, spawn_ranks

pytestmark = pytest.mark.e2e

ERROR = re.compile(r"^bert_ds\.runtime\.pretrain: error: (non-finite .*)$", re.M)


def test_nonfinite_guard_keeps_a_finite_tag_and_its_advice_resumes(shards_128, shards_512, tokenizer_dir, tmp_path):
    run = tmp_path / "run"
    recipe = fault_recipe(tmp_path / "recipe.json", **{"phases.0.lr": 1e3, "phases.0.checkpoint_interval": 1,
                                                        "logging.keep_last_k": 1})
    args = ["--recipe", str(recipe), "--data", str(shards_128), str(shards_512), "--tokenizer", str(tokenizer_dir),
            "--output", str(run)]
    out = execute(Launch(rank_command(2, args)))
    assert out.returncode == 3 and not out.survivors, out.text()[-4000:]
    lines = ERROR.findall(out.text())
    assert lines, out.text()[-4000:]
    message = lines[0]
    good = re.search(r"last good checkpoint: (phase1-step\d{6}) in ", message)
    assert good, message
    tag = good.group(1)
    ckpt_dir = run / "checkpoints"
    assert ckpt.read_latest(ckpt_dir) == tag  # no later (non-finite) step was saved, keep_last_k did not prune it
    model, _ = load_checkpoint_model(ckpt_dir, tag, kernels="torch")
    assert all(torch.isfinite(p).all() for p in model.state_dict().values())
    ids = torch.randint(5, 4000, (2, 16))
    with torch.no_grad():
        mlm, nsp = model.eval().logits(ids, torch.zeros_like(ids), torch.ones_like(ids))
    assert torch.isfinite(mlm).all() and torch.isfinite(nsp).all()

    # The advice as printed: lower phases[0].lr, resume with --resume auto (a warning, not a refusal).
    assert re.search(r"Lower phases\[0\]\.lr .*resume with --resume auto", message), message
    fault_recipe(recipe, **{"phases.0.checkpoint_interval": 1, "logging.keep_last_k": 1})  # the shipped lr
    done = spawn_ranks(2, [*args, "--resume", "auto"], check=True)  # the resume itself: ranks spawned directly
    assert f"resuming {tag} with phases[0].lr=" in done.stdout + done.stderr, done.stderr[-4000:]
    assert ckpt.read_latest(ckpt_dir) == "phase2-step000002"
    final = ckpt.consolidated_state_dict(ckpt_dir, "phase2-step000002")
    assert all(torch.isfinite(t).all() for t in final.values())
