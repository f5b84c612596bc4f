"""Shard integrity on real tar files: the verify command, training-time hashing, token ids checked against the
vocabulary, one-line errors from DataLoader workers, a dying worker named, and loaders that leave torch's global RNG
alone (exact resume with dropout)."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bert_ds.data.format import HEADER_SIZE
from bert_ds.data.loader import LoaderWorkerError, build_eval_loader, build_loader
from bert_ds.data.reader import ShardError, ShardReader, verify_shard_set
from bert_ds.data.synthetic import write_synthetic_shards
from tests.helpers import HANG_GUARD_S

SPECIAL_IDS = {"cls_id": 2, "sep_id": 3, "mask_id": 4}  # bert_ds's special-token order (tokenizer.SPECIAL_TOKENS)
VOCAB, SEQ, MAXP, PER_SHARD = 30522, 64, 10, 100
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def shards(tmp_path) -> Path:
    path = tmp_path / "shards"
    write_synthetic_shards(path, num_samples=300, samples_per_shard=PER_SHARD, seq_len=SEQ, max_predictions=MAXP,
                           vocab_size=VOCAB, **SPECIAL_IDS)
    return path


def _member(path: Path, shard: int, index: int) -> tuple[int, str]:
    """(data offset, name) of member ``index`` of shard ``shard``."""
    reader = ShardReader(path)
    handle = reader.open(shard)
    out = int(handle.members.offsets[index]), handle.members.names[index]
    reader.close()
    return out


def _patch(path: Path, shard: int, offset: int, value: bytes) -> None:
    """Write ``value`` into the shard file at ``offset`` (byte size unchanged: only content checks can see it)."""
    file = path / f"shard-{shard:06d}.tar"
    data = bytearray(file.read_bytes())
    data[offset:offset + len(value)] = value
    file.write_bytes(bytes(data))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "verify_shards.py"), *args], capture_output=True,
                          text=True, timeout=HANG_GUARD_S, cwd=REPO)


def _batches(loader, n: int) -> list:
    return list(itertools.islice(iter(loader), n))


def test_clean_set_passes_every_level(shards):
    for level in ("size", "headers", "sha256"):
        report = verify_shard_set(shards, level)
        assert report.ok and (report.shards, report.samples) == (3, 300), report.errors
    done = _cli(str(shards), "--level", "headers")
    assert done.returncode == 0 and "ok: 3 shards, 300 samples" in done.stdout, done.stderr


def test_flipped_token_byte_named_by_verify_and_by_training(shards):
    offset, _ = _member(shards, 1, 5)
    _patch(shards, 1, offset + HEADER_SIZE + 2 * 4, b"\x07")  # low byte of token 4: still a valid id
    assert verify_shard_set(shards, "headers").ok  # the layout is intact: only the checksum can tell
    done = _cli(str(shards), "--level", "sha256")
    assert done.returncode == 2
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 1 and "shards/shard-000001.tar: sha256 mismatch (index.json says" in errors[0]
    # Training hashes each shard on first open in the worker that reads it (the default verify level).
    loader = build_loader(shards, global_batch_size=100, micro_batch_size=100, num_workers=1, shuffle=False)
    with pytest.raises(ShardError, match=r"^shards/shard-000001\.tar: sha256 mismatch") as caught:
        _batches(loader, 3)
    assert "\n" not in str(caught.value)


def test_wrong_count_caught_by_headers_level_before_any_batch(shards):
    index = json.loads((shards / "index.json").read_text())
    index["shards"][2]["samples"] += 1
    index["total_samples"] += 1
    (shards / "index.json").write_text(json.dumps(index))
    assert verify_shard_set(shards, "size").ok  # a stat cannot see it
    report = verify_shard_set(shards, "headers")
    assert report.errors == ["shards/shard-000002.tar: sample count mismatch (index.json says 101, file has 100)"]
    with pytest.raises(ShardError, match="shard-000002.tar: sample count mismatch"):
        report.raise_for_errors()


def test_bad_length_field_names_shard_member_and_field(shards):
    offset, name = _member(shards, 0, 17)
    reader = ShardReader(shards)
    sample = reader.sample(0, 17)
    reader.close()
    predictions = len(sample.masked_positions)
    _patch(shards, 0, offset, (SEQ + 3).to_bytes(2, "little"))  # field 'length'
    report = verify_shard_set(shards, "headers")
    size = HEADER_SIZE + 2 * sample.length + 4 * predictions
    assert report.errors == [f"shards/shard-000000.tar:{name}: field 'length' or 'num_predictions' disagrees with "
                             f"the record size ({size} bytes; length={SEQ + 3}, num_predictions={predictions})"]
    offset, name = _member(shards, 2, 3)
    _patch(shards, 2, offset + 6, b"\x05")  # field 'nsp_label'
    report = verify_shard_set(shards, "headers")
    assert len(report.errors) == 2
    assert report.errors[1] == f"shards/shard-000002.tar:{name}: field 'nsp_label' is 5, need 0 or 1"
    done = _cli(str(shards), "--level", "headers")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 2


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("field_name", ["input_ids", "masked_lm_ids"])
def test_token_id_outside_vocab_is_one_line(shards, workers, field_name):
    offset, name = _member(shards, 1, 40)
    reader = ShardReader(shards)
    sample = reader.sample(1, 40)
    reader.close()
    # input ids start after the header; the masked (original) ids after the ids and the uint16 positions
    slot = HEADER_SIZE + 2 * 5 if field_name == "input_ids" else (
        HEADER_SIZE + 2 * sample.length + 2 * len(sample.masked_positions))
    _patch(shards, 1, offset + slot, (VOCAB + 7).to_bytes(2, "little"))
    # verify="headers": the sha256 check would stop at the changed file before any id is read
    loader = build_loader(shards, global_batch_size=100, micro_batch_size=100, num_workers=workers, shuffle=False,
                          verify="headers")
    expected = (rf"^shards/shard-000001\.tar:{name}: field '{field_name}' holds token id {VOCAB + 7} "
                rf"\(slot \d+\), not below index\.json vocab_size={VOCAB}$")
    with pytest.raises(ShardError, match=expected):
        _batches(loader, 3)


def test_masked_position_outside_pair_is_named(shards):
    offset, name = _member(shards, 0, 2)
    reader = ShardReader(shards)
    sample = reader.sample(0, 2)
    reader.close()
    _patch(shards, 0, offset + HEADER_SIZE + 2 * sample.length, (SEQ + 1).to_bytes(2, "little"))
    loader = build_loader(shards, global_batch_size=100, micro_batch_size=100, num_workers=0, shuffle=False,
                          verify="headers")
    with pytest.raises(ShardError, match=rf"shard-000000\.tar:{name}: field 'masked_positions' holds {SEQ + 1}"):
        _batches(loader, 1)


def test_dying_worker_names_its_shard(shards):
    loader = build_loader(shards, global_batch_size=50, micro_batch_size=50, num_workers=1, shuffle=False,
                          prefetch_factor=1)
    others = {p.pid for p in multiprocessing.active_children()}  # workers of loaders earlier tests left to the GC
    stream = iter(loader)
    next(stream)
    workers = [p for p in multiprocessing.active_children() if p.pid not in others]
    assert workers
    deadline = time.monotonic() + HANG_GUARD_S
    with pytest.raises(LoaderWorkerError, match=r"worker 0 \(pid \d+\) was reading shards/shard-00000\d\.tar "
                                                r"member #\d+") as caught:
        for worker in workers:
            os.kill(worker.pid, signal.SIGKILL)
        while time.monotonic() < deadline:  # SIGCHLD may raise here, or the next batch fetch does
            next(stream)
    message = str(caught.value)
    assert "\n" not in message and ("killed by signal" in message or "exited unexpectedly" in message), message


@pytest.mark.parametrize("workers", [0, 1])
def test_loaders_leave_the_global_rng_alone(shards, workers):
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    train = build_loader(shards, global_batch_size=50, micro_batch_size=25, num_workers=workers, seed=7)
    evals = build_eval_loader(shards, micro_batch_size=64, num_workers=workers, seed=7)
    first = _batches(train, 4)
    assert len(list(evals)) == 5
    assert torch.equal(torch.get_rng_state(), before)
    again = _batches(build_loader(shards, global_batch_size=50, micro_batch_size=25, num_workers=1 - workers,
                                  seed=7), 4)
    for a, b in zip(first, again, strict=True):  # worker seeds do not reach the batches
        assert all(torch.equal(a[k], b[k]) for k in a)
