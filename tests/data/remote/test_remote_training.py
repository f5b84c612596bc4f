"""Training straight from a store (issue 33) on real DeepSpeed CPU ranks: ``tiny_cpu`` read from ``s3://`` (moto's
server, its own process) and from ``https://`` (Python's http.server with a throw-away certificate) ends in
checkpoints equal tensor for tensor to the run from a local copy of the same shards; kill -9 while a prefetch is in
flight resumes bit-exact with no partial file taken for a shard; refusals before compute (credentials, a missing
shard, a cache limit below the look-ahead window) and a full cache disk end the run as docs/data.md says.
One local reference run is shared by the module."""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from bert_ds.data.index import ShardIndex
from tests.helpers import HANG_GUARD_S, child_env
from tests.helpers.object_store import HttpStore, MotoServer, s3_env, self_signed_cert
from tests.helpers.ranks import REPO, rank_command, run_ranks, spawn_ranks
from tests.helpers.runs import tensorboard_scalars, weights, write_recipe

pytestmark = pytest.mark.e2e

_TINY_CPU = json.loads((REPO / "ds_configs" / "tiny_cpu.json").read_text())
# tiny_cpu's phase 1, cut to 6 steps (checkpoints at 3 and 6) with one shard per shuffle window, so the look-ahead
# window moves across shards within the run; the shard set (4 shards) covers ~1.2 epochs.
_PHASE = {**_TINY_CPU["phases"][0], "steps": 6, "global_batch_size": 8, "micro_batch_size": 2,
          "checkpoint_interval": 3, "eval_interval": 0, "shuffle_window_shards": 1}
_FINAL = "phase1-step000006"
_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A seq-128 synthetic shard set (4 shards of 10 samples) and its tokenizer; the recipe; the local run."""
    from bert_ds.data.synthetic import write_synthetic_shards
    from bert_ds.data.tokenizer import vocab_sha256

    root = tmp_path_factory.mktemp("remote_training")
    (root / "tokenizer").mkdir()
    vocab = root / "tokenizer" / "vocab.txt"
    vocab.write_text("\n".join(_SPECIALS + [f"tok{i}" for i in range(12000 - len(_SPECIALS))]) + "\n")
    write_synthetic_shards(root / "store" / "s128", num_samples=40, samples_per_shard=10, seq_len=128,
                           max_predictions=20, vocab_size=12000, seed=3, vocab_sha256=vocab_sha256(vocab),
                           cls_id=2, sep_id=3, mask_id=4)
    recipe = write_recipe(root / "recipe.json", base=_TINY_CPU, logging={**_TINY_CPU["logging"], "interval": 1},
                          phases=[_PHASE])
    info = {"root": root, "local": root / "store" / "s128", "tokenizer": root / "tokenizer", "recipe": recipe}
    info["reference"] = root / "local_run"
    _pretrain(info, str(info["local"]), info["reference"])
    return info


def _args(data: dict, source: str, run: Path, *extra: str) -> list[str]:
    return ["--recipe", str(data["recipe"]), "--phase", "1", "--data", source, "--tokenizer", str(data["tokenizer"]),
            "--output", str(run), "--num-workers", "1", "--cache-dir", str(run.parent / f"{run.name}_cache"),
            *extra]


def _pretrain(data: dict, source: str, run: Path, *extra: str, nprocs: int = 2, check: bool = True,
              **env: str) -> subprocess.CompletedProcess:
    """Ranks spawned directly (:func:`~tests.helpers.ranks.spawn_ranks`) when more than one: the store is under test
    here, not the launch."""
    if nprocs == 1:
        return run_ranks(rank_command(1, _args(data, source, run, *extra)), check=check, **env)
    return spawn_ranks(nprocs, _args(data, source, run, *extra), check=check, **env)


def _assert_same_weights(run: Path, reference: Path, tag: str = _FINAL) -> None:
    got, want = weights(run, tag), weights(reference, tag)
    assert got.keys() == want.keys()
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{tag}: {len(differ)} of {len(want)} tensors differ from the local run, e.g. {differ[:3]}"


def _assert_only_verified(cache_root: Path, index: ShardIndex) -> None:
    """Every file under a shard's name in the cache is that shard, byte for byte (sha256 of index.json)."""
    sha = {s.name: s.sha256 for s in index.shards}
    for path in cache_root.rglob("shard-*.tar"):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha[path.name], f"{path}: not the verified shard"


@pytest.fixture(scope="module")
def moto(data):
    server = MotoServer()
    server.put_set(data["local"], "corpus", "sets/s128")
    yield server
    server.close()


def test_training_from_s3_equals_local_run(data, moto, tmp_path):
    """2 ranks read the set from s3:// through the node-local cache: the final checkpoint is the local run's, tensor
    for tensor; the loader's wait and the bytes downloaded are in TensorBoard; the cache holds only verified shards."""
    run = tmp_path / "s3_run"
    _pretrain(data, "s3://corpus/sets/s128/", run, **s3_env(moto.endpoint))
    _assert_same_weights(run, data["reference"])
    scalars = tensorboard_scalars(run / "tensorboard")
    assert "data/phase1/loader_wait_s" in scalars and "data/phase1/store/downloaded_bytes" in scalars
    _assert_only_verified(tmp_path / "s3_run_cache", ShardIndex.load(data["local"]))
    assert not list((tmp_path / "s3_run_cache").rglob("*.part"))


def test_training_from_https_equals_local_run(data, tmp_path):
    """The same over https:// (TLS, the certificate trusted through SSL_CERT_FILE), one shard's first GET dropped
    mid-body and retried."""
    cert, key = self_signed_cert(tmp_path)
    store = HttpStore(data["root"] / "store", tls=(cert, key))
    store.faults["shard-000001.tar"] = ["drop"]
    try:
        run = tmp_path / "https_run"
        proc = _pretrain(data, f"{store.url}/s128/", run, SSL_CERT_FILE=str(cert))
    finally:
        store.close()
    _assert_same_weights(run, data["reference"])
    assert "retry 1 of" in proc.stdout + proc.stderr


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every process below it (the supervisor, DeepSpeed's launcher, the ranks and their
    loader workers, each possibly in its own process group), at once."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=60)


def test_kill9_with_prefetch_in_flight_resumes_exactly(data, tmp_path):
    """The shard of the fourth shuffle window (first read by step 4, prefetched during step 3) stalls mid-body; the
    run is killed with SIGKILL (every process of the job) once its step-3 checkpoint exists. The cache then holds that
    download's ``.part`` file and nothing unverified under a shard's name; ``--resume auto`` (the store now serving
    the shard) finishes with the local run's weights and no ``.part`` file left."""
    from bert_ds.data.epoch_order import EpochOrder

    index = ShardIndex.load(data["local"])
    order = EpochOrder([s.samples for s in index.shards], seed=_TINY_CPU["seed"], shuffle=True, window_shards=1)
    stalled = index.shards[order.shards_for(30, 31, 0)[0]].name
    store = HttpStore(data["root"] / "store")
    store.faults[stalled] = ["stall"]
    run, cache = tmp_path / "killed", tmp_path / "killed_cache"
    try:
        proc = subprocess.Popen(rank_command(2, _args(data, f"{store.url}/s128/", run)), cwd=REPO, env=child_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + HANG_GUARD_S
        while not (run / "checkpoints" / "latest").is_file() and time.monotonic() < deadline:
            assert proc.poll() is None, f"the run ended ({proc.returncode}) before its step-3 checkpoint"
            time.sleep(0.2)
        _kill_tree(proc.pid)
        assert list(cache.rglob(f".{stalled}.*.part")), "the stalled download should have been in flight"
        _assert_only_verified(cache, index)
        _pretrain(data, f"{store.url}/s128/", run, "--resume", "auto")
    finally:
        store.close()
    _assert_same_weights(run, data["reference"])
    _assert_only_verified(cache, index)
    assert not list(cache.rglob("*.part"))


def test_refusals_before_compute(data, moto, tmp_path):
    """Credentials refused, a shard missing on the store, a cache limit below the look-ahead window: exit 2 with one
    line naming the store / URL and shard / both numbers, before any compute (nothing written under --output)."""
    denied = MotoServer(auth=True)
    try:
        run = tmp_path / "denied"
        proc = _pretrain(data, "s3://corpus/sets/s128/", run, nprocs=1, check=False, **s3_env(denied.endpoint))
    finally:
        denied.close()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"s3://corpus (endpoint {denied.endpoint}): the store refused the credentials" in proc.stderr
    assert not (run / "checkpoints").exists()

    client = moto.client()
    for key in ("index.json", "shard-000000.tar", "shard-000001.tar", "shard-000003.tar"):
        client.copy_object(Bucket="corpus", Key=f"gap/{key}", CopySource={"Bucket": "corpus",
                                                                          "Key": f"sets/s128/{key}"})
    run = tmp_path / "gap"
    proc = _pretrain(data, "s3://corpus/gap/", run, nprocs=1, check=False, **s3_env(moto.endpoint))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "s3://corpus/gap/shard-000002.tar: missing on the store (shard shard-000002.tar" in proc.stderr

    run = tmp_path / "small"
    proc = _pretrain(data, "s3://corpus/sets/s128/", run, "--cache-limit", "10K", nprocs=1, check=False,
                     **s3_env(moto.endpoint))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--cache-limit 10.0K (10240 bytes) is below the look-ahead window" in proc.stderr
    assert not (run / "checkpoints").exists()


def test_full_cache_disk_exits_74_keeping_the_checkpoint(data, moto, tmp_path):
    """The cache on a tmpfs mounted by the test (root only) with room for index.json and one shard: resumed from
    the local run's step-3 checkpoint, the run exits 74 naming the cache when the next shard does not fit; the
    checkpoint it resumed from is intact and no partial file is left."""
    cache = tmp_path / "run_cache"
    cache.mkdir()
    size = (max(s.bytes for s in ShardIndex.load(data["local"]).shards) * 3 // 2 + 8191) // 4096 * 4096
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(cache)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        run = tmp_path / "run"
        shutil.copytree(data["reference"], run)
        shutil.rmtree(run / "checkpoints" / _FINAL)
        (run / "checkpoints" / "latest").write_text("phase1-step000003")
        before = {p: p.read_bytes() for p in (run / "checkpoints" / "phase1-step000003").rglob("*") if p.is_file()}
        proc = _pretrain(data, "s3://corpus/sets/s128/", run, "--resume", "auto", nprocs=1, check=False,
                         **s3_env(moto.endpoint))
        assert proc.returncode == 74, proc.stderr[-3000:]
        assert f"cache {cache}" in proc.stderr
        after = {p: p.read_bytes() for p in (run / "checkpoints" / "phase1-step000003").rglob("*") if p.is_file()}
        assert after == before
        assert not list(cache.rglob("*.part"))
        _assert_only_verified(cache, ShardIndex.load(data["local"]))
    finally:
        subprocess.run(["umount", str(cache)], check=False)


def test_resume_from_the_store_on_another_rank_count(data, moto, tmp_path):
    """The local 2-rank run's step-3 checkpoint resumed on 1 rank reading s3://: the same samples are consumed and
    the final weights are within the data-parallel rounding floor of the uninterrupted run (``param_diffs``)."""
    from tests.helpers.runs import assert_close_params

    run = tmp_path / "moved"
    shutil.copytree(data["reference"], run)
    shutil.rmtree(run / "checkpoints" / _FINAL)
    shutil.rmtree(run / "tensorboard")
    (run / "checkpoints" / "latest").write_text("phase1-step000003")
    _pretrain(data, "s3://corpus/sets/s128/", run, "--resume", "auto", nprocs=1, **s3_env(moto.endpoint))
    state = json.loads((run / "checkpoints" / _FINAL / "run_state.json").read_text())
    want = json.loads((data["reference"] / "checkpoints" / _FINAL / "run_state.json").read_text())
    assert state["world_size"] == 1 and state["consumed_samples"] == want["consumed_samples"]
    assert_close_params(weights(run, _FINAL), weights(data["reference"], _FINAL), "2 -> 1 ranks from s3")
