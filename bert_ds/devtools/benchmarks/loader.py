"""Loader throughput next to the raw cost of reading the tar bytes, measured in the same run.

    python tools/bench_loader.py                       # synthetic shard set, seq 128, in a temp dir
    python tools/bench_loader.py --data-dir shards/    # an existing shard set

Prints samples/s for: reading every member with ``tarfile`` (what a streaming tar reader does), slicing every
member out of the mmap (the floor of :class:`~bert_ds.data.reader.ShardReader`), and the training loader with
``num_workers`` = 0 (in process), 1 and 2, each also divided per worker. With ``--mix`` also the loader over three
weighted synthetic sources (5:3:2) against one synthetic source of as many samples, both started once and read in
``--repeats`` alternated rounds in the same run, and the mix's cost in percent (the median over rounds). A
benchmark, not a test: numbers depend on the machine and its load.

    python tools/bench_loader.py --mix --workers 0     # + 3 weighted sources vs one, same run
"""

from __future__ import annotations

import argparse
import itertools
import json
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from bert_ds.data.index import ShardIndex
from bert_ds.data.loader import DynamicMasking, Source, build_loader
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


def _started(data: Path | list[Source], *, num_workers: int, micro_batch_size: int, dynamic: DynamicMasking | None,
             global_batch_size: int | None):
    """A running iterator of the training loader, past its warm-up."""
    loader = build_loader(data, global_batch_size=global_batch_size or micro_batch_size,
                          micro_batch_size=micro_batch_size,
                          num_workers=num_workers, dynamic_masking=dynamic, prefetch_factor=4)
    it = iter(loader)
    warmup = max(2, 2 * num_workers)  # worker start-up and first shard opens are not steady state
    for _ in range(warmup):
        next(it)
    return it


def _timed(it, batches: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = sum(len(batch["lengths"]) for batch in itertools.islice(it, batches))
    return n, time.perf_counter() - t0


def bench_loader(data_dir: Path | list[Source], *, num_workers: int, micro_batch_size: int, batches: int,
                 dynamic: DynamicMasking | None, global_batch_size: int | None = None) -> tuple[int, float]:
    it = _started(data_dir, num_workers=num_workers, micro_batch_size=micro_batch_size, dynamic=dynamic,
                  global_batch_size=global_batch_size)
    return _timed(it, batches)


MIX_WEIGHTS = (5.0, 3.0, 2.0)


def bench_mix(single: Path, sources: list[Source], *, num_workers: int, micro_batch_size: int, batches: int,
              repeats: int, global_batch_size: int) -> list[tuple[str, int, float, int, dict]]:
    """One source vs the weighted mix: both loaders started once, then ``repeats`` rounds of ``batches`` micro
    batches from each, alternated (which goes first swaps every round), so a burst of load on a shared machine hits
    both alike. The cost is the median over rounds of 1 - (one source's time / the mix's time) for the same number of
    samples; best of each is kept for the rows and the best / best cost is printed beside it."""
    its = {label: _started(data, num_workers=num_workers, micro_batch_size=micro_batch_size, dynamic=None,
                           global_batch_size=global_batch_size)
           for label, data in (("one source", single), ("3 weighted sources", sources))}
    times: dict[str, list[tuple[int, float]]] = {label: [] for label in its}
    for r in range(repeats):
        for label in (list(its) if r % 2 == 0 else list(its)[::-1]):
            times[label].append(_timed(its[label], batches))
    costs = sorted(1 - one[1] / mix[1] for one, mix in zip(times["one source"], times["3 weighted sources"],
                                                              strict=True))
    cost = float(np.median(costs))
    best = {label: min(t, key=lambda x: x[1] / x[0]) for label, t in times.items()}
    best_cost = 1 - (best["3 weighted sources"][0] / best["3 weighted sources"][1]) / (
        best["one source"][0] / best["one source"][1])
    mix = {"mix_cost": cost, "mix_cost_best": best_cost, "rounds": repeats, "weights": list(MIX_WEIGHTS),
           "num_workers": num_workers, "global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size}
    print(f"mix of 3 weighted sources (5:3:2) vs one source, num_workers={num_workers}, global batch "
          f"{global_batch_size}, micro batch {micro_batch_size}: the mix costs {100 * cost:.1f}% (median of "
          f"{repeats} alternated rounds of {batches} micro batches; best / best {100 * best_cost:.1f}%)")
    return [(f"loader {label} workers={num_workers} G={global_batch_size}", *best[label], max(num_workers, 1),
             mix if label == "3 weighted sources" else {}) for label in best]


def _write_mix(root: Path, samples: int, samples_per_shard: int) -> tuple[Path, list[Source]]:
    """A synthetic single set of ``samples`` and three sets of a third each (other seeds), seq 128."""
    single = root / "single"
    write_synthetic_shards(single, num_samples=samples, samples_per_shard=samples_per_shard, seq_len=128,
                           max_predictions=20, seed=11, **SYNTHETIC_IDS)
    sources = []
    for i, weight in enumerate(MIX_WEIGHTS):
        write_synthetic_shards(root / f"source{i}", num_samples=samples // 3, samples_per_shard=samples_per_shard,
                               seq_len=128, max_predictions=20, seed=21 + i, **SYNTHETIC_IDS)
        sources.append(Source(str(root / f"source{i}"), weight))
    return single, sources


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
    parser.add_argument("--mix", action="store_true", help="also time 3 weighted synthetic sources vs one source")
    parser.add_argument("--repeats", type=int, default=15,
                        help="alternated rounds (of --batches micro batches each) of the --mix comparison")
    parser.add_argument("--mix-workers", type=int, nargs="+", default=None,
                        help="num_workers values of the --mix comparison (default: --workers)")
    parser.add_argument("--mix-global-batch-size", type=int, nargs="+", default=[64, 1024],
                        help="global batch sizes of the --mix comparison (the mix draws once per global batch)")
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
        rows = [("tarfile: read every member", *bench_tarfile(data_dir), 1, {}),
                ("mmap: slice every member", *bench_mmap_slices(data_dir), 1, {})]
        dynamic = [None]
        if args.dynamic_masking:
            dynamic.append(DynamicMasking.from_tokenizer(args.tokenizer) if args.tokenizer is not None else
                           DynamicMasking(vocab_size=index.vocab_size, mask_id=SYNTHETIC_IDS["mask_id"]))
        for dyn in dynamic:
            for w in args.workers:
                n, dt = bench_loader(data_dir, num_workers=w, micro_batch_size=args.micro_batch_size,
                                     batches=args.batches, dynamic=dyn)
                label = f"loader num_workers={w} micro={args.micro_batch_size}" + (" dynamic" if dyn else "")
                rows.append((label, n, dt, max(w, 1), {}))
        if args.mix:
            single, sources = _write_mix(Path(tmp) / "mix", args.samples, args.samples_per_shard)
            mix_workers = args.workers if args.mix_workers is None else args.mix_workers
            for w, g in itertools.product(mix_workers, args.mix_global_batch_size):
                rows += bench_mix(single, sources, num_workers=w, micro_batch_size=args.micro_batch_size,
                                  batches=args.batches, repeats=args.repeats, global_batch_size=g)
        print(f"{'what':46s} {'samples':>8s} {'seconds':>8s} {'samples/s':>10s} {'per worker':>10s}")
        for label, n, dt, workers, _ in rows:
            print(f"{label:46s} {n:8d} {dt:8.2f} {n / dt:10.0f} {n / dt / workers:10.0f}")
        if args.json:
            args.json.write_text(json.dumps([{"what": label, "samples": n, "seconds": dt, "samples_per_s": n / dt,
                                              "per_worker": n / dt / workers, **extra}
                                             for label, n, dt, workers, extra in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
