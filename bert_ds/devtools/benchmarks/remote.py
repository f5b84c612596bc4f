"""The loader's wait from a store against a local path on the same shards, and the network bytes read per epoch
against the shard set's size, measured in the same run (issue 33; ``docs/data.md`` "Shards at a URL").

    python tools/bench_remote.py                          # synthetic seq-128 and seq-512 sets, an HTTP store here
    python tools/bench_remote.py --mbps 50 --step-ms 40   # a slower store, a longer step

The store is Python's ``http.server`` on 127.0.0.1 serving the sets, throttled to ``--mbps`` per connection and
counting the body bytes it sends (the network bytes); the loader reads it through fsspec and the node-local cache
(:mod:`bert_ds.data.shard_cache`) with its prefetcher, exactly as training does. Each phase's loader is iterated for
``--epochs`` epochs with ``--step-ms`` of simulated compute per micro batch, once from the local directory and once
from the store: printed per phase, the seconds the step loop waited for batches (``ShardLoader.wait_s``, what
TensorBoard's ``data/phase<N>/loader_wait_s`` shows) and the bytes the store sent in each epoch, with the cache
unbounded (the set fits: each shard once per node for the whole run) and with ``--cache-limit`` at the look-ahead
window (each shard once per node per epoch). A benchmark, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import tempfile
import threading
import time
from pathlib import Path

from bert_ds.data.loader import build_loader
from bert_ds.data.shard_cache import CacheOptions, format_size, set_default_options
from bert_ds.data.synthetic import write_synthetic_shards
from bert_ds.data.tokenizer import SPECIAL_TOKENS

__all__ = ["main"]

_IDS = {f"{name}_id": SPECIAL_TOKENS.index(f"[{name.upper()}]") for name in ("cls", "sep", "mask")}
PHASES = {1: dict(seq_len=128, max_predictions=20, num_samples=8000, samples_per_shard=500, global_batch_size=64,
                  micro_batch_size=16),
          2: dict(seq_len=512, max_predictions=80, num_samples=2000, samples_per_shard=125, global_batch_size=32,
                  micro_batch_size=8)}


class _Counting(http.server.SimpleHTTPRequestHandler):
    sent = [0]
    lock = threading.Lock()
    bytes_per_s = 0.0

    def log_message(self, *args) -> None:
        pass

    def copyfile(self, source, outputfile) -> None:
        """The body in 256 KiB blocks, paced to ``bytes_per_s``, counted."""
        start = time.perf_counter()
        sent = 0
        while block := source.read(1 << 18):
            outputfile.write(block)
            sent += len(block)
            with self.lock:
                self.sent[0] += len(block)
            if self.bytes_per_s:
                ahead = sent / self.bytes_per_s - (time.perf_counter() - start)
                if ahead > 0:
                    time.sleep(ahead)


def _serve(root: Path, mbps: float) -> tuple[http.server.ThreadingHTTPServer, type]:
    handler = type("Handler", (_Counting,), {"sent": [0], "lock": threading.Lock(), "bytes_per_s": mbps * 1e6})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler


def _run(source, spec: dict, epochs: int, step_s: float, workers: int, handler=None) -> tuple[float, list[int]]:
    """(seconds waited for batches, bytes the store sent in each epoch) over ``epochs`` epochs."""
    loader = build_loader(source, global_batch_size=spec["global_batch_size"],
                          micro_batch_size=spec["micro_batch_size"], num_workers=workers, seed=1,
                          shuffle_window_shards=2)
    per_epoch, marks = [], [handler.sent[0] if handler else 0]
    micro = loader.batches_per_epoch * loader.gradient_accumulation_steps * epochs
    for m, _ in enumerate(loader):
        time.sleep(step_s)
        if (m + 1) % (loader.batches_per_epoch * loader.gradient_accumulation_steps) == 0:
            marks.append(handler.sent[0] if handler else 0)
        if m + 1 == micro:
            break
    for prefetcher in loader.prefetchers:
        prefetcher.close()
    per_epoch = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return loader.wait_s, per_epoch


def bench(work: Path, *, epochs: int, step_ms: float, mbps: float, workers: int) -> list[str]:
    lines = [f"store: http.server on 127.0.0.1 at {mbps:g} MB/s per connection; {step_ms:g} ms of compute per micro "
             f"batch; {workers} loader worker(s); {epochs} epochs per run"]
    server, handler = _serve(work / "store", mbps)
    try:
        for phase, spec in PHASES.items():
            local = work / "store" / f"s{spec['seq_len']}"
            size = sum(p.stat().st_size for p in local.glob("shard-*.tar"))
            url = f"http://127.0.0.1:{server.server_address[1]}/s{spec['seq_len']}/"
            wait_local, _ = _run(local, spec, epochs, step_ms / 1e3, workers)
            set_default_options(CacheOptions(root=str(work / f"cache{phase}")))
            wait_store, sent = _run(url, spec, epochs, step_ms / 1e3, workers, handler)
            window = 3 * 2 * max(p.stat().st_size for p in local.glob("shard-*.tar"))
            set_default_options(CacheOptions(root=str(work / f"cache{phase}-bounded"), limit_bytes=window))
            wait_bounded, sent_bounded = _run(url, spec, epochs, step_ms / 1e3, workers, handler)
            lines.append(f"phase {phase} (seq {spec['seq_len']}, {len(list(local.glob('shard-*.tar')))} shards, "
                         f"{format_size(size)}): loader wait local {wait_local:.3f} s | store {wait_store:.3f} s | "
                         f"store, --cache-limit {format_size(window)} {wait_bounded:.3f} s")
            lines.append(f"  network bytes per epoch, cache unbounded: {', '.join(format_size(b) for b in sent)} "
                         f"({', '.join(f'{b / size:.2f}' for b in sent)} x the set)")
            lines.append(f"  network bytes per epoch, --cache-limit {format_size(window)}: "
                         f"{', '.join(format_size(b) for b in sent_bounded)} "
                         f"({', '.join(f'{b / size:.2f}' for b in sent_bounded)} x the set)")
    finally:
        server.shutdown()
        server.server_close()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated compute per micro batch")
    parser.add_argument("--mbps", type=float, default=100.0, help="the store's bandwidth per connection, MB/s")
    parser.add_argument("--workers", type=int, default=1, help="loader worker processes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bert_ds_bench_remote_") as tmp:
        work = Path(tmp)
        for spec in PHASES.values():
            write_synthetic_shards(work / "store" / f"s{spec['seq_len']}", num_samples=spec["num_samples"],
                                   samples_per_shard=spec["samples_per_shard"], seq_len=spec["seq_len"],
                                   max_predictions=spec["max_predictions"], **_IDS)
        for line in bench(work, epochs=args.epochs, step_ms=args.step_ms, mbps=args.mbps, workers=args.workers):
            print(line, flush=True)
    return 0
