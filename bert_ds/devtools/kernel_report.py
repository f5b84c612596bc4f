"""AOT-compile every Triton kernel build the runtime launches (sm_80, sm_90) and report its machine code.

    bert-ds-kernel-report [--arch 80] [--controls] [--json report.json] [--sass _layer_norm_fwd_kernel]
    (also python tools/kernel_report.py)

No GPU needed. The table gives REG/STACK/LOCAL/SHARED (cuobjdump --dump-resource-usage) and, from cuobjdump -sass,
global loads and stores as width-in-bits x count (128x4: four LDG.E.128) and tensor-core instructions (HMMA/HGMMA).
Exit status 1 when a build fails a check (spills; attention without tensor cores; LayerNorm / bias-GELU bf16 rows
not moved 128 bits at a time) or, with --controls, when a known-bad variant passes every check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bert_ds.errors import BadInput, run_main
from bert_ds.kernels import aot

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``bert-ds-kernel-report`` / ``tools/kernel_report.py``: exit 0 when every build passes its checks, 1 when one
    fails (or, with --controls, when a known-bad variant passes)."""
    parser = argparse.ArgumentParser(prog="bert-ds-kernel-report", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, action="append", choices=[t.arch for t in aot.TARGETS],
                        help="compile for this sm only (repeatable; default: all of %(choices)s)")
    parser.add_argument("--controls", action="store_true",
                        help="also build the known-bad variants each check must reject (aot.controls)")
    parser.add_argument("--json", type=Path, help="write every row (all opcode counts, checks) to this file")
    parser.add_argument("--sass", metavar="KERNEL", help="print the SASS of the builds of KERNEL instead of the table")
    return run_main(parser.prog, _report, parser.parse_args(argv))


def _report(args: argparse.Namespace) -> int:
    targets = [t for t in aot.TARGETS if not args.arch or t.arch in args.arch]
    builds = aot.kernel_builds(targets)
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
    status = 0
    for r in rows:
        for problem in r.problems:
            print(f"FAIL: {r.kernel} [{r.config}] sm_{r.arch}: {problem}", file=sys.stderr)
            status = 1
    control_rows = []
    if args.controls:
        print("\ncontrols (known-bad variants; each must fail a check):")
        for name, r in aot.controls(targets[0]):
            control_rows.append({"name": name, **aot.report_json([r])[0]})
            verdict = "; ".join(r.problems) if r.problems else "PASSED EVERY CHECK: the checks cannot see this"
            print(f"  {name} sm_{r.arch}: loads {r.loads}, stores {r.stores}, MMA {r.tensor_core_ops}, "
                  f"STACK {r.stack} -> {verdict}")
            status = status or (0 if r.problems else 1)
    if args.json:
        args.json.write_text(json.dumps({"builds": aot.report_json(rows), "controls": control_rows}, indent=1) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
