"""What a real training run reports: TensorBoard scalars and console lines, periodic held-out evaluation, the early
stop at ``target_mlm_accuracy`` (and resuming after it), and ``tools/evaluate.py`` agreeing with the in-run evaluation.

One CPU rank (``python -m bert_ds.runtime.pretrain``), the tiny model of ``ds_configs/tiny_cpu.json`` with small
batches, on the real English shards of ``tests/conftest.py``. The eval set is a shard set of its own (another seed
over the corpus's last documents): evaluation must read ``--eval-data``, not the training batches.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bert_ds.data.index import ShardIndex
from bert_ds.optim import warmup_poly_decay
from tests.helpers import HANG_GUARD_S
from tests.helpers.runs import REPO, run_pretrain, tensorboard_scalars, write_recipe

pytestmark = pytest.mark.e2e

TINY_CPU = json.loads((REPO / "ds_configs" / "tiny_cpu.json").read_text())
GLOBAL_BATCH = 4
# Every scalar MetricsLogger writes on a CPU fp32 run: perf/mfu needs a peak (none on CPU), train/loss_scale fp16.
TRAIN_TAGS = ("train/loss", "train/mlm_loss", "train/nsp_loss", "train/mlm_accuracy", "train/nsp_accuracy",
              "train/lr", "train/grad_norm", "perf/sequences_per_s", "perf/tokens_per_s", "perf/tflops",
              "progress/consumed_samples", "progress/phase")
STOP, STOP_TAG = 4, "phase1-step000004"  # where the early-stop run's first evaluation ends phase 1
EVAL_TAGS = ("eval/mlm_accuracy", "eval/nsp_accuracy", "eval/mlm_loss", "eval/nsp_loss", "eval/samples",
             "eval/masked_tokens")


def _recipe(path: Path, **phase1) -> Path:
    """tiny_cpu with logging every 2 steps, phase 1 of 8 steps at global batch 4 (2 micro-batches of 2, warm-up over
    the first 4 steps, eval every 4) and a 1-step phase 2 with a target accuracy (but never eval data here);
    ``phase1`` overrides phase-1 fields."""
    phases = json.loads(json.dumps(TINY_CPU["phases"]))
    phases[0].update({"steps": 8, "global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2, "warmup_fraction": 0.5,
                      "checkpoint_interval": 0, "eval_interval": 4, **phase1})
    phases[1].update(steps=1, global_batch_size=2, micro_batch_size=2, checkpoint_interval=0, eval_interval=0,
                     target_mlm_accuracy=0.99)
    return write_recipe(path, base=TINY_CPU, phases=phases, logging={"interval": 2})


def _console_steps(stdout: str, phase: int) -> list[int]:
    return [int(s) for s in re.findall(rf"^step (\d+) \| phase {phase} \| loss ", stdout, re.M)]


def _tags(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob("phase*-step*"))


@pytest.fixture(scope="module")
def eval_shards(english_corpus, tokenizer_dir, tmp_path_factory) -> Path:
    """A held-out seq-128 shard set: the corpus's last documents (~60k characters) paired and masked with another
    seed than ``shards_128``; about a hundred samples, so an evaluation takes well under a second."""
    from bert_ds.data.create import create_shards
    from tests.helpers.eval_shards import write_corpus_tail

    root = tmp_path_factory.mktemp("eval_128")
    heldout = write_corpus_tail(english_corpus, root / "heldout.txt", 60_000)
    out = root / "shards"
    create_shards([heldout], tokenizer_dir, out, seq_len=128, seed=4321, samples_per_shard=64, progress=False)
    return out


@pytest.fixture(scope="module")
def early_stop_run(shards_128, eval_shards, tokenizer_dir, tmp_path_factory) -> tuple[Path, Path, str]:
    """Phase 1 of 20 steps with target_mlm_accuracy 1e-6 and eval every 4 steps: the first evaluation (step 4, at
    the end of a 4-step warm-up, a few percent accuracy: ~100 masked tokens right) ends it. Returns (run dir, recipe,
    stdout)."""
    root = tmp_path_factory.mktemp("early_stop")
    recipe = _recipe(root / "recipe.json", steps=20, warmup_fraction=0.2, eval_interval=STOP,
                     target_mlm_accuracy=1e-6)
    run = root / "run"
    proc = run_pretrain(["--recipe", str(recipe), "--data", str(shards_128), "--eval-data", str(eval_shards),
                         "--tokenizer", str(tokenizer_dir), "--phase", "1", "--output", str(run)])
    return run, recipe, proc.stdout


def test_tensorboard_console_and_periodic_eval(shards_128, eval_shards, tokenizer_dir, tmp_path):
    recipe = _recipe(tmp_path / "recipe.json")
    run = tmp_path / "run"
    proc = run_pretrain(["--recipe", str(recipe), "--data", str(shards_128), "--eval-data", str(eval_shards),
                         "--tokenizer", str(tokenizer_dir), "--phase", "1", "--output", str(run)])
    scalars = tensorboard_scalars(run / "tensorboard")
    logged = [2, 4, 6, 8]  # logging.interval 2 over 8 steps

    for tag in TRAIN_TAGS:
        assert tag in scalars, f"{tag} missing; written: {sorted(scalars)}"
        assert sorted(scalars[tag]) == logged, f"{tag} at steps {sorted(scalars[tag])}"
        assert all(math.isfinite(v) for v in scalars[tag].values()), f"{tag}: {scalars[tag]}"
    assert "train/loss_scale" not in scalars  # fp32
    if torch.cuda.is_available():  # a known GPU has a peak for the recipe's fp32
        assert all(0 < v < 1 for v in scalars.get("perf/mfu", {}).values())
    else:
        assert "perf/mfu" not in scalars  # no CPU peak, and the recipe gives none
    assert scalars["progress/consumed_samples"] == {s: float(s * GLOBAL_BATCH) for s in logged}
    assert set(scalars["progress/phase"].values()) == {1.0}

    # The lr of each point is the last step's: linear warm-up over steps 1..4, then decay to 0 at step 8.
    peak_lr, factor = TINY_CPU["phases"][0]["lr"], warmup_poly_decay(8, 0.5, TINY_CPU["phases"][0]["decay_power"])
    for s in logged:
        assert scalars["train/lr"][s] == pytest.approx(peak_lr * factor(s - 1), rel=1e-6, abs=1e-12), s
    assert scalars["train/lr"][2] == pytest.approx(peak_lr / 2, rel=1e-6) and scalars["train/lr"][8] == 0.0

    for s in logged:  # the interval means are consistent with each other
        assert scalars["train/loss"][s] == pytest.approx(scalars["train/mlm_loss"][s] + scalars["train/nsp_loss"][s],
                                                         rel=1e-5)
        assert scalars["perf/tokens_per_s"][s] == pytest.approx(128 * scalars["perf/sequences_per_s"][s], rel=1e-5)
        assert 0.0 <= scalars["train/mlm_accuracy"][s] <= 1.0 and 0.0 <= scalars["train/nsp_accuracy"][s] <= 1.0
        assert scalars["train/grad_norm"][s] > 0 and scalars["perf/tflops"][s] > 0

    # Periodic evaluation (eval_interval 4, and at the end) over the whole held-out set.
    eval_samples = ShardIndex.load(eval_shards).total_samples
    for tag in EVAL_TAGS:
        assert tag in scalars, f"{tag} missing; written: {sorted(scalars)}"
        assert sorted(scalars[tag]) == [4, 8], f"{tag} at steps {sorted(scalars[tag])}"
        assert all(math.isfinite(v) for v in scalars[tag].values()), f"{tag}: {scalars[tag]}"
    assert set(scalars["eval/samples"].values()) == {float(eval_samples)}
    for s in (4, 8):
        assert 0.0 < scalars["eval/mlm_accuracy"][s] < 1.0 and 0.0 < scalars["eval/nsp_accuracy"][s] < 1.0

    # Console: one training line per logging interval, one eval line per evaluation, agreeing with TensorBoard.
    assert _console_steps(proc.stdout, 1) == logged, proc.stdout[-3000:]
    evals = re.findall(r"^eval step (\d+) \| mlm_accuracy ([0-9.]+) \|", proc.stdout, re.M)
    assert [int(s) for s, _ in evals] == [4, 8], proc.stdout[-3000:]
    for s, acc in evals:
        assert float(acc) == pytest.approx(scalars["eval/mlm_accuracy"][int(s)], abs=5.1e-5)
    assert _tags(run) == ["phase1-step000008"]

    # The rank started without the garbage collector and froze its start-up heap at the first step (startup_gc):
    # torch, DeepSpeed, dynamo and inductor are ~460,000 objects here; a collector never paused logs nothing.
    frozen = re.findall(r"start-up ran without the garbage collector; (\d+) objects frozen at the first step",
                        proc.stderr)
    assert len(frozen) == 1 and int(frozen[0]) > 100_000, proc.stderr[-3000:]


def test_early_stop_ends_the_phase_with_a_checkpoint(early_stop_run):
    run, _, stdout = early_stop_run
    message = re.search(rf"^phase 1: eval mlm_accuracy ([0-9.]+) >= target 1e-06 at step {STOP}; ending the phase$",
                        stdout, re.M)
    assert message, stdout[-3000:]
    assert float(message.group(1)) > 0
    assert _console_steps(stdout, 1) == [2, STOP]  # no training after the stop
    assert (run / "checkpoints" / "latest").read_text() == STOP_TAG
    assert _tags(run) == [STOP_TAG]
    state = json.loads((run / "checkpoints" / STOP_TAG / "run_state.json").read_text())
    assert (state["phase"], state["step"], state["phase_done"]) == (0, STOP, True)
    assert state["consumed_samples"] == STOP * GLOBAL_BATCH
    scalars = tensorboard_scalars(run / "tensorboard")
    assert sorted(scalars["eval/mlm_accuracy"]) == [STOP] and sorted(scalars["train/loss"]) == [2, STOP]


def test_offline_eval_matches_the_in_run_eval(early_stop_run, eval_shards):
    """The early stop evaluated and then checkpointed the same weights at step 4: tools/evaluate.py on that checkpoint
    and the same shards must give the number TensorBoard holds (same kernels and batch size as the run)."""
    run, _, _ = early_stop_run
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "evaluate.py"), "--checkpoint",
                           str(run / "checkpoints"), "--data", str(eval_shards), "--batch-size", "2",
                           "--kernels", "torch"], cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    offline = json.loads(lines[0])
    in_run = tensorboard_scalars(run / "tensorboard")
    assert offline["tag"] == STOP_TAG
    assert offline["samples"] == in_run["eval/samples"][STOP]
    assert offline["masked_tokens"] == in_run["eval/masked_tokens"][STOP]
    # TensorBoard stores float32: 1e-6 is far above its rounding and far below one masked token (1 / masked_tokens).
    for name in ("mlm_accuracy", "nsp_accuracy"):
        assert offline[name] == pytest.approx(in_run[f"eval/{name}"][STOP], abs=1e-6), name
    for name in ("mlm_loss", "nsp_loss"):
        assert offline[name] == pytest.approx(in_run[f"eval/{name}"][STOP], rel=1e-5), name


def test_resume_after_early_stop_does_not_retrain_phase_1(early_stop_run, shards_128, shards_512, tokenizer_dir,
                                                          tmp_path):
    """The early-stopped checkpoint is a finished phase: ``--phase 1`` has nothing left to do, and ``--phase all``
    hands off from it to phase 2 (step 0, new schedule) without another phase-1 step. Phase 2 has a target but no
    eval data here: the run says it cannot stop early."""
    src, recipe, _ = early_stop_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    base = ["--recipe", str(recipe), "--tokenizer", str(tokenizer_dir), "--output", str(run), "--resume", "auto"]

    proc = run_pretrain(base + ["--data", str(shards_128), "--phase", "1"])
    assert f"nothing to do: {STOP_TAG} already finished the selected phase(s)" in proc.stdout, proc.stdout
    assert _tags(run) == [STOP_TAG]

    proc = run_pretrain(base + ["--data", str(shards_128), str(shards_512), "--phase", "all"])
    assert f"phase 2 starts from {STOP_TAG}" in proc.stderr, proc.stderr[-3000:]
    assert "phases[1].target_mlm_accuracy=0.99 is ignored without --eval-data" in proc.stderr
    assert "phases[0].target_mlm_accuracy" not in proc.stderr  # phase 1 is not trained again
    assert _console_steps(proc.stdout, 1) == [] and _console_steps(proc.stdout, 2) != []
    assert (run / "checkpoints" / "latest").read_text() == "phase2-step000001"
    assert _tags(run) == [STOP_TAG, "phase2-step000001"]
    state = json.loads((run / "checkpoints" / "phase2-step000001" / "run_state.json").read_text())
    assert (state["phase"], state["step"], state["phase_done"]) == (1, 1, True)
