#!/usr/bin/env python
"""AOT-compile every Triton kernel build the runtime launches (sm_80, sm_90) and report its machine code: thin CLI
over ``bert_ds.devtools.kernel_report.main`` (installed as ``bert-ds-kernel-report``). No GPU needed.

    python tools/kernel_report.py [--arch 80] [--controls] [--json report.json] [--sass _layer_norm_fwd_kernel]
"""

import sys

from bert_ds.devtools.kernel_report import main

if __name__ == "__main__":
    sys.exit(main())
