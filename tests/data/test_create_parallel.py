"""Shard creation is a function of the inputs and the seed alone: the same bytes for 1 or 2 worker processes, under
``mpirun -np 2`` and under any ``PYTHONHASHSEED`` (dynamic masks too), and each ``dupe_factor`` copy of a chunk in its
own shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bert_ds.data.create import create_shards, shard_index
from bert_ds.data.index import INDEX_NAME, ShardIndex, file_sha256
from tests.helpers import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
# Small shards so that the ~700 kB test corpus makes seven chunks (14 shards at dupe factor 2): with fewer, a split
# over workers or ranks would have nothing to split.
SETTINGS = {"seq_len": 128, "dupe_factor": 2, "seed": 77, "samples_per_shard": 200}


def _hashes(directory: Path) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in sorted(directory.glob("shard-*.tar"))}


@pytest.fixture(scope="module")
def single_process(english_corpus, tokenizer_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single")
    index = create_shards([english_corpus], tokenizer_dir, out, workers=1, progress=False, **SETTINGS)
    assert len(index.shards) >= 10  # several chunks, so rank/worker assignment matters
    return out


def _assert_same_set(a: Path, b: Path) -> None:
    assert (a / INDEX_NAME).read_bytes() == (b / INDEX_NAME).read_bytes()  # no field differs, provenance included
    hashes = _hashes(a)
    assert hashes == _hashes(b)
    assert sorted(hashes) == sorted(s.name for s in ShardIndex.load(a).shards)


def test_two_workers_write_the_same_shards(single_process, english_corpus, tokenizer_dir, tmp_path):
    create_shards([english_corpus], tokenizer_dir, tmp_path, workers=2, progress=False, **SETTINGS)
    _assert_same_set(single_process, tmp_path)


@pytest.mark.e2e
@pytest.mark.mpi
def test_mpirun_two_ranks_write_the_same_shards(single_process, english_corpus, tokenizer_dir, tmp_path):
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    out = tmp_path / "mpi"
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable,
           str(REPO / "tools" / "create_shards.py"), "--input", str(english_corpus), "--tokenizer", str(tokenizer_dir),
           "--out", str(out), "--seq-len", str(SETTINGS["seq_len"]), "--dupe-factor", str(SETTINGS["dupe_factor"]),
           "--seed", str(SETTINGS["seed"]), "--samples-per-shard", str(SETTINGS["samples_per_shard"])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("wrote ") == 1  # rank 0 reports; both ranks wrote shards (chunk c on rank c mod 2)
    _assert_same_set(single_process, out)


def test_each_duplicate_is_its_own_shard(english_corpus, tokenizer_dir, tmp_path, shard_reader):
    """Copy d of chunk c is shard c * dupe_factor + d and holds exactly one pass over the chunk: with the same seed,
    copy 0 is the dupe_factor=1 shard of that chunk, sample for sample (so no shard mixes two copies of a text)."""
    one = create_shards([english_corpus], tokenizer_dir, tmp_path / "one", progress=False,
                        **{**SETTINGS, "dupe_factor": 1})
    three = create_shards([english_corpus], tokenizer_dir, tmp_path / "three", progress=False,
                          **{**SETTINGS, "dupe_factor": 3})
    chunks = len(one.shards)
    assert [s.name for s in three.shards] == [f"shard-{shard_index(c, d, 3):06d}.tar"
                                              for c in range(chunks) for d in range(3)]
    by_shard: dict[str, list] = {}
    for shard, member, sample in shard_reader(tmp_path / "three"):
        assert member.startswith(shard[len("shard-"):-len(".tar")])  # keys carry their own shard number
        by_shard.setdefault(shard, []).append(sample)
    firsts: dict[str, list] = {}
    for shard, _, sample in shard_reader(tmp_path / "one"):
        firsts.setdefault(shard, []).append(sample)
    for c in range(chunks):
        ours = by_shard[f"shard-{3 * c:06d}.tar"]
        theirs = firsts[f"shard-{c:06d}.tar"]
        assert len(ours) == len(theirs)
        for x, y in zip(ours, theirs, strict=True):
            assert x.input_ids.tobytes() == y.input_ids.tobytes() and x.nsp_label == y.nsp_label
            assert x.masked_positions.tobytes() == y.masked_positions.tobytes()
        # the other copies are other passes over the same chunk: about as many samples, not the same ones
        for d in (1, 2):
            other = by_shard[f"shard-{3 * c + d:06d}.tar"]
            assert 0.7 * len(ours) <= len(other) <= 1.3 * len(ours)
            assert [s.input_ids.tobytes() for s in other] != [s.input_ids.tobytes() for s in ours]
    assert three.total_samples == sum(len(v) for v in by_shard.values())


_RUN = textwrap.dedent("""
    import hashlib, json, sys
    from bert_ds.data.create import create_shards
    from bert_ds.data.loader import DynamicMasking, build_loader

    corpus, tokenizer, out = sys.argv[1:4]
    index = create_shards([corpus], tokenizer, out, seq_len=64, dupe_factor=2, samples_per_shard=200, seed=5,
                          progress=False)
    dyn = DynamicMasking.from_tokenizer(tokenizer, masked_lm_prob=0.3)
    loader = build_loader(out, global_batch_size=16, micro_batch_size=16, seed=5, num_workers=0, dynamic_masking=dyn)
    h = hashlib.sha256()
    for _, batch in zip(range(4), loader):
        for key in sorted(batch):
            h.update(batch[key].numpy().tobytes())
    print(json.dumps({"shards": [s.sha256 for s in index.shards], "dynamic": h.hexdigest()}))
""")


def test_outputs_do_not_depend_on_the_string_hash_seed(english_corpus, tokenizer_dir, tmp_path):
    """Shard bytes and dynamic masks are the same under two PYTHONHASHSEED values (seeds never come from hash())."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(english_corpus.read_text(encoding="utf-8").split("\n\n")[:60]) + "\n")
    results = []
    for hash_seed in ("0", "4242"):
        proc = subprocess.run([sys.executable, "-c", _RUN, str(corpus), str(tokenizer_dir), str(tmp_path / hash_seed)],
                              capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
                              env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert proc.returncode == 0, proc.stderr
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert len(results[0]["shards"]) >= 2
    assert results[0] == results[1]
