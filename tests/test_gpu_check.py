"""tools/gpu_check.py: its dry mode (no GPU) as CI runs it, and the JIT-vs-AOT comparison it makes on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.devtools.gpu_check import jit_matches_aot, record_jit_compiles
from tests.helpers import HANG_GUARD_S, child_env

ROOT = Path(__file__).resolve().parents[1]
OPS = ("layer_norm", "bias_gelu", "attention", "varlen_attention")


@pytest.mark.slow  # ~30 s on 2 CPU cores, ~45 s with a cold triton cache (interpreter, tiny steps, 24 AOT builds)
def test_dry_mode_runs_what_it_can_and_skips_the_gpu_items(tmp_path):
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(out)],
                            capture_output=True, text=True, timeout=HANG_GUARD_S, env=child_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "dry (no GPU)" and report["failed"] == []
    skipped = {s["name"]: s["reason"] for s in report["skipped"]}
    gpu_items = ({f"kernels.{op}.{d}" for op in OPS for d in ("fp32", "bf16")} | {f"speed.{op}" for op in OPS}
                 | {"train.large.s128", "train.large.s512", "aot.matches_jit"})
    assert set(skipped) == gpu_items
    assert all("no CUDA device" in reason for reason in skipped.values())
    ran = {f"interpreter.kernels.{op}.{d}" for op in OPS for d in ("fp32", "bf16")} | {"interpreter.train.tiny",
                                                                                       "aot.sass"}
    assert set(report["passed"]) == ran
    items = {i["name"]: i for i in report["items"]}
    tiny = items["interpreter.train.tiny"]["details"]
    assert tiny["losses_agree (rtol 1e-3)"] and tiny["loss_falls"]
    assert tiny["triton"]["seq_per_s"] > 0 and tiny["torch"]["model_tflop_per_seq"] > 0
    assert all(not row["problems"] for row in items["aot.sass"]["details"].values())
    for name in skipped:
        assert f"SKIPPED {name}" in result.stdout
    assert "15 skipped" in result.stdout


def test_jit_compiles_are_compared_with_the_aot_builds():
    # On a GPU, gpu_check installs triton's jit_post_compile_hook during the BERT-large steps. Here the hook is fed
    # by triton's own JITFunction._call_hook with the specialisations the AOT report builds, and with one it does not.
    from triton import knobs
    from triton.compiler import make_backend

    from bert_ds.kernels import aot

    target = aot.TARGETS[1]
    builds = aot.kernel_builds([target], aot.bert_shapes()[-1:], entries=aot.ENTRIES[:1])  # LayerNorm, large-s512
    odd = builds[0].with_changes(not_divisible=["N"])  # what the JIT would compile for a hidden size like 1000

    def compile_seen(build):
        fn = build.spec.kernel.compiled()
        options = make_backend(target).parse_options(dict(build.spec.options))
        fn._call_hook(knobs.runtime.jit_post_compile_hook, ("key", tuple(build.spec.signature.values())),
                      build.spec.signature, target, 0, build.spec.constexprs, options, [build.spec.attrs], False)

    with record_jit_compiles() as seen:
        for build in builds:
            compile_seen(build)
    assert knobs.runtime.jit_post_compile_hook is None  # restored
    ok, details = jit_matches_aot(seen, target)
    assert ok, details
    assert len(details["matched_aot_builds"]) == len(builds) == 4

    with record_jit_compiles() as seen:
        compile_seen(odd)
    ok, details = jit_matches_aot(seen, target)
    assert not ok and len(details["not_built_ahead_of_time"]) == 1
    assert details["not_built_ahead_of_time"][0]["kernel"] == odd.kernel
