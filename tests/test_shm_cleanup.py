"""The session clean-up of DeepSpeed's /dev/shm buffers spares the ones a live process maps (another test session's
run on the same machine)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bert_ds.lifecycle.restart import mapped_shm_paths
from tests.helpers.shm import MAP_AND_WAIT


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_a_segment_is_listed_while_mapped_and_not_after():
    seg = Path("/dev/shm") / f"bert_ds_test_{uuid.uuid4().hex}"
    seg.write_bytes(b"\0" * 4096)
    try:
        assert str(seg) not in mapped_shm_paths()
        proc = subprocess.Popen([sys.executable, "-c", MAP_AND_WAIT, str(seg)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "mapped"
            assert str(seg) in mapped_shm_paths()
        finally:
            proc.communicate("go\n", timeout=60)
        assert str(seg) not in mapped_shm_paths()
        with open(seg, "r+b") as f, mmap.mmap(f.fileno(), 4096):  # this process too
            assert str(seg) in mapped_shm_paths()
    finally:
        os.unlink(seg)
