"""``index.json`` numbers are checked before anything is sized from them, and one ``--out`` has one writer.

Issue 16 items 6 and 8: a forged ``total_samples`` (2e8) used to allocate 3.9 GB before the refusal, a huge or
string ``max_predictions`` gave tracebacks or a "dead worker"; two ``create_shards`` on one ``--out`` left an index
over missing shards. Every case edits a real shard set's index (the session's English shards) and runs the real
readers and CLIs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from bert_ds.data import create as create_mod
from bert_ds.data.create import LOCK_NAME, OutDirLock, create_shards
from bert_ds.data.index import INDEX_NAME, ShardIndex
from bert_ds.data.reader import verify_shard_set
from tests.helpers import HANG_GUARD_S, child_env

REPO = Path(__file__).resolve().parents[2]


def _forged(shards_128: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "forged"
    shutil.copytree(shards_128, out)
    data = json.loads((out / INDEX_NAME).read_text())
    edit(data)
    (out / INDEX_NAME).write_text(json.dumps(data))
    return out


def _set_total(value):
    def edit(data):
        data["total_samples"] = value
    return edit


def _set_max_predictions(value):
    def edit(data):
        data["masking"]["max_predictions"] = value
    return edit


def _set_first_shard_samples(value):
    def edit(data):
        delta = value - data["shards"][0]["samples"]
        data["shards"][0]["samples"] = value
        data["total_samples"] += delta  # consistent totals: only the shard's own size can refuse it
    return edit


def _set_seq_len(value):
    def edit(data):
        data["seq_len"] = value
    return edit


CASES = {
    "total_samples 2e8": (_set_total(200_000_000), r"'total_samples' is 200000000, but its shards hold \d+"),
    "total_samples 1e30": (_set_total(1e30), r"'total_samples' is 1e\+30, need a non-negative integer"),
    "max_predictions 1e30": (_set_max_predictions(1e30), r"'masking.max_predictions' is 1e\+30, need an integer"),
    "max_predictions string": (_set_max_predictions("20"), r"'masking.max_predictions' is '20', need an integer"),
    "max_predictions 1e15": (_set_max_predictions(10**15), r"'masking.max_predictions' is 1000000000000000"),
    "shard samples 1e15": (_set_first_shard_samples(10**15),
                           r"'shards\[shard-000000.tar\].samples' is 1000000000000000, need at most \d+ for a"),
    "seq_len 1e9": (_set_seq_len(10**9), r"'seq_len' is 1000000000, need at most 65536"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_forged_number_is_refused_at_load_before_any_allocation(case, shards_128, tmp_path):
    edit, message = CASES[case]
    out = _forged(shards_128, tmp_path, edit)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=message) as info:
            ShardIndex.load(out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(out / INDEX_NAME) in str(info.value)  # names the file
    assert peak < 16 << 20, f"loading a forged index traced {peak / 2**20:.1f} MiB"


def test_the_cli_refuses_a_forged_index_in_one_line(shards_128, tmp_path):
    out = _forged(shards_128, tmp_path, _set_total(200_000_000))
    proc = subprocess.run([str(Path(sys.executable).parent / "bert-ds-verify-shards"), str(out)], capture_output=True,
                          text=True, env=child_env(), cwd=REPO, timeout=HANG_GUARD_S)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "total_samples" in lines[0] and str(out) in lines[0], proc.stderr[-2000:]


def test_the_real_index_still_loads_and_verifies(shards_128):
    index = ShardIndex.load(shards_128)
    assert index.total_samples == sum(s.samples for s in index.shards) > 0
    verify_shard_set(shards_128)


def test_a_second_create_on_a_locked_out_is_refused_and_touches_nothing(english_corpus, tokenizer_dir, shards_128,
                                                                        tmp_path):
    out = tmp_path / "set"
    shutil.copytree(shards_128, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    lock = OutDirLock(out)  # stands for a create_shards run that is still writing here
    try:
        with pytest.raises(FileExistsError, match=r"being written by another create_shards \(pid \d+"):
            create_shards([english_corpus], tokenizer_dir, out, seq_len=128, overwrite=True, progress=False)
        proc = subprocess.run([sys.executable, "-m", "bert_ds.data.create", "--input", str(english_corpus),
                               "--tokenizer", str(tokenizer_dir), "--seq-len", "128", "--out", str(out),
                               "--overwrite"], capture_output=True, text=True, env=child_env(), cwd=REPO,
                              timeout=HANG_GUARD_S)
    finally:
        lock.release()
    assert proc.returncode == 2 and "being written by another create_shards" in proc.stderr, proc.stderr[-2000:]
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK_NAME}
    assert after == {k: v for k, v in before.items() if k != LOCK_NAME}


def test_two_concurrent_creates_leave_one_complete_set(english_corpus, tokenizer_dir, tmp_path):
    out = tmp_path / "set"
    cmd = [sys.executable, "-m", "bert_ds.data.create", "--input", str(english_corpus), "--tokenizer",
           str(tokenizer_dir), "--seq-len", "128", "--samples-per-shard", "200", "--out", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                              cwd=REPO) for _ in range(2)]
    results = [(p.wait(timeout=HANG_GUARD_S), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    # The loser is refused (exit 2, one line) whether it met the winner's lock or, starting late, its finished index.
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "being written by another create_shards" in loser or "already holds a shard set" in loser, loser
    index = ShardIndex.load(out)
    assert all((out / s.name).is_file() for s in index.shards)
    verify_shard_set(out)


def test_no_index_over_a_shard_that_vanished_before_the_index(english_corpus, tokenizer_dir, tmp_path, monkeypatch):
    real = create_mod._shard_index

    def shard_index_then_lose_one(*args, **kwargs):
        index = real(*args, **kwargs)
        (tmp_path / "set" / index.shards[-1].name).unlink()  # something else deleted it under us
        return index

    monkeypatch.setattr(create_mod, "_shard_index", shard_index_then_lose_one)
    with pytest.raises(OSError, match=r"shard-\d+\.tar is missing: something else changed .* no index.json written"):
        create_shards([english_corpus], tokenizer_dir, tmp_path / "set", seq_len=128, samples_per_shard=500,
                      progress=False)
    assert not (tmp_path / "set" / INDEX_NAME).exists()
    OutDirLock(tmp_path / "set").release()  # the failed run released its lock
