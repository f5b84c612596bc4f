#!/usr/bin/env python
"""Every performance figure beside its baseline, measured in the same run: thin CLI over
``bert_ds.devtools.benchmarks.cli.main`` (installed as ``bert-ds-benchmark``).

    python tools/benchmark.py [--only step flops zero create loader tta] [--quick] [--out benchmark.json] \\
        [--markdown BENCHMARKS.md] [--update]
"""

import sys

from bert_ds.devtools.benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main())
