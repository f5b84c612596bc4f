"""Shard sets at a URL without ranks (issue 33): the node-local cache, the prefetcher and the faults, against real
servers on 127.0.0.1 (moto's S3 server in its own process, Python's http.server with injected faults); every byte
crosses a socket and the client library is never patched."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bert_ds.data.epoch_order import EpochOrder
from bert_ds.data.index import ShardIndex
from bert_ds.data.loader import build_loader
from bert_ds.data.mix import parse_sources
from bert_ds.data.reader import verify_shard_set
from bert_ds.data.remote import RemoteError
from bert_ds.data.shard_cache import CacheOptions, ShardCache, parse_size
from bert_ds.data.synthetic import sample_ids_of_batch, write_synthetic_shards
from bert_ds.errors import BadInput, StorageError
from tests.helpers import child_env, environ
from tests.helpers.object_store import HttpStore, MotoServer, s3_env

_SPECIALS = {"cls_id": 2, "sep_id": 3, "mask_id": 4}
_LOADER = {"global_batch_size": 16, "micro_batch_size": 4, "shuffle_window_shards": 2, "seed": 5}


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory) -> Path:
    """8 shards of 50 synthetic samples (400, ~25 global batches of 16 per epoch)."""
    root = tmp_path_factory.mktemp("remote_cache")
    write_synthetic_shards(root / "set", num_samples=400, samples_per_shard=50, seed=9, **_SPECIALS)
    return root / "set"


@pytest.fixture(scope="module")
def moto(shard_set):
    server = MotoServer()
    server.put_set(shard_set, "corpus", "sets/set")
    with environ(**s3_env(server.endpoint)):
        yield server
    server.close()


@pytest.fixture
def http(shard_set):
    store = HttpStore(shard_set.parent)
    yield store
    store.close()


def _ids(loader, n: int) -> np.ndarray:
    return np.concatenate([sample_ids_of_batch(b) for _, b in zip(range(n), loader, strict=False)])


def _options(tmp_path: Path, **kw) -> CacheOptions:
    return CacheOptions(root=str(tmp_path / "cache"), **kw)


def _loader(source, tmp_path, *, num_workers: int = 0, **kw):
    from bert_ds.data.shard_cache import set_default_options

    set_default_options(_options(tmp_path, **kw))
    return build_loader(source, num_workers=num_workers, **_LOADER)


def test_s3_loader_equals_local_and_reads_each_shard_once(shard_set, moto, tmp_path):
    """Two epochs from s3:// through the cache (one loader worker) yield the local loader's batches; each shard is
    downloaded once (the unbounded cache holds the epoch), and only verified files carry a shard's name."""
    want = _ids(build_loader(shard_set, num_workers=0, **_LOADER), 2 * 25 * 4)
    loader = _loader("s3://corpus/sets/set/", tmp_path, num_workers=1)
    got = _ids(loader, 2 * 25 * 4)
    np.testing.assert_array_equal(got, want)
    cache = loader.caches[0]
    index = ShardIndex.load(shard_set)
    assert int(cache.stats[0]) == sum(s.bytes for s in index.shards) and int(cache.stats[1]) == len(index.shards)
    for s in index.shards:
        assert hashlib.sha256((cache.dir / s.name).read_bytes()).hexdigest() == s.sha256


def _held(directory: Path) -> int:
    """Bytes under shard names now (a prefetch thread may evict one between the listing and its stat)."""
    total = 0
    for path in directory.glob("shard-*.tar"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def test_bounded_cache_evicts_outside_the_window(shard_set, moto, tmp_path):
    """A --cache-limit of the look-ahead window (here 6 of the 8 shards): the loader still yields the local batches
    over two epochs, the cache never holds more than the limit, and each shard is downloaded once per epoch."""
    index = ShardIndex.load(shard_set)
    limit = 6 * max(s.bytes for s in index.shards)
    want = _ids(build_loader(shard_set, num_workers=0, **_LOADER), 2 * 25 * 4)
    loader = _loader("s3://corpus/sets/set/", tmp_path, limit_bytes=limit)
    got, held = [], []
    for _, batch in zip(range(2 * 25 * 4), loader, strict=False):
        got.append(sample_ids_of_batch(batch))
        held.append(_held(loader.caches[0].dir))
    np.testing.assert_array_equal(np.concatenate(got), want)
    assert max(held) <= limit
    downloads = int(loader.caches[0].stats[1])
    assert len(index.shards) < downloads <= 2 * len(index.shards), downloads


def test_cache_limit_below_the_window_is_refused(shard_set, moto, tmp_path):
    with pytest.raises(BadInput, match=r"--cache-limit 1\.0K \(1024 bytes\) is below the look-ahead window of "
                                       r"s3://corpus/sets/set: 6 shards, up to .* \(\d+ bytes\)"):
        _loader("s3://corpus/sets/set/", tmp_path, limit_bytes=1024)


def test_dropped_connection_is_retried_and_logged(shard_set, http, tmp_path, caplog):
    http.faults["shard-000003.tar"] = ["drop", "503"]
    loader = _loader(f"{http.url}/set/", tmp_path)
    with caplog.at_level(logging.WARNING, logger="bert_ds.data.remote"):
        got = _ids(loader, 25 * 4)
    np.testing.assert_array_equal(got, _ids(build_loader(shard_set, num_workers=0, **_LOADER), 25 * 4))
    retries = [r.getMessage() for r in caplog.records if "shard-000003.tar" in r.getMessage()]
    assert len(retries) == 2 and "retry 1 of 5" in retries[0] and "retry 2 of 5" in retries[1], retries


def test_a_store_failing_through_every_try_is_retryable_not_bad_input(shard_set, http, tmp_path, monkeypatch):
    """Still 503 after every try: exit 1 (a supervisor restarts it from the newest checkpoint), naming the URL."""
    from bert_ds.data import remote
    from bert_ds.errors import exit_code_of

    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    http.faults["shard-000001.tar"] = ["503"] * remote.ATTEMPTS
    cache = ShardCache(f"{http.url}/set/", _options(tmp_path))
    with pytest.raises(remote.StoreUnavailable, match=rf"^{http.url}/set/shard-000001.tar: .* failed after "
                                                      rf"{remote.ATTEMPTS} tries \(.*503") as caught:
        cache.ensure(1)
    assert exit_code_of(caught.value) == 1 and not isinstance(caught.value, BadInput)
    assert not list(cache.dir.glob("shard-000001.tar*")) and not list(cache.dir.glob(".shard-000001.tar.*"))


def test_a_download_is_counted_before_its_shard_appears(shard_set, http, tmp_path, monkeypatch):
    """A reader that finds the shard in place (another thread's prefetch) may read the stats at once: the counts
    must already hold that download (the bounded-cache test above saw one short now and then)."""
    from bert_ds.data import shard_cache

    cache = ShardCache(f"{http.url}/set/", _options(tmp_path))
    seen, real_replace = [], os.replace

    def replace(src, dst):
        if Path(dst).name == "shard-000001.tar":
            seen.append((int(cache.stats[1]), int(cache.stats[0])))
        real_replace(src, dst)

    monkeypatch.setattr(shard_cache.os, "replace", replace)
    cache.ensure(1)
    assert seen == [(1, (shard_set / "shard-000001.tar").stat().st_size)]


def test_corrupt_object_refused_after_one_redownload(shard_set, http, tmp_path):
    http.faults["shard-000002.tar"] = ["corrupt", "corrupt"]
    cache = ShardCache(f"{http.url}/set/", _options(tmp_path))
    with pytest.raises(RemoteError, match=rf"^{http.url}/set/shard-000002.tar: sha256 mismatch \(index.json says "
                                          r"[0-9a-f]{64}, the store served [0-9a-f]{64}\), also after one "
                                          r"re-download: shard shard-000002.tar of"):
        cache.ensure(2)
    assert http.served["shard-000002.tar"] == 2 * (shard_set / "shard-000002.tar").stat().st_size
    assert sorted(p.name for p in cache.dir.iterdir()) == [".locks", "index.json"]


def test_missing_shard_is_named(shard_set, moto, tmp_path):
    client = moto.client()
    for key in ("index.json", "shard-000000.tar", "shard-000001.tar"):
        client.copy_object(Bucket="corpus", Key=f"gap/{key}", CopySource={"Bucket": "corpus",
                                                                          "Key": f"sets/set/{key}"})
    report = verify_shard_set("s3://corpus/gap/", "size")
    assert report.errors[0].startswith("s3://corpus/gap/shard-000002.tar: missing on the store (shard "
                                       "shard-000002.tar, listed in s3://corpus/gap/index.json)")
    assert len(report.errors) == 6
    with pytest.raises(RemoteError, match=r"^s3://corpus/gap/shard-000004.tar: missing on the store"):
        ShardCache("s3://corpus/gap/", _options(tmp_path)).ensure(4)


def test_wrong_credentials_name_the_store(tmp_path):
    denied = MotoServer(auth=True)
    try:
        with environ(**s3_env(denied.endpoint)):
            with pytest.raises(RemoteError, match=rf"^s3://corpus \(endpoint {denied.endpoint}\): the store refused "
                                                  r"the credentials while reading s3://corpus/sets/set/index.json"):
                ShardCache("s3://corpus/sets/set/", _options(tmp_path))
            proc = subprocess.run([sys.executable, "-m", "bert_ds.cli", "verify-shards", "s3://corpus/sets/set/"],
                                  env=child_env(**s3_env(denied.endpoint)), capture_output=True, text=True)
    finally:
        denied.close()
    assert proc.returncode == 2
    assert proc.stderr.startswith("bert-ds-verify-shards: error: s3://corpus (endpoint"), proc.stderr


def test_full_cache_disk_is_a_storage_error(shard_set, moto, tmp_path):
    """The cache on a tmpfs with room for one shard (mounted here: root only): the second shard is StorageError
    (exit 74) naming the cache; the first stays verified, no partial file is left."""
    mount = tmp_path / "small"
    mount.mkdir()
    size = shard_set.joinpath("shard-000000.tar").stat().st_size
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={(size * 3 // 2 + 8191) // 4096 * 4096}", "tmpfs",
                           str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a small tmpfs: {done.stderr.decode().strip()}")
    try:
        cache = ShardCache("s3://corpus/sets/set/", CacheOptions(root=str(mount)))
        cache.ensure(0)
        with pytest.raises(StorageError, match=rf"^cache {cache.dir}: .* free on its file system, shard "
                                               r"shard-000001.tar"):
            cache.ensure(1)
        assert sorted(p.name for p in cache.dir.iterdir()) == [".locks", "index.json", "shard-000000.tar"]
    finally:
        subprocess.run(["umount", str(mount)], check=False)


_DOWNLOAD = """
import sys
from bert_ds.data.shard_cache import CacheOptions, ShardCache
ShardCache(sys.argv[1], CacheOptions(root=sys.argv[2])).ensure(int(sys.argv[3]))
"""


def test_killed_download_leaves_no_shard(shard_set, http, tmp_path):
    """A download killed with SIGKILL mid-body leaves only its ``.part`` file; the next process to take the shard's
    lock removes it and downloads the verified shard."""
    http.faults["shard-000001.tar"] = ["stall"]
    root = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", _DOWNLOAD, f"{http.url}/set/", str(root), "1"], env=child_env())
    deadline = time.monotonic() + 60
    parts = []
    while not parts and time.monotonic() < deadline:
        parts = [p for p in root.rglob(".shard-000001.tar.*.part") if p.stat().st_size > 0]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert parts and not list(root.rglob("shard-000001.tar"))
    cache = ShardCache(f"{http.url}/set/", CacheOptions(root=str(root)))
    assert not list(cache.dir.glob("*.part"))  # removed at start: its holder is dead
    cache.ensure(1)
    assert (cache.dir / "shard-000001.tar").read_bytes() == (shard_set / "shard-000001.tar").read_bytes()


def test_create_shards_uploads_to_s3_and_verify_shards_reads_it(tokenizer_dir, english_corpus, moto, tmp_path):
    from bert_ds.data.create import create_shards

    index = create_shards([english_corpus], tokenizer_dir, "s3://corpus/made/s128/", seq_len=128, seed=1,
                          samples_per_shard=2000, progress=False)
    client = moto.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="corpus", Prefix="made/")["Contents"]]
    assert sorted(keys) == sorted([f"made/s128/{s.name}" for s in index.shards] + ["made/s128/index.json"])
    report = verify_shard_set("s3://corpus/made/s128/", "sha256")
    assert report.ok and report.shards == len(index.shards), report.errors
    with pytest.raises(BadInput, match=r"index.json already exists; pass --overwrite"):
        create_shards([english_corpus], tokenizer_dir, "s3://corpus/made/s128/", seq_len=128, progress=False)


@pytest.mark.parametrize("shuffle", [True, False])
def test_window_covers_what_the_next_batches_read(shuffle):
    """``EpochOrder.shards_for`` (the prefetch window) holds every shard the positions it is asked for read, across
    an epoch boundary, in first-read order."""
    counts = [7, 13, 5, 9, 11, 3, 8]
    order = EpochOrder(counts, seed=3, shuffle=shuffle, window_shards=2)
    starts = np.concatenate([[0], np.cumsum(counts)])
    n = int(starts[-1])
    for first in range(0, 3 * n - 20, 5):
        window = order.shards_for(first, first + 20, 1)
        read = []
        for pos in range(first, first + 20):
            epoch, p = divmod(pos, n)
            sample = int(order.ids(epoch, p, p + 1)[0])
            shard = int(np.searchsorted(starts, sample, side="right")) - 1
            if shard not in read:
                read.append(shard)
        assert set(read) <= set(window[:len(window)])
        assert len(window) == len(set(window))


def test_sources_take_urls_and_weights():
    assert [(s.path, s.weight) for s in parse_sources("s3://b/wiki128/:3,https://h:8443/books128/:1", "--data")] == [
        ("s3://b/wiki128/", 3.0), ("https://h:8443/books128/", 1.0)]
    assert [(s.path, s.name) for s in parse_sources("gs://b/set", "--data")] == [("gs://b/set", "set")]
    assert parse_size("200G") == 200 << 30 and parse_size("1.5M") == 3 << 19
    with pytest.raises(BadInput, match="--cache-limit '2X'"):
        parse_size("2X")


def test_eval_loader_and_mix_read_urls(shard_set, http, tmp_path):
    """``--eval-data`` and a weighted mix's source at a URL give the batches of their local copies."""
    from bert_ds.data.loader import Source, build_eval_loader
    from bert_ds.data.shard_cache import set_default_options

    set_default_options(_options(tmp_path))
    local = [b["input_ids"] for b in build_eval_loader(shard_set, micro_batch_size=8)]
    remote = [b["input_ids"] for b in build_eval_loader(f"{http.url}/set/", micro_batch_size=8)]
    assert len(local) == len(remote) == 50 and all((a == b).all() for a, b in zip(local, remote, strict=True))
    other = tmp_path / "other"
    write_synthetic_shards(other, num_samples=120, samples_per_shard=40, seed=11, **_SPECIALS)
    mixes = [[Source(str(shard_set), 3.0), Source(str(other), 1.0)],
             [Source(f"{http.url}/set/", 3.0), Source(str(other), 1.0)]]
    got = [[b["input_ids"] for _, b in zip(range(40), build_loader(m, num_workers=0, **_LOADER), strict=False)]
           for m in mixes]
    assert all((a == b).all() for a, b in zip(*got, strict=True))


def test_gs_without_gcsfs_names_the_package():
    from bert_ds.data.remote import Store

    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(BadInput, match=r"^gs://bucket/set: reading gs:// needs the Python package 'gcsfs'"):
        Store("gs://bucket/set").read("index.json", "reading")


def test_cache_dir_on_a_network_file_system_is_refused(tmp_path):
    """Pre-flight refuses a --cache-dir on NFS when a set is read from a URL (the cache is per node), and says
    nothing about it when every set is a directory; the default root is the Slurm job's node-local one."""
    from bert_ds.runtime.preflight import RunArgs, _cache_options, default_shard_cache_dir

    mounts = "server:/export /mnt/shared nfs4 rw,relatime 0 0\n/dev/sda1 / ext4 rw 0 0\n"
    args = RunArgs(recipe="r.json", output="run", tokenizer="tok", cache_dir="/mnt/shared/cache")
    from bert_ds.data.shard_cache import default_options, set_default_options

    before = default_options()
    try:
        with pytest.raises(BadInput, match=r"^--cache-dir /mnt/shared/cache is on a network file system \(nfs4 "
                                           r"mounted at /mnt/shared\)"):
            _cache_options(args, True, mounts)
        _cache_options(args, False, mounts)
    finally:
        set_default_options(before)
    assert default_shard_cache_dir({"SLURM_JOB_ID": "42", "TMPDIR": "/local"}) == "/local/bert_ds-42/shards"
    assert default_shard_cache_dir({}) == "/tmp/bert_ds-shards"
