"""Loader throughput next to the raw cost of reading the tar bytes, measured in the same run.

    python tools/bench_loader.py                       # synthetic shard set, seq 128, in a temp dir
    python tools/bench_loader.py --data-dir shards/    # an existing shard set

Prints samples/s for: reading every member with ``tarfile`` (what a streaming tar reader does), slicing every
member out of the mmap (the floor of :class:`~bert_ds.data.reader.ShardReader`), and the training loader with
``num_workers`` = 0 (in process), 1 and 2, each also divided per worker. A benchmark, not a test: numbers depend
on the machine and its load.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tarfile
import tempfile
import time
from pathlib import Path

from bert_ds.data.index import ShardIndex
from bert_ds.data.loader import DynamicMasking, build_loader
from bert_ds.data.reader import ShardReader
from bert_ds.data.synthetic import write_synthetic_shards
from bert_ds.data.tokenizer import SPECIAL_TOKENS

# The synthetic set stands for a bert_ds vocabulary: special tokens in tokenizer.SPECIAL_TOKENS order ([MASK] = 4).
SYNTHETIC_IDS = {f"{name}_id": SPECIAL_TOKENS.index(f"[{name.upper()}]") for name in ("cls", "sep", "mask")}


def bench_tarfile(data_dir: Path) -> tuple[int, float]:
    index = ShardIndex.load(data_dir)
    n, t0 = 0, time.perf_counter()
    for info in index.shards:
        with tarfile.open(data_dir / info.name, "r:") as tar:
            for member in tar:
                tar.extractfile(member).read()
                n += 1
    return n, time.perf_counter() - t0


def bench_mmap_slices(data_dir: Path) -> tuple[int, float]:
    reader = ShardReader(data_dir)
    n, t0 = 0, time.perf_counter()
    for shard in range(reader.num_shards):
        for i in range(reader.index.shards[shard].samples):
            reader.raw(shard, i)
            n += 1
    return n, time.perf_counter() - t0


def bench_loader(data_dir: Path, *, num_workers: int, micro_batch_size: int, batches: int,
                 dynamic: DynamicMasking | None) -> tuple[int, float]:
    loader = build_loader(data_dir, global_batch_size=micro_batch_size, micro_batch_size=micro_batch_size,
                          num_workers=num_workers, dynamic_masking=dynamic, prefetch_factor=4)
    it = iter(loader)
    warmup = max(2, 2 * num_workers)  # worker start-up and first shard opens are not steady state
    for _ in range(warmup):
        next(it)
    t0 = time.perf_counter()
    n = sum(len(batch["lengths"]) for batch in itertools.islice(it, batches))
    return n, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, help="existing shard set (default: a synthetic one, seq 128)")
    parser.add_argument("--samples", type=int, default=60000, help="synthetic set size")
    parser.add_argument("--samples-per-shard", type=int, default=10000)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=300, help="micro batches timed per loader run")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--dynamic-masking", action="store_true", help="also time dynamic masking (15%%)")
    parser.add_argument("--tokenizer", type=Path, help="the --data-dir set's tokenizer ([MASK] id for dynamic masking)")
    parser.add_argument("--json", type=Path, help="also write the rows here (tools/benchmark.py reads it)")
    args = parser.parse_args(argv)
    if args.dynamic_masking and args.data_dir is not None and args.tokenizer is None:
        parser.error("--dynamic-masking on --data-dir needs --tokenizer (the [MASK] id comes from it)")

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir
        if data_dir is None:
            data_dir = Path(tmp)
            t0 = time.perf_counter()
            write_synthetic_shards(data_dir, num_samples=args.samples, samples_per_shard=args.samples_per_shard,
                                   seq_len=128, max_predictions=20, **SYNTHETIC_IDS)
            print(f"wrote {args.samples} synthetic samples (seq 128) in {time.perf_counter() - t0:.1f} s")
        index = ShardIndex.load(data_dir)
        print(f"shard set: {len(index.shards)} shards, {index.total_samples} samples, seq_len {index.seq_len}")
        rows = [("tarfile: read every member", *bench_tarfile(data_dir), 1),
                ("mmap: slice every member", *bench_mmap_slices(data_dir), 1)]
        dynamic = [None]
        if args.dynamic_masking:
            dynamic.append(DynamicMasking.from_tokenizer(args.tokenizer) if args.tokenizer is not None else
                           DynamicMasking(vocab_size=index.vocab_size, mask_id=SYNTHETIC_IDS["mask_id"]))
        for dyn in dynamic:
            for w in args.workers:
                n, dt = bench_loader(data_dir, num_workers=w, micro_batch_size=args.micro_batch_size,
                                     batches=args.batches, dynamic=dyn)
                label = f"loader num_workers={w} micro={args.micro_batch_size}" + (" dynamic" if dyn else "")
                rows.append((label, n, dt, max(w, 1)))
        print(f"{'what':46s} {'samples':>8s} {'seconds':>8s} {'samples/s':>10s} {'per worker':>10s}")
        for label, n, dt, workers in rows:
            print(f"{label:46s} {n:8d} {dt:8.2f} {n / dt:10.0f} {n / dt / workers:10.0f}")
        if args.json:
            args.json.write_text(json.dumps([{"what": label, "samples": n, "seconds": dt, "samples_per_s": n / dt,
                                              "per_worker": n / dt / workers} for label, n, dt, workers in rows],
                                            indent=1) + "\n")


if __name__ == "__main__":
    main()
