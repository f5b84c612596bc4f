#!/usr/bin/env python
"""Measure what exact sharded LAMB costs: thin entry point over ``bert_ds.devtools.benchmarks.lamb``.

    python tools/bench_lamb.py state-bytes | overhead --preset tiny | launches --preset large
"""

import sys

from bert_ds.devtools.benchmarks.lamb import main

if __name__ == "__main__":
    sys.exit(main())
