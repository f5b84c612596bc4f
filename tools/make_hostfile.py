"""Write a DeepSpeed hostfile from the current Slurm job or a host list: thin CLI over ``bert_ds.lifecycle.hostfile``.

    python tools/make_hostfile.py --slurm -o hostfile            # inside sbatch/salloc
    python tools/make_hostfile.py --hosts node0:8,node1:8 -o hostfile
"""

import sys

from bert_ds.lifecycle.hostfile import main

if __name__ == "__main__":
    sys.exit(main())
