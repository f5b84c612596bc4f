"""``bert-ds-kernel-report`` (also ``tools/kernel_report.py``): AOT-compile every kernel build the runtime launches
for sm_80/sm_90; no check fails."""

from __future__ import annotations

import pytest

from tests.helpers.kernels import kernel_report


@pytest.mark.slow  # ~4 min cold on 2 busy CPU cores (the recipes' models, then 52 compiles); ~1 min warm
def test_kernel_report_covers_every_shipped_recipe_without_spills_and_with_tensor_cores(tmp_path_factory):
    # The session's one `bert-ds-kernel-report --controls --json` run, which tests/kernels/test_sass.py reads too.
    report = kernel_report(tmp_path_factory)
    assert report["returncode"] == 0, report["output"]
    lines = report["stdout"].splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("kernel ")):]  # after DeepSpeed's notice
    lines = lines[:next(i for i, line in enumerate(lines) if line.startswith("controls (known-bad"))]  # builds only
    assert lines[0].split() == ["kernel", "config", "arch", "REG", "STACK", "LOCAL", "SHARED", "LOADS", "STORES",
                                "MMA", "shapes"]
    rows = [line.split() for line in lines[1:] if line.startswith("_")]
    assert {r[2] for r in rows} == {"sm_80", "sm_90"}
    assert sum(r[2] == "sm_80" for r in rows) == sum(r[2] == "sm_90" for r in rows)
    for r in rows:
        assert int(r[3]) > 0 and r[4] == "0" and r[5] == "0", r  # REG, STACK, LOCAL
        if "attn" in r[0] or "varlen" in r[0]:
            assert int(r[9]) > 0, r  # MMA
    for arch in ("sm_80", "sm_90"):
        assert any(line.startswith(f"{arch}: ") and " 0 spill, 0 spill bytes" in line for line in lines), arch
    sites = {s.split("[")[0] for r in report["builds"] for s in r["sites"]}
    # Every shipped GPU recipe launches Triton builds; each fp32 recipe under explicit triton is refused instead.
    from bert_ds.devtools.recipe_launches import recipe_paths
    from bert_ds.recipe import load_recipe

    for path in recipe_paths():
        recipe = load_recipe(path)
        if recipe.deepspeed.precision == "fp32":
            assert f"{path.stem}[triton]" in report["refused"], path.stem
        else:
            assert (recipe.name or path.stem) in sites, path.stem
    # BERT-base and BERT-large attention builds stay apart (the JIT marks 16 heads 16-divisible, not 12).
    varlen = [r for r in report["builds"] if r["kernel"] == "_varlen_fwd_kernel" and r["arch"] == 80]
    assert {tuple(r["shapes"])[0].split("-")[0] for r in varlen} == {"base", "large"}
    assert all(len({s.split("-")[0] for s in r["shapes"]}) == 1 for r in varlen)


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


def test_listings_are_kept_per_cubin_flags_and_cuobjdump(tmp_path, monkeypatch):
    """cuobjdump runs once per (cubin, flags, cuobjdump binary); the listing it printed is what later calls return."""
    import triton

    from bert_ds.kernels import aot

    calls = tmp_path / "calls"
    tool = tmp_path / "cuobjdump"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "listing $1"; cat "$2"\n')
    tool.chmod(0o755)
    monkeypatch.setattr(aot, "cuobjdump_path", lambda: str(tool))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "cache"))

    def ran() -> int:
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    assert aot._cuobjdump(b"cubin A", "-sass") == "listing -sass\ncubin A"
    assert aot._cuobjdump(b"cubin A", "-sass") == "listing -sass\ncubin A" and ran() == 1
    usage = aot._cuobjdump(b"cubin A", "--dump-resource-usage")
    assert usage.startswith("listing --dump-resource-usage") and ran() == 2
    assert aot._cuobjdump(b"cubin B", "-sass") == "listing -sass\ncubin B" and ran() == 3
    tool.write_text(tool.read_text() + "echo another cuobjdump\n")  # another binary: listed again
    assert aot._cuobjdump(b"cubin A", "-sass").endswith("another cuobjdump\n") and ran() == 4
    assert len(list((tmp_path / "cache" / "bert_ds-cuobjdump").iterdir())) == 4
