"""tools/gpu_check.py: its dry mode (no GPU) as CI runs it, and the JIT-vs-AOT comparison it makes on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.devtools.gpu_check import gpu_checks, jit_matches_aot, record_jit_compiles
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
    assert set(skipped) == set(gpu_checks())
    assert all("no CUDA device" in reason for reason in skipped.values())
    items = {i["name"]: i for i in report["items"]}
    assert all(items[name]["details"]["rule"] == rule for name, rule in gpu_checks().items())
    ran = ({f"interpreter.kernels.{op}.{d}" for op in OPS for d in ("fp32", "bf16")} | {"interpreter.train.tiny",
           "aot.sass"} | {f"interpreter.dropout.{k}.p{p}" for k in ("padded", "varlen") for p in (0.1, 0.5)})
    assert set(report["passed"]) == ran
    tiny = items["interpreter.train.tiny"]["details"]
    assert tiny["golden"]["triton_gaps"] and tiny["loss_falls"]
    assert tiny["triton"]["seq_per_s"] > 0 and tiny["torch"]["model_tflop_per_seq"] > 0
    assert all(not row["problems"] for row in items["aot.sass"]["details"].values() if isinstance(row, dict))
    for name in skipped:
        assert f"SKIPPED {name}" in result.stdout
    assert f"{len(gpu_checks())} skipped" in result.stdout


@pytest.mark.slow  # ~90 s on 2 CPU cores: the AOT build list comes from running every shipped recipe's model
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


# --- every pass rule fails on a planted fault (TRITON_INTERPRET=1 in this process: tests/conftest.py) -------------

def test_philox_reference_matches_random123_known_answers():
    from bert_ds.devtools.gpu_rules import philox4x32_10

    # Random123 kat_vectors, philox4x32_10: counter, key -> output.
    vectors = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
               ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
               ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
                (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in vectors:
        assert tuple(int(x) for x in philox4x32_10(*counter, *key)) == want


def test_dropout_check_passes_on_the_kernels_and_fails_on_a_wrong_mask():
    import torch

    from bert_ds.devtools.gpu_check import check_dropout_masks
    from bert_ds.devtools.gpu_rules import reference_keep_mask

    items = check_dropout_masks(torch.device("cpu"), small=True)
    assert [i.status for i in items] == ["passed"] * 4, [(i.name, i.reason) for i in items]
    assert all(i.details["bits"]["differing"] == 0 for i in items)

    def one_bit_off(seed, p, *shape):
        mask = reference_keep_mask(seed, p, *shape)
        mask[0, 0, 3, 5] = ~mask[0, 0, 3, 5]
        return mask

    items = check_dropout_masks(torch.device("cpu"), small=True, reference=one_bit_off)
    assert [i.status for i in items] == ["failed"] * 4
    assert all("1 of" in i.reason and "differ" in i.reason for i in items)


def test_keep_rate_rule_rejects_a_mask_drawn_at_another_rate():
    import torch

    from bert_ds.devtools.gpu_rules import keep_rate_rule, reference_keep_mask

    ok, _ = keep_rate_rule(reference_keep_mask((5, 7), 0.1, 2, 4, 128), 0.1)
    assert ok
    ok, details = keep_rate_rule(reference_keep_mask((5, 7), 0.12, 2, 4, 128), 0.1)  # p off by 0.02
    assert not ok and "outside" in details["reason"]
    assert not keep_rate_rule(torch.ones(1000, dtype=torch.bool), 0.1)[0]  # no dropout at all


def test_kernel_check_fails_when_the_twin_is_off_by_a_scale(monkeypatch):
    import torch

    import bert_ds.kernels as kernels
    from bert_ds.devtools.gpu_check import check_kernels

    ok = check_kernels(torch.device("cpu"), small=True, ops=("bias_gelu",))
    assert [i.status for i in ok] == ["passed", "passed"], [i.reason for i in ok]
    twin = kernels._BIAS_GELU["torch"]
    monkeypatch.setitem(kernels._BIAS_GELU, "torch", lambda x, b: twin(x, b) * 1.01)  # 1%: 1.3 bf16 eps
    bad = check_kernels(torch.device("cpu"), small=True, ops=("bias_gelu",))
    assert bad[0].status == "failed"  # fp32 catches 1%; bf16's rule is 10 eps normwise, so plant 10% there
    monkeypatch.setitem(kernels._BIAS_GELU, "torch", lambda x, b: twin(x, b) * 1.1)
    assert [i.status for i in check_kernels(torch.device("cpu"), small=True, ops=("bias_gelu",))] == ["failed"] * 2


@pytest.mark.slow  # ~20 s: two interpreted tiny training runs and two torch ones
def test_golden_run_fails_when_a_triton_kernel_is_off(monkeypatch):
    import bert_ds.kernels as kernels
    from bert_ds.devtools.gpu_check import _tiny_training_check

    ok, details = _tiny_training_check()
    assert ok, details
    kernel = kernels._LAYER_NORM["triton"]
    monkeypatch.setitem(kernels._LAYER_NORM, "triton", lambda *a: kernel(*a) * 1.02)
    ok, details = _tiny_training_check()
    assert not ok and "leaves the bound" in details["reason"], details


def test_golden_and_speed_rules_fail_on_planted_values():
    from bert_ds.devtools.gpu_check import _auto_is_faster
    from bert_ds.devtools.gpu_rules import golden_rule, speed_rule

    ref = [10.0, 9.5, 9.0]
    twins = [10.001, 9.502, 9.001]  # the twins' own rounding: 2e-3
    assert golden_rule([10.002, 9.503, 9.0], twins, ref)[0]
    ok, details = golden_rule([10.002, 9.52, 9.0], twins, ref)  # step 1 off by 0.02 > 2 * 2e-3 + 1e-3
    assert not ok and "[1]" in details["reason"]
    assert speed_rule(0.95, 0.95, "x")[0] and not speed_rule(0.94, 0.95, "x")[0]
    # auto picks Triton for varlen attention: a Triton slower than 0.9x its twin fails; for LayerNorm auto picks
    # torch: a Triton LayerNorm faster than 1/0.9 of the twin fails (auto would be leaving speed behind).
    row = {"triton": {}, "torch": {}, "speedup_fwd": 1.0}
    assert _auto_is_faster("varlen_attention", {"c": {**row, "speedup_fwd_bwd": 1.7}})[0]
    assert not _auto_is_faster("varlen_attention", {"c": {**row, "speedup_fwd_bwd": 0.8}})[0]
    assert _auto_is_faster("layer_norm", {"c": {**row, "speedup_fwd_bwd": 0.4}})[0]
    assert not _auto_is_faster("layer_norm", {"c": {**row, "speedup_fwd_bwd": 1.5}})[0]


def test_dry_mode_lists_every_gpu_check_with_its_rule():
    from bert_ds.devtools.gpu_check import gpu_checks
    from bert_ds.devtools.gpu_rules import RULES

    checks = gpu_checks()
    assert set(checks.values()) == set(RULES.values()) - {RULES["aot.sass"]}  # aot.sass runs in dry mode too
    assert {"golden.base.s128", "dropout.varlen.p0.1", "kernels.attention.bf16", "train.large.s512"} <= set(checks)
    assert "kernels.attention.fp32" not in checks  # refused on CUDA: fp32 attention is SDPA there
    assert "kernels.layer_norm.fp32" in checks
