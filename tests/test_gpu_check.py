"""tools/gpu_check.py: its dry mode (no GPU) as CI runs it, and the JIT-vs-AOT comparison it makes on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
           "aot.sass", "golden_resume.tiny", "profile.tiny"}
           | {f"interpreter.dropout.{k}.p{p}" for k in ("padded", "varlen") for p in (0.1, 0.5)})
    assert set(report["passed"]) == ran
    resume = items["golden_resume.tiny"]["details"]
    assert resume["bit_for_bit"] and resume["rule"] == gpu_checks()["golden_resume.base.s128"]
    profile = items["profile.tiny"]["details"]
    assert profile["rule"] == gpu_checks()["profile.large.s128"] and profile["kernels_per_step"] > 0
    assert "    gemm " in result.stdout and "    idle " in result.stdout  # the profile table is printed
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
    assert bad[0].status == "failed"  # fp32 catches 1%; in bf16 1% is 1.3 eps, below its resolution
    monkeypatch.setitem(kernels._BIAS_GELU, "torch", lambda x, b: twin(x, b) * 1.05)  # 5%: 6.4 bf16 eps
    assert [i.status for i in check_kernels(torch.device("cpu"), small=True, ops=("bias_gelu",))] == ["failed"] * 2


@pytest.mark.parametrize("gain, passes", [(1.0, True), (1.02, False), (1.05, False), (0.95, False)])
def test_bf16_twin_rule_passes_correct_rounding_and_fails_a_systematic_error(gain, passes):
    """The bf16 bound sits at 2x the error correct kernels measure: bf16 rounding of an fp32 result (what a correct
    kernel adds, at most half an eps per element) passes; a 2% or 5% gain error fails, normwise."""
    from bert_ds.devtools.gpu_rules import BF16_NORM_EPS, twin_rule

    ref = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
    got = (ref * gain).to(torch.bfloat16)
    ok, details = twin_rule(got, ref, torch.bfloat16)
    assert ok is passes, details
    norm = details["error_in_eps"][0]
    assert (norm <= 0.5) if passes else (norm > BF16_NORM_EPS), details


@pytest.mark.slow  # ~10 s: an interpreted tiny training run and a torch one
def test_golden_run_fails_when_a_triton_kernel_is_off(monkeypatch):
    """The same check with the kernels as shipped passes: interpreter.train.tiny in the dry-mode test above."""
    import bert_ds.kernels as kernels
    from bert_ds.devtools.gpu_check import _tiny_training_check

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
    assert {"golden.base.s128", "dropout.varlen.p0.1", "kernels.attention.bf16", "train.large.s512", "mfu.large.s128",
            "mfu.large.s512", "profile.large.s128", "profile.large.s512", "golden_resume.base.s128"} <= set(checks)
    assert "0.127" in checks["mfu.large.s128"] and "0.129" in checks["mfu.large.s512"]  # the floors, stated
    assert "kernels.attention.fp32" not in checks  # refused on CUDA: fp32 attention is SDPA there
    assert "kernels.layer_norm.fp32" in checks


def test_mfu_rule_fails_below_the_family_floor_and_reports_unknown_families():
    from bert_ds.devtools.gpu_rules import MFU_MEASURED, MFU_TARGET, gpu_family, mfu_floor, mfu_rule

    assert gpu_family("NVIDIA H100 80GB HBM3") == "H100 SXM" and gpu_family("NVIDIA H200") == "H200"
    assert gpu_family("NVIDIA GH200 480GB") == "GH200" and gpu_family("NVIDIA H100 PCIe") == "H100 PCIe"
    assert gpu_family("NVIDIA H200 NVL") == "H200 NVL" and mfu_floor("H200 NVL", 128)[0] is None  # 835 TFLOP/s
    # Today's H100 value passes; a planted 15% regression fails, on the H100 and on the H200 (which takes its floor).
    for seq, measured in ((128, MFU_MEASURED[("H100 SXM", 128)]), (512, MFU_MEASURED[("H100 SXM", 512)])):
        assert mfu_rule(measured, "H100 SXM", seq)[0]
        ok, details = mfu_rule(round(0.85 * measured, 4), "H100 SXM", seq)
        assert not ok and "below the H100 SXM floor" in details["reason"]
        assert not mfu_rule(round(0.85 * measured, 4), "H200", seq)[0]
    assert mfu_floor("H100 SXM", 128)[0] == 0.127 and mfu_floor("H100 SXM", 512)[0] == 0.129
    # No floor: reported, not judged; the target becomes the floor once a measurement reaches it.
    ok, details = mfu_rule(0.05, "A100", 128)
    assert ok and details["floor"] is None and "reported, not judged" in details["floor_is"]
    assert mfu_rule(0.05, None, 128)[0]
    assert not mfu_rule("unknown peak", "H100 SXM", 128)[0]
    import bert_ds.devtools.gpu_rules as rules

    reached = {**MFU_MEASURED, ("H100 SXM", 128): 0.45}
    original = rules.MFU_MEASURED
    try:
        rules.MFU_MEASURED = reached
        assert mfu_floor("H100 SXM", 128)[0] == MFU_TARGET
        assert not mfu_rule(0.39, "H100 SXM", 128)[0]
    finally:
        rules.MFU_MEASURED = original


def test_mfu_item_judges_the_train_item_of_the_same_run():
    from bert_ds.devtools.gpu_check import FAILED, Item, _mfu_check

    train = Item("train.large.s128", "passed", details={"auto": {"mfu": 0.10, "batch": 64}})
    ok, details = _mfu_check(train, "H100 SXM", 128)
    assert not ok and details["floor"] == 0.127
    assert _mfu_check(Item("train.large.s128", "passed", details={"auto": {"mfu": 0.15, "batch": 64}}),
                      "H100 SXM", 128)[0]
    ok, details = _mfu_check(Item("train.large.s128", FAILED, reason="OutOfMemoryError"), "H100 SXM", 128)
    assert not ok and "measured nothing" in details["reason"]


def test_loss_rule_fails_on_a_loss_that_does_not_fall_or_is_not_finite():
    from bert_ds.devtools.gpu_rules import loss_rule

    # The H100 run's auto losses at seq 128 (3 warm-up steps, the second above the first).
    h100 = [11.28683, 12.16425, 11.11745, 11.21598, 10.93766, 10.92449, 10.85525, 10.82322, 10.71817, 10.7191,
            10.65693, 10.6094, 10.58982]
    assert loss_rule(h100, 3)[0]
    ok, details = loss_rule(h100[:3] + h100[3:][::-1], 3)  # rising over the timed steps
    assert not ok and "did not fall" in details["reason"]
    ok, details = loss_rule(h100[:6] + [float("nan")] + h100[7:], 3)
    assert not ok and "non-finite loss at steps [6]" in details["reason"]
    assert not loss_rule([1.0, float("inf"), 0.5], 0)[0]  # a finite end does not excuse an overflow on the way
    assert not loss_rule(h100[:4], 3)[0]  # one timed step proves nothing


def test_train_item_fails_when_a_loss_does_not_fall_and_prints_every_baseline(monkeypatch, capsys):
    import bert_ds.devtools.gpu_check as gc

    def run(kernels, losses, seq_per_s):
        return {"kernels": kernels, "batch": 64, "seq": 128, "warmup": 3, "seq_per_s": seq_per_s, "tflops": 140.0,
                "mfu": 0.1412, "losses": losses}

    falling, flat = [11.3, 12.2, 11.1, 11.2, 10.9, 10.6], [11.3, 12.2, 11.1, 11.2, 11.2, 11.3]
    for auto_losses, passes in ((falling, True), (flat, False)):
        monkeypatch.setattr(gc, "measure_training", lambda *a, losses=auto_losses, **k: run(
            a[5], losses if a[5] == "auto" else falling, 600.0))
        monkeypatch.setattr(gc, "_transformers_training", lambda *a, **k: run("transformers (sdpa)", falling, 500.0))
        monkeypatch.setattr(gc.torch.cuda, "reset_peak_memory_stats", lambda device: None)
        monkeypatch.setattr(gc.torch.cuda, "empty_cache", lambda: None)
        ok, details = gc._train_on_gpu(gc.model_preset("tiny"), 128, 64, gc.torch.device("cpu"), 3, 989.0)
        assert ok is passes, details
        if not passes:
            assert details["reason"].startswith("auto: loss did not fall"), details["reason"]
            continue
        # The printed line names ours, the twins' and transformers' throughput (the verdict dicts do not break it).
        gc._print_item(gc.Item("train.large.s128", gc.PASSED, 1.0, details))
        line = capsys.readouterr().out
        assert "auto: 600.0 seq/s" in line and "transformers: 500.0 seq/s" in line and "MFU 0.1412" in line


def test_resume_rule_fails_on_one_differing_bit():
    import struct

    from bert_ds.devtools.gpu_rules import resume_rule

    run = {"losses": [10.5, 10.25, 10.125], "weight_sums": [1234.5, 1234.25, 1234.0], "weights_equal": True}
    assert resume_rule(run, dict(run))[0]
    one_bit = struct.unpack("<d", (struct.unpack("<Q", struct.pack("<d", 10.25))[0] ^ 1).to_bytes(8, "little"))[0]
    assert one_bit != 10.25 and abs(one_bit - 10.25) < 1e-14
    resumed = {**run, "losses": [10.5, one_bit, 10.125]}
    ok, details = resume_rule(run, resumed, rerun=dict(run))  # the rerun is deterministic: no room
    assert not ok and not details["bit_for_bit"]
    assert not resume_rule(run, {**run, "weights_equal": False}, rerun=dict(run))[0]  # final weights differ
    assert not resume_rule(run, resumed)[0]  # differing, and no rerun to measure noise
    # A non-deterministic kernel: the rerun differs by 1e-3, the resumed run within 2x that passes, beyond fails.
    noisy = {**run, "losses": [10.501, 10.25, 10.125], "weight_sums": [1234.5, 1234.26, 1234.0]}
    assert resume_rule(run, {**run, "losses": [10.5, 10.2515, 10.125], "weights_equal": False}, rerun=noisy)[0]
    ok, details = resume_rule(run, {**run, "losses": [10.5, 10.253, 10.125], "weights_equal": False}, rerun=noisy)
    assert not ok and "losses" in details["reason"]


def test_golden_resume_is_bit_exact_on_the_cpu_and_catches_a_forgotten_piece():
    import io

    from bert_ds.config import model_preset
    from bert_ds.devtools.golden_resume import golden_resume

    # gpu-check's dry mode runs the full item (20 steps, bf16); here 8 steps in fp32, saved after 4: the same code.
    config = model_preset("tiny", vocab_size=4000)
    cpu, fp32 = torch.device("cpu"), torch.float32
    threads = torch_threads(1)
    try:
        ok, details = golden_resume(config, 32, 4, cpu, fp32, "torch", steps=8, save_at=4)
        assert ok and details["bit_for_bit"] and "rerun" not in details, details
        assert details["resumed"]["losses"] == details["uninterrupted"]["losses"][4:]

        def without_optimizer_state(bench, snapshot):  # model and masters restored, LAMB moments and steps lost
            state = torch.load(io.BytesIO(snapshot), weights_only=True)
            bench.model.load_state_dict(state["model"])
            with torch.no_grad():
                for m, saved in zip(bench.masters, state["masters"], strict=True):
                    m.copy_(saved)

        ok, details = golden_resume(config, 32, 4, cpu, fp32, "torch", steps=8, save_at=4,
                                    restore=without_optimizer_state)
        assert not ok and details["rerun"]["weights_equal"] and "the rerun is bit for bit" in details["reason"]
    finally:
        torch_threads(threads)


def torch_threads(n: int) -> int:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


def _layer_norm_builds(target):
    from bert_ds.kernels import aot

    return aot.kernel_builds([target], aot.bert_shapes()[-1:], entries=aot.ENTRIES[:1])  # LayerNorm, large-s512


def test_a_jit_compile_without_any_aot_build_fails_naming_the_kernel(monkeypatch):
    """A kernel the JIT compiled during training but the AOT report has no build of is a gap the report never
    checked: it fails, named, even when every other compile matches."""
    import bert_ds.devtools.gpu_check as gpu_check
    from bert_ds.devtools.gpu_check import _spec_key
    from bert_ds.kernels import aot

    target = aot.TARGETS[1]
    builds = _layer_norm_builds(target)
    monkeypatch.setattr(gpu_check, "_aot_builds", lambda targets: builds)
    seen = [_spec_key(b.kernel, b.spec.signature, b.spec.constexprs, b.spec.attrs, b.spec.options["num_warps"],
                      b.spec.options["num_stages"]) for b in builds]
    ok, details = jit_matches_aot(seen, target)
    assert ok and details["kernels_without_aot_entry"] == [], details
    stray = ("_unlisted_softmax_fwd", (("X", "*bf16"),), "[]", "[]", 4, 3)
    ok, details = jit_matches_aot([*seen, stray], target)
    assert not ok and details["kernels_without_aot_entry"] == ["_unlisted_softmax_fwd"]
    assert "_unlisted_softmax_fwd" in details["reason"] and "no AOT build covers" in details["reason"]
    assert not jit_matches_aot([], target)[0]  # nothing compiled is not a pass either


def test_aot_sass_fails_on_an_empty_build_list(monkeypatch):
    import bert_ds.devtools.gpu_check as gpu_check

    monkeypatch.setattr(gpu_check, "_aot_builds", lambda targets: [])
    ok, details = gpu_check._aot_sass_check()
    assert not ok and "no AOT build to check" in details["reason"]
