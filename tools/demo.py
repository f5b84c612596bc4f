#!/usr/bin/env python
"""The bert_ds demo (what `make demo` runs): real English text -> tokenizer -> shards -> both phases with ZeRO-2 and
LAMB on 2 CPU ranks -> Hugging Face export -> held-out accuracy vs the unigram baseline and fill-mask -> plot.

    python tools/demo.py [--out demo_run] [--quick]

A second run reuses OUT/data when the corpus and settings are unchanged and replaces the run, the export and the
plot. Exit status 0 when the export reaches twice the unigram baseline on held-out text (``--quick`` only reports
it), 1 when a step fails or it does not, 2 when OUT is not the demo's directory.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bert_ds.devtools.demo import MIN_RATIO, DemoError, NotDemoDirectory, run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/demo.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_run", type=Path,
                        help="output directory (default: demo_run); one the demo did not create is refused")
    parser.add_argument("--quick", action="store_true",
                        help="10 warm-up steps and 6 + 6 instead of the full recipes (seconds of training; for tests): "
                             "reports the accuracy without requiring 2x the baseline")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        run_demo(args.out, quick=args.quick, min_ratio=None if args.quick else MIN_RATIO)
    except NotDemoDirectory as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    except DemoError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1
    print(f"demo finished in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
