"""The demo end to end: ``--phase all`` on tiny_cpu, 2 CPU ranks, ZeRO-2, real shards; then the HF export."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.helpers import HANG_GUARD_S
from tests.helpers.runs import REPO, run_pretrain

pytestmark = pytest.mark.e2e


def _losses(stdout: str, phase: int) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(rf"^step \d+ \| phase {phase} \| loss ([0-9.]+)", stdout, re.M)]


def test_tiny_cpu_phase_all_two_ranks_then_export(shards_128, shards_512, tokenizer_dir, tmp_path):
    run = tmp_path / "run"
    proc = run_pretrain(["--recipe", str(REPO / "ds_configs" / "tiny_cpu.json"), "--data", str(shards_128),
                         str(shards_512), "--tokenizer", str(tokenizer_dir), "--output", str(run)],
                        nprocs=2, timeout=HANG_GUARD_S)
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text() == "phase2-step000020"
    state = json.loads((ckpt / "phase2-step000020" / "run_state.json").read_text())
    assert state["phase"] == 1 and state["phase_done"] and state["world_size"] == 2 and state["zero_stage"] == 2
    assert (ckpt / "model_config.json").is_file() and (ckpt / "tokenizer" / "vocab.txt").is_file()
    assert (run / "recipe.json").is_file() and any((run / "tensorboard").iterdir())

    first = _losses(proc.stdout, 1)
    second = _losses(proc.stdout, 2)
    assert len(first) == 12 and len(second) == 4  # logging.interval 5: steps 5..60, 65..80
    print(f"tiny_cpu loss: phase 1 {first[0]:.3f} -> {first[-1]:.3f}, phase 2 {second[0]:.3f} -> {second[-1]:.3f}")
    assert second[-1] < first[0] - 1.5, "loss did not fall well below its start"

    out = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "--checkpoint", str(ckpt),
                          "--out", str(tmp_path / "hf")], cwd=REPO, capture_output=True, text=True,
                         timeout=HANG_GUARD_S, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verified against bert_ds" in out.stdout

    # Continued pre-training from the export: phase 2 of a new run starts from the HF weights.
    again = tmp_path / "from_hf"
    run_pretrain(["--recipe", str(REPO / "ds_configs" / "tiny_cpu.json"), "--data", str(shards_512), "--phase", "2",
                  "--tokenizer", str(tokenizer_dir), "--init-from-hf", str(tmp_path / "hf"), "--output", str(again),
                  "--max-steps", "61"])
    assert (again / "checkpoints" / "latest").read_text() == "phase2-step000001"
    assert (again / "checkpoints" / "model_config.json").read_text() == (ckpt / "model_config.json").read_text()
