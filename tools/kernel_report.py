"""AOT-compile every shipped Triton kernel for sm_80 and sm_90 and print register/spill usage.

Usage: python tools/kernel_report.py   (no GPU needed; exits 1 if any kernel spills: STACK or LOCAL > 0)
"""

from __future__ import annotations

import argparse
import sys

from bert_ds.kernels.aot import format_report, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    rows = report()
    print(format_report(rows))
    spilled = [r for r in rows if r.spills]
    for r in spilled:
        print(f"SPILL: {r.kernel} [{r.config}] sm_{r.arch}: STACK={r.stack} LOCAL={r.local}", file=sys.stderr)
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
