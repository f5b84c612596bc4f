"""The machine code of the kernels the runtime launches, read from sm_80/sm_90 cubins built ahead of time.

``bert-ds-kernel-report --controls --json`` builds every kernel as the JIT specialises it for BERT-base and
BERT-large launches (bert_ds.kernels.aot) and counts SASS opcodes with triton's bundled ``cuobjdump -sass``:

- attention kernels: tensor-core products, HMMA on sm_80, HGMMA or HMMA on sm_90;
- LayerNorm and bias-GELU, forward and backward (memory-bound: their speed is their access width): the bf16 rows
  move as 128-bit ``LDG.E.128`` / ``STG.E.128`` (cuobjdump spells it the same on sm_80 and sm_90); the only 16-bit
  loads allowed are of 1-D vectors whose block gives a thread one element (bias-GELU backward's bias);
- no kernel spills: STACK = LOCAL = 0 and no LDL/STL;
- every attention kernel is also built with attention dropout (``DROPOUT=True``, the paper's p = 0.1): tensor cores
  kept, no spill, and the Philox rounds in the code (``IMAD.HI.U32``, its multiply-high: 113-441 per dropout build
  against at most 2 without, sm_80 and sm_90, measured 2026-11 with triton 3.9).

Each check can fail, and the controls show it on every run (sm_80, measured 2026-11 with triton 3.9):

- the AOT builds before issue 10 did not mark ``N`` 16-divisible as the JIT does for 768/1024/3072/4096, so the
  compiler could not prove the row masks 8-aligned and loaded bf16 one element at a time: LayerNorm forward
  32 ``LDG.E.U16`` + 8 ``STG.E.U16`` and no 128-bit access (now 4 ``LDG.E.128``, 1 ``STG.E.128``); LayerNorm backward
  32 ``LDG.E.U16`` (now 4 ``LDG.E.128``); bias-GELU forward 34 ``LDG.E.U16`` + 32 ``STG.E.U16`` (now 4 + 4 128-bit);
  bias-GELU backward 65 ``LDG.E.U16`` + 32 ``STG.E.U16`` (now 8 ``LDG.E.128`` + 1 16-bit bias load, 4 ``STG.E.128``);
- the attention forward on fp32 inputs (IEEE products) has no HMMA (and spills: STACK 6952);
- the attention forward at BLOCK_M=128, BLOCK_N=64 spills (STACK 8, LDL/STL in the code);
- the attention dK/dV kernel with dropout at the no-dropout block size 32 x 64 spills on sm_80 (255 registers,
  STACK 8); the shipped dropout block is 32 x 32 (121 registers).
"""

from __future__ import annotations

import pytest

from tests.helpers.kernels import kernel_report

# What the shipped recipes launch (bert_ds.devtools.recipe_launches): training and evaluation attend through the
# varlen kernels; the padded forward serves the trainer's 32-token finite-logits probe under explicit "triton".
ATTENTION = ("_attn_fwd_kernel", "_varlen_fwd_kernel", "_varlen_bwd_dkdv_kernel", "_varlen_bwd_dq_kernel")
VARLEN = ATTENTION[1:]
MEMORY_BOUND = ("_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel", "_bias_gelu_fwd_kernel", "_bias_gelu_bwd_kernel")

# The report tests share one `bert-ds-kernel-report --controls --json` run per session with
# tests/kernels/test_kernel_report.py (tests.helpers.kernels.kernel_report).
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def sass_report(tmp_path_factory) -> dict:
    return kernel_report(tmp_path_factory)


def _builds(report: dict, kernels: tuple[str, ...]) -> list[dict]:
    rows = [r for r in report["builds"] if r["kernel"] in kernels]
    assert {(r["kernel"], r["arch"]) for r in rows} == {(k, a) for k in kernels for a in (80, 90)}
    return rows


def _ops(row: dict, prefix: str) -> int:
    return sum(n for op, n in row["ops"].items() if op.split(".")[0] == prefix)


@slow
def test_builds_cover_bert_base_and_large_and_pass_every_check(sass_report):
    assert sass_report["returncode"] == 0, sass_report["output"]
    for row in sass_report["builds"]:
        assert row["problems"] == [], row
    covered = {s for r in sass_report["builds"] for s in r["shapes"]}
    assert covered == {"base-s128", "base-s512", "large-s128", "large-s512", "base-s32", "large-s32"}
    for arch in (80, 90):  # every build parameter in the label: no two builds of a kernel share one
        labels = [(r["kernel"], r["config"]) for r in sass_report["builds"] if r["arch"] == arch]
        assert len(labels) == len(set(labels))


@slow
def test_attention_products_use_tensor_cores(sass_report):
    for row in _builds(sass_report, ATTENTION):
        if row["arch"] == 80:
            assert _ops(row, "HMMA") > 0, row["ops"]
        else:
            assert _ops(row, "HGMMA") + _ops(row, "HMMA") > 0, row["ops"]


@slow
def test_memory_bound_kernels_move_bf16_rows_128_bits_at_a_time(sass_report):
    for row in _builds(sass_report, MEMORY_BOUND):
        ops = row["ops"]
        assert ops.get("LDG.E.128", 0) >= 1 and ops.get("STG.E.128", 0) >= 1, (row["kernel"], row["arch"], ops)
        assert ops.get("STG.E.U16", 0) == 0, (row["kernel"], row["arch"], ops)
        narrow = 1 if row["kernel"] == "_bias_gelu_bwd_kernel" else 0  # its bias: 128 columns over 128 threads
        assert ops.get("LDG.E.U16", 0) <= narrow, (row["kernel"], row["arch"], ops)
        # Every row input (X, and R / DY where read) has its own 128-bit load: 8 bf16 per thread per row.
        rows_read = 1 + ("HAS_RESIDUAL=True" in row["config"]) + ("bwd" in row["kernel"])
        assert ops["LDG.E.128"] >= rows_read, (row["kernel"], row["config"], ops)


@slow
def test_no_kernel_spills(sass_report):
    for row in sass_report["builds"]:
        assert row["stack"] == 0 and row["local"] == 0, row
        assert _ops(row, "LDL") == 0 and _ops(row, "STL") == 0, row["ops"]


def _dropout(row: dict) -> bool:
    return "DROPOUT=True" in row["config"]


@slow
def test_dropout_builds_keep_tensor_cores_without_spills_and_run_philox(sass_report):
    rows = _builds(sass_report, VARLEN)
    with_dropout = [r for r in rows if _dropout(r)]
    assert {(r["kernel"], r["arch"]) for r in with_dropout} == {(k, a) for k in VARLEN for a in (80, 90)}
    assert {s for r in with_dropout for s in r["shapes"]} == {"base-s128", "base-s512", "large-s128", "large-s512"}
    for row in with_dropout:
        assert row["problems"] == [], row
        assert row["stack"] == 0 and row["local"] == 0 and _ops(row, "LDL") + _ops(row, "STL") == 0, row
        assert _ops(row, "HMMA") + _ops(row, "HGMMA") > 0, row["ops"]
        plain = [r for r in rows if r["kernel"] == row["kernel"] and r["arch"] == row["arch"] and not _dropout(r)]
        most_without = max(r["ops"].get("IMAD.HI.U32", 0) for r in plain)
        assert row["ops"].get("IMAD.HI.U32", 0) >= 50 > most_without, (row["kernel"], row["arch"], most_without)


@slow
def test_each_check_rejects_its_control(sass_report):
    controls = {(c["name"], c["arch"]): c for c in sass_report["controls"]}
    for arch in (80, 90):  # every control is valid on the architecture it is built for
        mine = {name: c for (name, a), c in controls.items() if a == arch}
        assert all(c["problems"] for c in mine.values()), mine
        old = [c for name, c in mine.items() if "N not 16-divisible" in name]
        assert {c["kernel"] for c in old} == set(MEMORY_BOUND)
        for c in old:  # the pre-issue-10 AOT signature: bf16 one element at a time, no 128-bit access at all
            assert c["ops"].get("LDG.E.128", 0) == 0 and c["ops"]["LDG.E.U16"] >= 32, c["ops"]
            assert any("128-bit" in p for p in c["problems"]), c["problems"]
        fp32 = mine["_attn_fwd_kernel, fp32 inputs (IEEE products)"]
        assert _ops(fp32, "HMMA") + _ops(fp32, "HGMMA") == 0 and fp32["stack"] > 0
        assert any("tensor-core" in p for p in fp32["problems"]), fp32["problems"]
        spilling = [c for name, c in mine.items() if "BLOCK_M=" in name]
        assert {c["kernel"] for c in spilling} == {"_attn_fwd_kernel", "_attn_bwd_dkdv_kernel"}
        for c in spilling:
            assert c["stack"] > 0 and _ops(c, "LDL") + _ops(c, "STL") > 0, c
            assert any("spills" in p for p in c["problems"]), c["problems"]


def test_aot_builds_take_the_jit_specialisation_of_real_launches():
    # No compiler needed: record the LayerNorm and bias-GELU wrappers' launches and specialise them as the JIT would.
    import torch

    from bert_ds.kernels import jit
    from bert_ds.kernels.aot import TARGETS
    from bert_ds.kernels.bias_gelu import bias_gelu_triton
    from bert_ds.kernels.layer_norm import layer_norm_triton

    def specialised(hidden: int, rows: int) -> dict:
        x = torch.empty(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(hidden, dtype=torch.bfloat16, requires_grad=True)
        with jit.record_launches() as launches:
            assert not jit.interpreter_enabled()  # launch code takes its compiled-mode path
            layer_norm_triton(x, w, w, 1e-12).backward(torch.empty_like(x))
            bias_gelu_triton(x, w).backward(torch.empty_like(x))
        assert [la.kernel.__name__ for la in launches] == ["_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel",
                                                           "_bias_gelu_fwd_kernel", "_bias_gelu_bwd_kernel"]
        out = {}
        for launch in launches:
            spec = jit.specialize(launch, TARGETS[0])
            out[launch.kernel.__name__] = ({spec.arg_name(p) for p, a in spec.attrs.items()
                                            if ["tt.divisibility", 16] in a},
                                           {spec.arg_name(p): v for p, v in spec.constexprs.items()})
        return out

    bert = specialised(768, 39)
    for kernel, (divisible, _) in bert.items():
        assert {"N", "X"} <= divisible, kernel  # hidden 768: the JIT proves 16-divisibility, so 128-bit access
        assert "M" not in divisible, kernel  # rows are not specialised (do_not_specialize)
    assert "N" not in specialised(100, 39)["_layer_norm_fwd_kernel"][0]  # hidden 100: no proof, 16-bit access
    one_row = specialised(768, 1)
    assert "M" not in one_row["_bias_gelu_fwd_kernel"][1]  # M = 1 is not folded into a constant either
    assert one_row["_layer_norm_fwd_kernel"] == bert["_layer_norm_fwd_kernel"]
