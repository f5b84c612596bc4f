"""Setting TRITON_INTERPRET after triton's import must fail with a clear message, not deep in a kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, torch, triton
os.environ["TRITON_INTERPRET"] = "1"
from bert_ds.kernels import bias_gelu
try:
    bias_gelu(torch.randn(2, 8), torch.randn(8), backend="triton")
except RuntimeError as e:
    print("RAISED:", e)
"""


def test_interpreter_enabled_after_triton_import_raises_clearly():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            timeout=HANG_GUARD_S, env=env)
    assert "RAISED:" in result.stdout and "before the first `import triton`" in result.stdout, result.stderr
