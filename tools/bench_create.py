#!/usr/bin/env python
"""Benchmark shard creation against a Google-style baseline: thin entry point over
``bert_ds.devtools.benchmarks.create``.

    python tools/bench_create.py [--copies 8 32] [--corpus FILE --tokenizer DIR]
"""

import sys

from bert_ds.devtools.benchmarks.create import main

if __name__ == "__main__":
    sys.exit(main())
