"""The training loader in real processes: 2 ranks (gloo) x 2 DataLoader workers each read one epoch exactly once."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap

import pytest

from bert_ds.data.loader import build_loader
from bert_ds.data.synthetic import sample_ids_of_batch, write_synthetic_shards
from tests.helpers import free_port

# [CLS], [SEP], [MASK] in bert_ds's special-token order (tokenizer.SPECIAL_TOKENS): the synthetic shards' specials.
SPECIAL_IDS = {"cls_id": 2, "sep_id": 3, "mask_id": 4}

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from bert_ds.data.loader import build_loader
    from bert_ds.data.synthetic import sample_ids_of_batch

    data, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = build_loader(data, global_batch_size=64, micro_batch_size=8, rank=rank, world_size=world,
                          num_workers=2)
    it = iter(loader)
    ids = [sample_ids_of_batch(next(it)).tolist() for _ in range(steps)]
    gathered = [None] * world
    dist.all_gather_object(gathered, {"ids": ids, "state": loader.state_dict()})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()
""")


@pytest.mark.e2e
def test_two_processes_gloo_exactly_once(tmp_path):
    data = tmp_path / "shards"
    write_synthetic_shards(data, num_samples=700, samples_per_shard=100, seq_len=64, max_predictions=10,
                           **SPECIAL_IDS)
    per_epoch, gas = 700 // 64, 4
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "gathered.json"
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2",
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), str(data), str(out), str(per_epoch * gas)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, output
    gathered = json.loads(out.read_text())
    seen = [i for rank in gathered for batch in rank["ids"] for i in batch]
    assert len(seen) == len(set(seen)) == per_epoch * 64
    assert gathered[0]["state"] == gathered[1]["state"]  # either rank's state resumes the run
    assert gathered[0]["state"]["consumed_global_batches"] == per_epoch
    # The processes saw exactly what the in-process simulation of the same rank sees.
    for rank in range(2):
        local = build_loader(data, global_batch_size=64, micro_batch_size=8, rank=rank, world_size=2, num_workers=0)
        expected = [sample_ids_of_batch(b).tolist() for b in itertools.islice(iter(local), per_epoch * gas)]
        assert gathered[rank]["ids"] == expected
