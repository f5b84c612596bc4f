"""Golden numbers: the per-step loss and gradient norm of one fixed tiny run, kept in a file, so that a change to any
numeric path (model, kernels, masking, loader order, LAMB, clipping, ZeRO binding, schedule) fails here even when every
other test still passes (torchtitan keeps such curves in ``tests/assets/losses/``).

The run is ``reference_run``: ``SMALL_RECIPE`` (tiny BERT, dropout 0, LAMB, ZeRO-2, clipping 1.0, both phases) on 2
CPU ranks over fixed synthetic shards. fp32 on CPU is reproducible run to run; across CPUs (vector widths) the last
bits of reductions may differ, hence the tolerance, which is still far below any real change (a different seed, lr or
clip moves the first steps by more than 1e-2). Measured margin: the same run with ``ATEN_CPU_CAPABILITY=avx2`` against
``avx512`` (other vector widths, so other reduction orders) deviates from the file by at most 2.0e-7 relative, and
1.0e-7 on the default path: RTOL sits 250x above. After an intended numeric change, regenerate the file with
``BERT_DS_UPDATE_GOLDEN=1 pytest tests/engine/test_golden_loss.py`` and say why in the commit message.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.helpers.runs import tensorboard_scalars

pytestmark = pytest.mark.e2e

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "losses" / "small_recipe_zero2_2ranks.json"
RTOL = 5e-5
TAGS = ("train/loss", "train/mlm_loss", "train/grad_norm", "train/lr")


def test_reference_run_matches_golden_curve(reference_run):
    scalars = tensorboard_scalars(reference_run / "tensorboard")
    got = {tag: {str(step): value for step, value in sorted(scalars[tag].items())} for tag in TAGS}
    if os.environ.get("BERT_DS_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert got.keys() == want.keys()
    for tag in TAGS:
        assert got[tag].keys() == want[tag].keys(), f"{tag}: logged steps {list(got[tag])} != {list(want[tag])}"
        for step, value in want[tag].items():
            assert math.isclose(got[tag][step], value, rel_tol=RTOL), (
                f"{tag} at step {step}: {got[tag][step]!r} != golden {value!r} (rtol {RTOL}); see {GOLDEN}")
