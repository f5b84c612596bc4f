"""``bert-ds-kernel-report`` (also ``tools/kernel_report.py``): AOT-compile every kernel build the runtime launches
for sm_80/sm_90; no check fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import HANG_GUARD_S, child_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~100 s cold on 2 busy CPU cores (80 compiles); seconds once triton's cache is warm
def test_kernel_report_compiles_everything_without_spills():
    # AOT compilation needs triton imported without the interpreter, hence a process of its own.
    result = subprocess.run([str(Path(sys.executable).parent / "bert-ds-kernel-report")], capture_output=True,
                            text=True, timeout=HANG_GUARD_S, env=child_env(TRITON_INTERPRET="0"), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    header, *rows = (line.split() for line in result.stdout.splitlines())
    assert header == ["kernel", "config", "arch", "REG", "STACK", "LOCAL", "SHARED", "LOADS", "STORES", "MMA",
                      "shapes"]
    assert {r[2] for r in rows} == {"sm_80", "sm_90"}
    assert sum(r[2] == "sm_80" for r in rows) == sum(r[2] == "sm_90" for r in rows)
    for r in rows:
        assert int(r[3]) > 0 and r[4] == "0" and r[5] == "0", r  # REG, STACK, LOCAL
    shapes = {}
    for r in rows:
        shapes.setdefault((r[0], r[2]), []).append(r[-1])
    for arch in ("sm_80", "sm_90"):
        # One LayerNorm / bias-GELU binary serves BERT-base and -large (N = 768 and 1024 are both 16-divisible)...
        for kernel in ("_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel"):  # with and without the residual
            assert shapes[kernel, arch] == ["base,large", "base,large"]
        for kernel in ("_bias_gelu_fwd_kernel", "_bias_gelu_bwd_kernel"):
            assert shapes[kernel, arch] == ["base,large"]
        # ... but each attention kernel compiles twice per dropout setting (DROPOUT is a constexpr): the JIT marks
        # BERT-large's 16 heads 16-divisible, not 12.
        for kernel in ("_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"):
            assert sorted(shapes[kernel, arch]) == ["base", "base", "large", "large"]
    dropout = {r[1].split("DROPOUT=")[1].split(",")[0] for r in rows if r[0].startswith(("_attn", "_varlen"))}
    assert dropout == {"False", "True"}


def test_kernel_report_refuses_an_interpreter_process():
    # In this process triton was imported with TRITON_INTERPRET=1 (tests/conftest.py): compiling must say why it
    # cannot, not fail inside the first kernel (or pass on a stale cache hit).
    from bert_ds.kernels import aot
    from bert_ds.kernels.jit import compiler_mode_problem

    if compiler_mode_problem() is None:
        pytest.skip("triton was imported without the interpreter in this process")
    build = aot.kernel_builds(aot.TARGETS[:1], aot.bert_shapes()[:1], entries=aot.ENTRIES[:1])[0]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        aot.compile_build(build)
