"""Session fixtures shared by all bert_ds tests: a real English corpus built from text on every Debian machine, a
WordPiece vocabulary trained on it, and small shard sets at sequence length 128 and 512. No network. Each is built
once per test session, whichever worker asks first (``tests.helpers.shared.built_once``), and only read."""

from __future__ import annotations

import os

# Triton fixes interpreter mode at its first import, and the model (imported by several test dirs) imports it: the
# kernel tests run the Triton kernels on the CPU only if this is set before anything else is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

from bert_ds.data.english_corpus import build_english_corpus
from tests.helpers.shared import built_once, session_root


@pytest.fixture(scope="session")
def english_corpus(tmp_path_factory) -> Path:
    """Path to a real English corpus (GPL/Apache/... license texts + Python stdlib docstrings) in BERT layout."""
    return built_once(tmp_path_factory, "corpus", lambda d: build_english_corpus(d / "english.txt")) / "english.txt"


@pytest.fixture(scope="session")
def tokenizer_dir(english_corpus, tmp_path_factory) -> Path:
    """An uncased WordPiece vocabulary (4,000 tokens) trained on ``english_corpus``."""
    from bert_ds.data.tokenizer import train_tokenizer

    return built_once(tmp_path_factory, "tokenizer",
                      lambda d: train_tokenizer([english_corpus], d, vocab_size=4000))


@pytest.fixture(scope="session")
def shards_128(english_corpus, tokenizer_dir, tmp_path_factory) -> Path:
    """A seq-128 shard set (seed 1234, dupe factor 2, several shards of ~1,000 samples) with its index.json."""
    from bert_ds.data.create import create_shards

    return built_once(tmp_path_factory, "shards_128", lambda out: create_shards(
        [english_corpus], tokenizer_dir, out, seq_len=128, dupe_factor=2, seed=1234, samples_per_shard=1000,
        progress=False))


@pytest.fixture(scope="session")
def shards_512(english_corpus, tokenizer_dir, tmp_path_factory) -> Path:
    """A seq-512 shard set (seed 1234, dupe factor 2, several shards of ~250 samples) with its index.json."""
    from bert_ds.data.create import create_shards

    return built_once(tmp_path_factory, "shards_512", lambda out: create_shards(
        [english_corpus], tokenizer_dir, out, seq_len=512, dupe_factor=2, seed=1234, samples_per_shard=250,
        progress=False))


@pytest.fixture(scope="session")
def fault_reference_run(shards_128, shards_512, tokenizer_dir, tmp_path_factory) -> Path:
    """The fault tables' recipe (``tests.helpers.faults.fault_recipe``) trained uninterrupted on 2 real DeepSpeed CPU
    ranks, once per session: the run every resume of that recipe is compared with, bit for bit."""
    from tests.helpers.faults import train_fault_run

    return built_once(tmp_path_factory, "fault_reference",
                      lambda root: train_fault_run(root, shards_128, shards_512, tokenizer_dir)) / "run"


@pytest.fixture(scope="session")
def compile_cache_env(tmp_path_factory) -> dict[str, str]:
    """``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` for a process that compiles with inductor: one directory
    pair per test session, shared by every worker and rank (inductor writes its entries atomically), so a graph a
    test compiled is not generated and built again by the next test that compiles the same one."""
    root = session_root(tmp_path_factory)
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / "shared-inductor-cache"),
            "TRITON_CACHE_DIR": str(root / "shared-triton-cache")}


@pytest.fixture(scope="session")
def mix_shards_128(tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    """Seq-128 shard sets of two different real texts, one per source of a mix: ``licenses`` (every licence text,
    ~1.1k samples) and ``stdlib`` (standard-library docstrings, ~3.9k samples), in shards of 300 samples."""
    from bert_ds.data.create import create_shards
    from bert_ds.data.english_corpus import build_corpus_by_kind

    def build(root: Path) -> None:
        for name, text in build_corpus_by_kind(root / "text").items():
            create_shards([text], tokenizer_dir, root / f"{name}128", seq_len=128, dupe_factor=2, seed=1234,
                          samples_per_shard=300, progress=False)

    root = built_once(tmp_path_factory, "mix_sources", build)
    return {path.name.removesuffix("128"): path for path in sorted(root.glob("*128"))}


def read_shard_set(directory: Path) -> list[tuple[str, str, object]]:
    """Every sample of a shard set as (shard name, member name, ``Sample``), in index order."""
    import tarfile

    import numpy as np

    from bert_ds.data.format import decode_sample
    from bert_ds.data.index import ShardIndex

    index = ShardIndex.load(directory)
    dtype = np.dtype(index.id_dtype)
    out = []
    for shard in index.shards:
        with tarfile.open(Path(directory) / shard.name) as tar:
            for member in tar:
                data = tar.extractfile(member).read()
                out.append((shard.name, member.name, decode_sample(data, dtype, where=f"{shard.name}/{member.name}")))
    return out


@pytest.fixture(scope="session")
def shard_reader():
    """``read_shard_set``: a function reading every (shard, member, Sample) of a shard directory."""
    return read_shard_set


@pytest.fixture(scope="session", autouse=True)
def _release_leaked_deepspeed_shm():
    """Ranks the tests kill (-9, SIGTERM) cannot unlink DeepSpeed's CPU all-reduce buffers in /dev/shm, which is RAM:
    remove the ones this session created that no process maps any more, so a long suite does not fill memory
    (bert_ds.runtime.distributed.release_shm_buffers does this for runs that end normally). A buffer still mapped
    belongs to a live run -- another pytest session's on this machine: deleting it left that run's rank 0 spinning in
    DeepSpeed's ``shm_initialize`` for ever, waiting for its peer's buffer (seen 2026-11-27 with two sessions)."""
    import time

    from bert_ds.lifecycle.restart import mapped_shm_paths

    start = time.time() - 1
    yield
    mapped = mapped_shm_paths()
    for seg in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"):
        try:
            if seg.stat().st_mtime >= start and str(seg) not in mapped:
                seg.unlink()
        except OSError:
            continue


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: the order is by what runs
def pytest_collection_modifyitems(config, items):
    """Heaviest test files first, so the two workers of ``make test`` finish together (``tests.helpers.schedule``)."""
    from tests.helpers.schedule import heaviest_files_first

    heaviest_files_first(items)


def pytest_configure(config):
    """A test worker's share of the cores for torch's intra-op threads, as a rank gets its share
    (``bert_ds.runtime.distributed``): ``make test`` runs 2 workers on 2 cores, and in-process fine-tunes left at
    torch's default (a thread per core) spin in OpenMP barriers while the other worker's ranks hold the cores.
    Measured per test (CPU seconds, full run, 2026-11-28): SWAG 72 s alone, 205 s in the suite; one thread, 66 s."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 0 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_resources: dict[str, bool] = {}


def pytest_runtest_setup(item):
    """A test marked ``slurm``, ``mpi`` or ``gpu`` skips when this machine lacks it (each probed once a session)."""
    from tests.helpers.tiers import NEEDS

    for name, (probe, reason) in NEEDS.items():
        if item.get_closest_marker(name) is not None:
            if name not in _resources:
                _resources[name] = probe()
            if not _resources[name]:
                pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test not marked ``e2e`` that starts ranks -- in its body or in a fixture it sets up or tears down, whatever
    the fixture's scope -- fails at that call, naming the command (``tests.helpers.tiers``): the default tier stays
    one that runs in minutes."""
    if item.get_closest_marker("e2e") is not None:
        yield
        return
    from tests.helpers.tiers import refuse_rank_launches

    with refuse_rank_launches(item.nodeid):
        yield


@pytest.fixture(autouse=True)
def _no_launcher_variables_leak():
    """A test that leaves RANK, MASTER_ADDR, ... in this process's environment fails here, naming them: every process
    a later test starts would inherit them (tests.helpers.child_env drops them too, as a second line)."""
    from tests.helpers import LAUNCHER_VARS

    before = {var: os.environ.get(var) for var in LAUNCHER_VARS}
    yield
    after = {var: os.environ.get(var) for var in LAUNCHER_VARS}
    leaked = {var: value for var, value in after.items() if value != before[var]}
    for var, value in before.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    assert not leaked, f"the test changed launcher variables in the test process's environment: {leaked}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Say how to run the Slurm tests when they skipped for want of a controller (``make test`` starts one when the
    user may: root or passwordless sudo, Slurm installed)."""
    skipped = [rep for rep in terminalreporter.stats.get("skipped", [])
               if "Slurm controller" in (rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr))]
    if not skipped:
        return
    terminalreporter.section("Slurm tests skipped")
    terminalreporter.write_line(f"{len(skipped)} test(s) need a Slurm controller and none answered:")
    for rep in skipped:
        terminalreporter.write_line(f"  {rep.nodeid}")
    terminalreporter.write_line("Run them with the one-node cluster CI uses (Debian packages slurm-wlm and munge):")
    terminalreporter.write_line("  sudo .ci/start_slurm.sh && make test    (as root: .ci/start_slurm.sh && make test)")


@pytest.fixture(autouse=True)
def _no_worker_processes_leak(request):
    """A test that leaves a multiprocessing child of this process running (a loader pool never closed) fails here,
    naming it: pytest would wait for it at exit (loader workers ignore SIGTERM, bert_ds.data.workers)."""
    import gc
    import multiprocessing
    import time

    before = {p.pid for p in multiprocessing.active_children()}
    yield
    # A generous hang guard, not a speed check: a pool only reachable through a reference cycle (an exception's
    # traceback holding the iterator's frame) is freed by the collector, and a loaded machine stops workers slowly.
    deadline = time.monotonic() + 120
    leaked = [p for p in multiprocessing.active_children() if p.pid not in before]
    while leaked and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.2)
        leaked = [p for p in multiprocessing.active_children() if p.pid not in before and p.is_alive()]
    for p in leaked:
        p.kill()
        try:
            p.join(5)
        except RuntimeError:  # torch's SIGCHLD handler reporting the kill, if the pool's iterator is still alive
            pass
    assert not leaked, f"the test left {len(leaked)} worker process(es) running: {[p.name for p in leaked]}"
