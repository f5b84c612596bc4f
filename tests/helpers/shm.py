"""A /dev/shm segment held mapped by another process, for tests of the clean-ups that must leave a live run's
DeepSpeed all-reduce buffers alone (which files live processes map:
:func:`bert_ds.lifecycle.restart.mapped_shm_paths`)."""

from __future__ import annotations

__all__ = ["MAP_AND_WAIT"]

MAP_AND_WAIT = """
import mmap, sys
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
sys.stdin.readline()
"""
"""``python -c MAP_AND_WAIT PATH``: map PATH, print ``mapped``, hold it until a line arrives on stdin."""
