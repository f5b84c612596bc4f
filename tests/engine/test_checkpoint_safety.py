"""Checkpoint files are loaded with ``weights_only=True`` everywhere: a pickle planted in a real checkpoint is refused
by resume, ``tools/evaluate.py`` and ``tools/convert_checkpoint.py`` (exit 2, one line naming the file) and its code
never runs; every type real DeepSpeed checkpoints hold is on the allow-list."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bert_ds import checkpoint as ckpt
from tests.helpers import HANG_GUARD_S
from tests.helpers.checkpoint_damage import rerecord_checksum
from tests.helpers.runs import REPO, run_pretrain


class _Payload:
    """Unpickling this runs ``touch MARKER``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _tiny_cpu(path: Path, zero_stage: int) -> Path:
    """The shipped tiny_cpu recipe (dropout on) at ``zero_stage``."""
    recipe = json.loads((REPO / "ds_configs" / "tiny_cpu.json").read_text())
    recipe["deepspeed"]["zero_stage"] = zero_stage
    path.write_text(json.dumps(recipe))
    return path


@pytest.fixture(scope="module")
def trained(synthetic_data, tmp_path_factory) -> dict[int, Path]:
    """Run directories holding one step of the shipped tiny_cpu recipe at ZeRO 0, 1 and 2 (one CPU rank)."""
    root = tmp_path_factory.mktemp("trained")
    runs = {}
    for stage in (0, 1, 2):
        runs[stage] = root / f"z{stage}"
        run_pretrain(["--recipe", str(_tiny_cpu(root / f"z{stage}.json", stage)), "--data", *map(str, synthetic_data),
                      "--output", str(runs[stage]), "--max-steps", "1"])
    return runs


@pytest.mark.e2e  # the trained fixture runs real ranks
def test_every_type_in_real_checkpoints_is_allow_listed(trained):
    for run in trained.values():
        tag_dir = run / "checkpoints" / "phase1-step000001"
        files = sorted(tag_dir.glob("*.pt"))
        assert any(f.name.startswith("rng_rank") for f in files)
        for f in files:
            assert set(torch.serialization.get_unsafe_globals_in_checkpoint(f)) <= set(ckpt.ALLOWED_GLOBALS), f
            ckpt.load_tensor_file(f)
        assert ckpt.consolidated_state_dict(run / "checkpoints", "phase1-step000001")


def _plant(run: Path, name: str, marker: Path) -> Path:
    target = run / "checkpoints" / "phase1-step000001" / name
    state = torch.load(target, weights_only=False)  # our own, trusted file
    state["extra"] = _Payload(marker)
    torch.save(state, target)
    rerecord_checksum(target)  # past the checksums, to the unpickling defence
    return target


def _tool(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / script), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=HANG_GUARD_S, env={**os.environ, "PYTHONPATH": str(REPO)})


_CASES = [("mp_rank_00_model_states.pt", "resume"), ("mp_rank_00_model_states.pt", "evaluate"),
          ("mp_rank_00_model_states.pt", "convert"), ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "resume"),
          ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "evaluate"),
          ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "convert"), ("rng_rank00000.pt", "resume")]


@pytest.mark.e2e
@pytest.mark.parametrize(("planted", "reader"), _CASES, ids=[f"{p.split('_')[0]}-{r}" for p, r in _CASES])
def test_planted_pickle_is_refused_and_never_runs(trained, synthetic_data, tmp_path, planted, reader):
    run = tmp_path / "run"
    shutil.copytree(trained[2], run)
    marker = tmp_path / "PWNED"
    target = _plant(run, planted, marker)
    if reader == "resume":
        proc = run_pretrain(["--recipe", str(_tiny_cpu(tmp_path / "r.json", 2)), "--data", *map(str, synthetic_data),
                             "--output", str(run), "--resume", "auto", "--max-steps", "2"], check=False)
    elif reader == "evaluate":
        proc = _tool("evaluate.py", "--checkpoint", str(run / "checkpoints"), "--data", str(synthetic_data[0]),
                     "--max-batches", "1")
    else:
        proc = _tool("convert_checkpoint.py", "--checkpoint", str(run / "checkpoints"), "--out", str(tmp_path / "hf"))
    refusals = [ln for ln in proc.stderr.splitlines() if "refused" in ln]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert len(refusals) == 1 and str(target) in refusals[0] and "posix.system" in refusals[0], proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    assert not marker.exists()
    assert not (tmp_path / "hf").exists() and not (run / "checkpoints" / "phase1-step000002").exists()


def test_deepspeeds_own_weights_only_false_loads_are_forced_safe(tmp_path):
    """DeepSpeed 0.19 calls torch.load(weights_only=False) in its checkpoint engine and zero_to_fp32; inside
    deepspeed_loads_weights_only that is refused too, even for a file the pre-check did not see."""
    marker = tmp_path / "PWNED"
    torch.save({"x": _Payload(marker)}, tmp_path / "late.pt")
    (tmp_path / "tag").mkdir()
    with pytest.raises(ckpt.UnsafeCheckpointError, match="posix.system"):
        with ckpt.deepspeed_loads_weights_only(tmp_path / "tag"):
            torch.load(tmp_path / "late.pt", weights_only=False)
    assert not marker.exists()
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # restored afterwards
