#!/usr/bin/env python
"""Loader throughput next to the raw cost of reading the tar bytes: thin entry point over
``bert_ds.devtools.benchmarks.loader``.

    python tools/bench_loader.py [--data-dir shards/] [--mix --workers 0]
"""

import sys

from bert_ds.devtools.benchmarks.loader import main

if __name__ == "__main__":
    sys.exit(main())
