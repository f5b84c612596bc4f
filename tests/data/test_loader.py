"""Training/eval loader guarantees on real tar shards: exactly-once, world-size invariance, exact resume, masking.

Ranks are simulated in-process here (one loader per rank); tests/data/test_loader_distributed.py uses real
processes. The shard set has 1,000 samples in 8 uneven shards; with G=64 an epoch is 15 global batches (960
samples, 40 dropped)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from bert_ds.data.batch import BATCH_KEYS, IGNORE_INDEX, check_batch
from bert_ds.data.loader import DynamicMasking, build_eval_loader, build_loader
from bert_ds.data.reader import ShardError, ShardReader
from bert_ds.data.synthetic import ID_BASE, sample_ids_of_batch, write_synthetic_shards
from bert_ds.data.tokenizer import continuation_table, read_vocab

N, PER_SHARD, SEQ, MAXP = 1000, 130, 64, 10
# [CLS], [SEP], [MASK] in bert_ds's special-token order (tokenizer.SPECIAL_TOKENS): the synthetic shards' specials.
SPECIAL_IDS = {"cls_id": 2, "sep_id": 3, "mask_id": 4}
MASK = SPECIAL_IDS["mask_id"]
G = 64
PER_EPOCH = N // G


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader") / "shards"
    write_synthetic_shards(path, num_samples=N, samples_per_shard=PER_SHARD, seq_len=SEQ, max_predictions=MAXP,
                           **SPECIAL_IDS)
    return path


def _loaders(data, world, micro, **kw):
    return [build_loader(data, global_batch_size=G, micro_batch_size=micro, rank=r, world_size=world, **kw)
            for r in range(world)]


def _global_batches(loaders, count):
    """Reassemble ``count`` global batches from per-rank loaders: micro step a of rank r is slice (a*W + r)."""
    world = len(loaders)
    gas = loaders[0].gradient_accumulation_steps
    streams = [iter(loader) for loader in loaders]
    out = []
    for _ in range(count):
        parts = [[None] * world for _ in range(gas)]
        for r, stream in enumerate(streams):
            for a in range(gas):
                parts[a][r] = next(stream)
        flat = [p for step in parts for p in step]
        out.append({k: torch.cat([p[k] for p in flat]) for k in BATCH_KEYS})
    return out


def _assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for i, (a, b) in enumerate(zip(batches_a, batches_b, strict=True)):
        for k in BATCH_KEYS:
            assert torch.equal(a[k], b[k]), f"global batch {i}, field {k}"


def test_batch_layout(data):
    (loader,) = _loaders(data, 1, 16, num_workers=0)
    batch = next(iter(loader))
    assert check_batch(batch, seq_len=SEQ, max_predictions=MAXP) == {"B": 16, "S": SEQ, "P": MAXP}
    reader = ShardReader(data)
    for row, gid in enumerate(sample_ids_of_batch(batch)):  # default = the static masks stored in the shards
        s = reader.get(int(gid))
        n, k = s.length, len(s.masked_positions)
        assert batch["lengths"][row] == n
        assert batch["input_ids"][row, :n].tolist() == s.input_ids.tolist() and not batch["input_ids"][row, n:].any()
        assert batch["attention_mask"][row].sum() == n
        assert batch["token_type_ids"][row].tolist() == s.segment_ids().tolist() + [0] * (SEQ - n)
        assert batch["masked_lm_positions"][row, :k].tolist() == s.masked_positions.tolist()
        assert batch["masked_lm_ids"][row, :k].tolist() == s.masked_ids.tolist()
        assert (batch["masked_lm_ids"][row, k:] == IGNORE_INDEX).all()
        assert batch["next_sentence_label"][row] == s.nsp_label


def test_two_ranks_two_workers_exactly_once_per_epoch(data):
    loaders = _loaders(data, 2, 8, num_workers=2)
    gas = loaders[0].gradient_accumulation_steps
    assert gas == 4
    epochs = []
    for _ in range(2):
        seen = []
        for loader in loaders:  # each rank consumes its share of one epoch, in its own worker processes
            for batch in itertools.islice(iter(loader), PER_EPOCH * gas):
                seen.extend(sample_ids_of_batch(batch).tolist())
        assert len(seen) == len(set(seen)) == PER_EPOCH * G
        assert set(seen) <= set(range(N))
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # a fresh order each epoch
    assert set(epochs[0]) != set(epochs[1])  # ... and a different dropped tail


def test_global_batches_invariant_to_world_size_and_workers(data):
    count = PER_EPOCH + 3  # crosses an epoch boundary
    reference = _global_batches(_loaders(data, 1, 16, num_workers=0), count)
    for world, micro, workers in [(1, 64, 2), (2, 8, 0), (2, 32, 1), (4, 4, 0), (4, 16, 2)]:
        _assert_same(_global_batches(_loaders(data, world, micro, num_workers=workers), count), reference)
    other_seed = _global_batches(_loaders(data, 1, 64, num_workers=0, seed=1), 2)
    assert not torch.equal(other_seed[0]["input_ids"], reference[0]["input_ids"])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_same_world_mid_global_batch(data, workers):
    (full,) = _loaders(data, 1, 16, num_workers=workers)
    expected = list(itertools.islice(iter(full), 12))
    (first,) = _loaders(data, 1, 16, num_workers=workers)
    it = iter(first)
    for _ in range(5):  # 5 micro batches = 1 global batch + 1 micro step; workers have prefetched more
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["consumed_global_batches"] == 1 and state["micro_steps_into_global_batch"] == 1
    (second,) = _loaders(data, 1, 16, num_workers=workers)
    second.load_state_dict(state)
    rest = list(itertools.islice(iter(second), 7))
    for a, b in zip(rest, expected[5:], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in BATCH_KEYS)


@pytest.mark.parametrize(("new_world", "new_micro", "stop"), [(1, 32, 4), (4, 8, 4), (4, 4, PER_EPOCH - 2)])
def test_resume_across_world_size_change(data, new_world, new_micro, stop):
    """Train on 2 ranks, stop after ``stop`` global batches, resume on ``new_world`` ranks (also across an epoch)."""
    total = stop + 5
    reference = _global_batches(_loaders(data, 1, 64, num_workers=0), total)
    before = _loaders(data, 2, 8, num_workers=0)
    head = _global_batches(before, stop)
    states = [loader.state_dict() for loader in before]
    assert states[0]["consumed_global_batches"] == states[1]["consumed_global_batches"] == stop
    after = _loaders(data, new_world, new_micro, num_workers=1)
    for loader in after:
        loader.load_state_dict(json.loads(json.dumps(states[0])))
    tail = _global_batches(after, total - stop)
    _assert_same(head + tail, reference)


def test_mid_global_batch_state_refused_on_world_change(data):
    (loader,) = _loaders(data, 1, 16, num_workers=0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    rank0, _ = _loaders(data, 2, 16, num_workers=0)
    with pytest.raises(ValueError, match="1 micro step.*global-batch boundary"):
        rank0.load_state_dict(state)


def test_state_from_another_stream_refused(data):
    (loader,) = _loaders(data, 1, 16, num_workers=0)
    state = loader.state_dict()
    (other,) = _loaders(data, 1, 16, num_workers=0, seed=7)
    with pytest.raises(ValueError, match="field 'seed' is 0 but this loader has 7"):
        other.load_state_dict(state)


def test_batch_size_must_divide(data):
    with pytest.raises(ValueError, match="global_batch_size=64 is not a multiple of micro_batch_size"):
        build_loader(data, global_batch_size=64, micro_batch_size=12, world_size=2)
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        build_loader(data, global_batch_size=64, micro_batch_size=8, rank=2, world_size=2)


def test_unshuffled_order_is_index_order(data):
    (loader,) = _loaders(data, 1, 64, num_workers=0, shuffle=False)
    ids = np.concatenate([sample_ids_of_batch(b) for b in itertools.islice(iter(loader), 2)])
    assert ids.tolist() == list(range(128))


def test_small_shuffle_window_still_exactly_once(data):
    (loader,) = _loaders(data, 1, 64, num_workers=0, shuffle_window_shards=2)
    ids = np.concatenate([sample_ids_of_batch(b) for b in itertools.islice(iter(loader), PER_EPOCH)])
    assert len(set(ids.tolist())) == PER_EPOCH * G


def test_dynamic_masking_deterministic_and_fresh_each_epoch(data):
    dyn = DynamicMasking(vocab_size=30522, mask_id=MASK, masked_lm_prob=0.3)
    (a,) = _loaders(data, 1, 64, num_workers=0, dynamic_masking=dyn)
    (b,) = _loaders(data, 1, 64, num_workers=2, dynamic_masking=dyn)
    batches_a = list(itertools.islice(iter(a), 2 * PER_EPOCH))
    batches_b = list(itertools.islice(iter(b), 2 * PER_EPOCH))
    for x, y in zip(batches_a, batches_b, strict=True):
        assert all(torch.equal(x[k], y[k]) for k in BATCH_KEYS)

    def masks_by_sample(batches):
        out = {}
        for batch in batches:
            for row, gid in enumerate(sample_ids_of_batch(batch)):
                out[int(gid)] = batch["masked_lm_positions"][row][batch["masked_lm_ids"][row] != IGNORE_INDEX]
        return out

    epoch0, epoch1 = masks_by_sample(batches_a[:PER_EPOCH]), masks_by_sample(batches_a[PER_EPOCH:])
    common = sorted(set(epoch0) & set(epoch1))
    changed = sum(not torch.equal(epoch0[g], epoch1[g]) for g in common)
    assert changed > 0.95 * len(common)

    # Rate: round(0.3 * eligible) predictions per sample (eligible = length - 3: no [CLS], two [SEP]).
    labels = torch.cat([x["masked_lm_ids"] for x in batches_a[:PER_EPOCH]])
    lengths = torch.cat([x["lengths"] for x in batches_a[:PER_EPOCH]])
    predicted = (labels != IGNORE_INDEX).sum(1)
    assert labels.shape[1] == 20  # seq 64: max(Google's round(0.15 * 64) = 10, ceil(0.3 * 64) = 20)
    rate = predicted.sum().item() / (lengths - 3).sum().item()
    assert 0.29 < rate < 0.31
    # 80/10/10 (BERT paper §3.1): the share of [MASK] among predicted positions.
    ids = torch.cat([x["input_ids"] for x in batches_a[:PER_EPOCH]])
    pos = torch.cat([x["masked_lm_positions"] for x in batches_a[:PER_EPOCH]])
    at = torch.gather(ids, 1, pos)[labels != IGNORE_INDEX]
    assert 0.77 < (at == MASK).float().mean().item() < 0.83


def test_dynamic_mask_is_a_function_of_the_sample_alone(data):
    """Batch of 64 on one rank, batch of 1 (64 micro steps), batches of 32 on rank 0 and rank 1 (and 2 workers): every
    sample of the first two global batches gets the same dynamic mask."""
    dyn = DynamicMasking(vocab_size=30522, mask_id=MASK, masked_lm_prob=0.3)
    layouts = {"1 rank x 64": _loaders(data, 1, 64, num_workers=0, dynamic_masking=dyn),
               "1 rank x 1": _loaders(data, 1, 1, num_workers=0, dynamic_masking=dyn),
               "2 ranks x 32": _loaders(data, 2, 32, num_workers=0, dynamic_masking=dyn),
               "2 ranks x 32, 2 workers": _loaders(data, 2, 32, num_workers=2, dynamic_masking=dyn)}
    rows = {}
    for name, loaders in layouts.items():
        by_sample = rows[name] = {}
        for loader in loaders:
            for batch in itertools.islice(iter(loader), 2 * loader.gradient_accumulation_steps):
                for row, gid in enumerate(sample_ids_of_batch(batch)):
                    by_sample[int(gid)] = {k: batch[k][row] for k in BATCH_KEYS}
    reference = rows.pop("1 rank x 64")
    assert len(reference) == 2 * G
    for name, by_sample in rows.items():
        assert by_sample.keys() == reference.keys(), name
        for gid, fields in by_sample.items():
            for k in BATCH_KEYS:
                assert torch.equal(fields[k], reference[gid][k]), (name, gid, k)


def test_dynamic_max_predictions_default(data):
    assert DynamicMasking(vocab_size=30522, mask_id=MASK).resolved_max_predictions(128) == 20
    assert DynamicMasking(vocab_size=30522, mask_id=MASK).resolved_max_predictions(512) == 80
    assert DynamicMasking(vocab_size=30522, mask_id=MASK, masked_lm_prob=0.3).resolved_max_predictions(128) == 39


def test_whole_word_dynamic_masking(data, tmp_path):
    vocab = [f"t{i}" if i < 20000 else f"##t{i}" for i in range(30522)]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    table = continuation_table(read_vocab(tmp_path))
    assert table.sum() == 30522 - 20000
    dyn = DynamicMasking(vocab_size=30522, mask_id=MASK, whole_word=True, vocab=tmp_path)
    (loader,) = _loaders(data, 1, 64, num_workers=0, dynamic_masking=dyn)
    for batch in itertools.islice(iter(loader), 3):
        original = batch["input_ids"].clone()
        labels, pos = batch["masked_lm_ids"], batch["masked_lm_positions"]
        rows, cols = torch.nonzero(labels != IGNORE_INDEX, as_tuple=True)
        original[rows, pos[rows, cols]] = labels[rows, cols]
        for row in range(original.shape[0]):
            chosen = set(pos[row][labels[row] != IGNORE_INDEX].tolist())
            n = int(batch["lengths"][row])
            ids = original[row, :n].numpy()
            for i in chosen:  # a word's pieces are masked together: the next piece continuing it is chosen too
                if i + 1 < n and table[ids[i + 1]]:
                    assert i + 1 in chosen


def test_no_silent_token_ids(tmp_path):
    """[MASK] is 4 in bert_ds vocabularies and 103 in Google's: neither dynamic masking nor the synthetic shards
    default any special token id."""
    with pytest.raises(TypeError, match="mask_id"):
        DynamicMasking(vocab_size=30522)
    with pytest.raises(TypeError, match="cls_id"):
        write_synthetic_shards(tmp_path, num_samples=10, samples_per_shard=10)
    with pytest.raises(ValueError, match=f"mask_id={ID_BASE} must be in"):
        write_synthetic_shards(tmp_path, num_samples=10, samples_per_shard=10, **{**SPECIAL_IDS, "mask_id": ID_BASE})


def test_whole_word_needs_vocab():
    with pytest.raises(ValueError, match="whole_word=True needs 'vocab'"):
        DynamicMasking(vocab_size=30522, mask_id=MASK, whole_word=True)


def test_dynamic_masking_vocab_size_checked(data):
    with pytest.raises(ValueError, match="field 'vocab_size' is 30522 but the run expects 4000"):
        build_loader(data, global_batch_size=G, micro_batch_size=64,
                     dynamic_masking=DynamicMasking(vocab_size=4000, mask_id=MASK))


def test_index_checked_against_run(data):
    with pytest.raises(ValueError, match="field 'seq_len' is 64 but the run expects 128"):
        build_loader(data, global_batch_size=G, micro_batch_size=64, expected_seq_len=128)
    with pytest.raises(ValueError, match="field 'vocab_sha256' is 'synthetic' but the run expects 'abc'"):
        build_loader(data, global_batch_size=G, micro_batch_size=64, expected_vocab_sha256="abc")
    with pytest.raises(ValueError, match="max_predictions=5 is below the 10"):
        build_loader(data, global_batch_size=G, micro_batch_size=64, max_predictions=5)


def test_corrupt_shard_clear_error(tmp_path):
    path = tmp_path / "shards"
    write_synthetic_shards(path, num_samples=200, samples_per_shard=100, seq_len=SEQ, max_predictions=MAXP,
                           **SPECIAL_IDS)
    shard = path / "shard-000001.tar"
    raw = bytearray(shard.read_bytes())
    raw[700] ^= 0xFF
    shard.write_bytes(bytes(raw))
    loader = build_loader(path, global_batch_size=200, micro_batch_size=100, num_workers=0, verify="sha256",
                          shuffle=False)
    with pytest.raises(ShardError, match=r"shard-000001\.tar: sha256 mismatch"):
        list(itertools.islice(iter(loader), 2))
    shard.write_bytes(bytes(raw[:-512]))
    with pytest.raises(ShardError, match=r"shard-000001\.tar: byte size mismatch"):
        build_loader(path, global_batch_size=200, micro_batch_size=100)


def test_eval_loader_exactly_once_unshuffled(data):
    seen = []
    for rank in range(2):
        loader = build_eval_loader(data, micro_batch_size=64, rank=rank, world_size=2, num_workers=rank)
        batches = list(loader)
        assert len(batches) == len(loader) == 8
        ids = [sample_ids_of_batch(b).tolist() for b in batches]
        assert ids[0] == list(range(rank * 64, rank * 64 + 64))
        seen.extend(i for b in ids for i in b)
    assert sorted(seen) == list(range(N))
    assert len(list(build_eval_loader(data, micro_batch_size=64))) == 16  # the last holds 40 rows


def test_a_dead_worker_is_recorded_then_raised_at_the_step_boundary(data, tmp_path):
    """A worker killed while the main process saves a checkpoint: the SIGCHLD handler only records the death, so the
    save runs to its end; :func:`raise_if_worker_died` (the trainer calls it at each step boundary) then raises it,
    naming the shard. SIGCHLD is masked in the main thread meanwhile and another thread is alive: the kernel hands the
    signal to that thread, and CPython still runs the handler in the main thread (why masking could not defer it)."""
    import multiprocessing
    import os
    import signal
    import threading
    import time

    from bert_ds.data import workers
    from bert_ds.data.workers import LoaderWorkerError, raise_if_worker_died
    from tests.helpers import HANG_GUARD_S

    others = {p.pid for p in multiprocessing.active_children()}  # workers of loaders earlier tests left to the GC
    loader = build_loader(data, global_batch_size=G, micro_batch_size=G, num_workers=1, shuffle=False,
                          prefetch_factor=1)
    stream = iter(loader)
    next(stream)
    pool = [p for p in multiprocessing.active_children() if p.pid not in others]
    assert pool and not workers._DIED
    bystander = threading.Event()
    thread = threading.Thread(target=bystander.wait)  # TensorBoard's writer, gloo's threads in a real run
    thread.start()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    written = 0
    try:
        for worker in pool:
            os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + HANG_GUARD_S
        while not workers._DIED:  # "the save": Python code writing files until the handler has run
            (tmp_path / f"part{written % 4}").write_bytes(os.urandom(4096))
            written += 1
            assert time.monotonic() < deadline, "the SIGCHLD handler never ran"
        for _ in range(100):  # and the save goes on to its end after the handler ran
            (tmp_path / "rest").write_bytes(os.urandom(4096))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        bystander.set()
        thread.join()
    with pytest.raises(LoaderWorkerError, match=r"worker 0 \(pid \d+\) was reading shards/shard-00000\d\.tar "
                                                r"member #\d+"):
        raise_if_worker_died()
    raise_if_worker_died()  # reported once
    stream.close()


_EXIT_MID_EPOCH = """\
import signal, sys, time
import bert_ds.data.workers as workers
from bert_ds.data.loader import build_loader
if len(sys.argv) > 2:  # worker 1 ignores SIGTERM but is still starting (its pid not yet in its slot) when we exit
    init = workers._init_worker
    def slow_init(slots, worker_id):
        if worker_id == 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(float(sys.argv[2]))
        init(slots, worker_id)
    workers._init_worker = slow_init
loader = build_loader(sys.argv[1], global_batch_size=64, micro_batch_size=16, rank=0, world_size=1, num_workers=2)
stream = iter(loader)
next(stream)
print("workers", *sorted(c.pid for c in __import__("multiprocessing").active_children()), flush=True)
raise SystemExit("a rank's one-line error while its loader is mid-epoch")
"""


@pytest.mark.parametrize("starting", [None, "3"], ids=["started", "worker-still-starting"])
def test_exit_mid_epoch_stops_the_workers(data, tmp_path, starting):
    """Workers ignore SIGTERM (a group SIGTERM must not kill them before the rank's checkpoint); a rank that exits
    while a pool is open still ends, and its workers with it (multiprocessing's exit hook alone would wait on them),
    also a worker still starting when the rank exits (on a loaded machine the exit hook waited on it for ever)."""
    import os
    import subprocess
    import sys

    from tests.helpers import HANG_GUARD_S, child_env
    from tests.helpers.ranks import REPO

    script = tmp_path / "exit_mid_epoch.py"
    script.write_text(_EXIT_MID_EPOCH)
    proc = subprocess.run([sys.executable, str(script), str(data), *([starting] if starting else [])], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 1 and "mid-epoch" in proc.stderr, proc.stderr[-3000:]
    pids = [int(p) for p in proc.stdout.split()[1:]]
    assert len(pids) == 2, proc.stdout
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"loader worker {pid} outlived its rank")
