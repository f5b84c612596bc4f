"""Check shard sets against their index.json: thin CLI over ``bert_ds.data.reader.main`` (``verify_shard_set``).

    python tools/verify_shards.py shards/train shards/eval --level sha256

Exit 0 when every set is clean; otherwise one line per bad shard naming shard, member and field, and exit 2."""

import sys

from bert_ds.data.reader import main

if __name__ == "__main__":
    sys.exit(main())
