#!/usr/bin/env python
"""Plot a run's curves from its TensorBoard event files into one PNG: thin CLI over
``bert_ds.devtools.plot_run.main`` (installed as ``bert-ds-plot-run``).

    python tools/plot_run.py RUN_DIR [--out PNG] [--title TITLE]        (default: RUN_DIR/curves.png)
"""

import sys

from bert_ds.devtools.plot_run import main

if __name__ == "__main__":
    sys.exit(main())
