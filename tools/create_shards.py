"""Create NSP + masked-LM tar shards from raw text: thin CLI over ``bert_ds.data.create.create_shards``.

Under ``mpirun -np N python tools/create_shards.py ...`` the ranks split the work; rank 0 writes index.json."""

import sys

from bert_ds.data.create import main

if __name__ == "__main__":
    sys.exit(main())
