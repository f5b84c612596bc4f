"""``bert-ds-plot-run`` (``bert_ds.devtools.plot_run``, also ``tools/plot_run.py``) on the event files of a real
two-phase run (one process, real English shards, held-out English eval data)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.devtools.plot_run import plot_run
from tests.helpers import HANG_GUARD_S
from tests.helpers.runs import REPO, run_pretrain, write_recipe

SCRIPT = Path(sys.executable).parent / "bert-ds-plot-run"
TOOL = REPO / "tools" / "plot_run.py"

pytestmark = pytest.mark.e2e  # a fixture trains on real ranks


@pytest.fixture(scope="module")
def short_run(shards_128, shards_512, tokenizer_dir, english_corpus, tmp_path_factory) -> Path:
    """SMALL_RECIPE (4 + 2 steps, a point per step) with held-out eval at each phase end: the corpus's last
    documents (~40k characters) at seq 128 and 512, a few dozen samples each (the curves need a point per phase end,
    not the thousands of samples of the training sets)."""
    from bert_ds.data.create import create_shards
    from tests.helpers.eval_shards import write_corpus_tail

    tmp = tmp_path_factory.mktemp("plot_run")
    heldout = write_corpus_tail(english_corpus, tmp / "heldout.txt", 40_000)
    held_out = [tmp / f"eval{seq}" for seq in (128, 512)]
    for seq, out in zip((128, 512), held_out, strict=True):
        create_shards([heldout], tokenizer_dir, out, seq_len=seq, seed=4321, progress=False)
    recipe = write_recipe(tmp / "recipe.json")
    run = tmp / "run"
    run_pretrain(["--recipe", str(recipe), "--data", str(shards_128), str(shards_512), "--tokenizer",
                  str(tokenizer_dir), "--eval-data", *map(str, held_out), "--output", str(run)])
    return run


def test_plot_run_draws_every_logged_curve_and_marks_both_phases(short_run, tmp_path):
    result = plot_run(short_run, tmp_path / "curves.png")
    assert result.path == tmp_path / "curves.png"
    data = result.path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 40_000, len(data)  # six panels of curves, not a blank

    import matplotlib.image

    height, width, _ = matplotlib.image.imread(result.path).shape
    assert (width, height) == (1650, 935)  # 15 x 8.5 inches at 110 dpi
    expected = {"train/loss", "train/mlm_loss", "train/nsp_loss", "train/mlm_accuracy", "train/nsp_accuracy",
                "train/lr", "train/grad_norm", "perf/tokens_per_s", "eval/mlm_loss", "eval/mlm_accuracy",
                "eval/nsp_accuracy"}
    assert set(result.tags) == expected and result.missing == []
    # Phase 1 is steps 1-4; phase 2 begins after step 4, its first point is step 5.
    assert result.phases == [(0, "phase 1: seq 128"), (4, "phase 2: seq 512")]


def test_plot_run_cli_default_output_and_missing_events(short_run, tmp_path):
    done = subprocess.run([str(SCRIPT), str(short_run)], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    assert (short_run / "curves.png").stat().st_size > 40_000
    assert done.stdout.startswith(f"wrote {short_run / 'curves.png'}: 11 curves")

    empty = subprocess.run([sys.executable, str(TOOL), str(tmp_path)], capture_output=True, text=True,
                           timeout=HANG_GUARD_S)
    assert empty.returncode == 2
    # One line naming the directory, under the console script's name whichever way it is started.
    assert empty.stderr.startswith(f"bert-ds-plot-run: error: {tmp_path}: no TensorBoard event files"), empty.stderr
    assert empty.stderr.count("\n") == 1
