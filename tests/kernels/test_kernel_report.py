"""tools/kernel_report.py: AOT-compile every shipped kernel for sm_80/sm_90 and find no spills."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.kernels.aot import kernel_builds
from tests.helpers import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~25 s cold on 2 CPU cores (14 ptxas runs); seconds once triton's cache is warm
def test_kernel_report_compiles_everything_without_spills():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}  # AOT needs no interpreter
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_report.py")], capture_output=True,
                            text=True, timeout=HANG_GUARD_S, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    assert len(rows) == 2 * len(kernel_builds())
    assert {r[2] for r in rows} == {"sm_80", "sm_90"}
    for r in rows:
        assert int(r[3]) > 0 and r[4] == "0" and r[5] == "0", r  # REG, STACK, LOCAL
