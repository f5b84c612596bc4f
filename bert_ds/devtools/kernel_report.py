"""AOT-compile every Triton kernel build the shipped recipes launch (sm_80, sm_90) and report its machine code.

    bert-ds-kernel-report [--arch 80] [--controls] [--json report.json] [--sass _layer_norm_fwd_kernel]
    (also python tools/kernel_report.py)

No GPU needed. The builds are those of every ``ds_configs/*.json`` recipe as shipped and with explicit
``kernels: "triton"``, recorded by running the model (:mod:`bert_ds.devtools.recipe_launches`). The table gives
REG/STACK/LOCAL/SHARED (cuobjdump --dump-resource-usage) and, from cuobjdump -sass, global loads and stores as
width-in-bits x count (128x4: four LDG.E.128), tensor-core instructions (MMA: HMMA/HGMMA) and which recipes launch
each build. Exit status 1 when a build fails a check (spills; attention without tensor cores; LayerNorm / bias-GELU
bf16 rows not moved 128 bits at a time) or, with --controls, when a known-bad variant passes every check on an
architecture it is built for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, option
from bert_ds.devtools.recipe_launches import shipped_launches
from bert_ds.errors import BadInput
from bert_ds.kernels import aot
from bert_ds.kernels.jit import triton_version_problem

__all__ = ["main"]


def cli_parser() -> argparse.ArgumentParser:
    return build_parser(ReportArgs, "bert-ds-kernel-report", __doc__.splitlines()[0])


main = alias("kernel-report")


@dataclasses.dataclass(frozen=True)
class ReportArgs:
    """``bert-ds-kernel-report``: which architectures, and what to print or write."""

    arch: list[int] | None = option(None, choices=[t.arch for t in aot.TARGETS],
                                    help="compile for these sm only (default: all of "
                                    f"{', '.join(str(t.arch) for t in aot.TARGETS)})")
    controls: bool = False
    """also build the known-bad variants each check must reject (aot.controls)"""
    json: Path | None = None
    """write every row (all opcode counts, checks) to this file"""
    sass: str | None = option(None, metavar="KERNEL")
    """print the SASS of the builds of KERNEL instead of the table"""


def recipe_builds(targets) -> tuple[list[aot.Build], dict[str, str]]:
    """The builds of every shipped recipe (as shipped and with explicit ``triton``) for ``targets``, and the
    recipe settings the runtime refuses, with why."""
    launches, refused = shipped_launches()
    return aot.builds_from_launches(launches, targets), refused


def _run(args: ReportArgs) -> int:
    """``bert-ds-kernel-report`` / ``tools/kernel_report.py``: exit 0 when every build passes its checks, 1 when one
    fails (or, with --controls, when a known-bad variant passes)."""
    problem = triton_version_problem()
    if problem is not None:
        raise BadInput(f"cannot build the kernels ahead of time: {problem}")
    targets = [t for t in aot.TARGETS if not args.arch or t.arch in args.arch]
    builds, refused = recipe_builds(targets)
    if args.sass:
        chosen = [b for b in builds if b.kernel == args.sass]
        if not chosen:
            raise BadInput(f"--sass: no build of {args.sass!r}; kernels: {sorted({b.kernel for b in builds})}")
        for b in chosen:
            print(f"// {b.kernel} [{b.label}] sm_{b.target.arch} (shapes: {', '.join(b.shapes)})")
            print(aot.sass(aot.compile_build(b).asm["cubin"]))
        return 0
    rows = [aot.analyse(b) for b in builds]
    print(aot.format_report(rows))
    print(aot.format_summary(rows))
    for name, why in refused.items():
        print(f"refused (no build): {name}: {why}")
    status = 0
    for r in rows:
        for problem in r.problems:
            print(f"FAIL: {r.kernel} [{r.config}] sm_{r.arch}: {problem}", file=sys.stderr)
            status = 1
    control_rows = []
    if args.controls:
        print("\ncontrols (known-bad variants; each must fail a check):")
        for target in targets:
            for name, r in aot.controls(target):
                control_rows.append({"name": name, **aot.report_json([r])[0]})
                verdict = "; ".join(r.problems) if r.problems else "PASSED EVERY CHECK: the checks cannot see this"
                print(f"  {name} sm_{r.arch}: loads {r.loads}, stores {r.stores}, MMA {r.tensor_core_ops}, "
                      f"STACK {r.stack} -> {verdict}")
                status = status or (0 if r.problems else 1)
    if args.json:
        doc = {"builds": aot.report_json(rows), "controls": control_rows, "refused": refused}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
