#!/usr/bin/env python
"""The loader's wait from a store against a local path, and network bytes per epoch against the set's size: thin
entry point over ``bert_ds.devtools.benchmarks.remote``.

    python tools/bench_remote.py [--epochs 2] [--step-ms 20] [--mbps 100] [--workers 1]
"""

import sys

from bert_ds.devtools.benchmarks.remote import main

if __name__ == "__main__":
    sys.exit(main())
