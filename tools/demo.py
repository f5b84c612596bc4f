#!/usr/bin/env python
"""The bert_ds demo (what `make demo` runs): thin CLI over ``bert_ds.devtools.demo.main`` (installed as
``bert-ds-demo``).

    python tools/demo.py [--out demo_run] [--quick]
"""

import sys

from bert_ds.devtools.demo import main

if __name__ == "__main__":
    sys.exit(main())
