"""Benchmark shard creation (seq 128): pairs per second per core, against a Google-style baseline, and peak memory.

    .venv/bin/python tools/bench_create.py [--copies 8 32] [--corpus FILE --tokenizer DIR]

Every measurement runs in a fresh child process pinned to one thread (RAYON_NUM_THREADS=1,
TOKENIZERS_PARALLELISM=false, workers=1), which reports its own CPU time and peak RSS (``resource``). Rates are
samples per CPU-second of that process, so they mean "per core" even on a busy shared machine; wall times are printed
next to them. The baseline is the same algorithm written the way Google's ``create_pretraining_data.py`` is: each
sentence tokenized on its own (fast tokenizer, one call per line), the whole corpus held as lists of token strings,
instances built with list operations and masked with a pure-Python loop, everything shuffled in memory, then written
in the same shard format. The corpus is the test suite's English corpus (license texts + Python docstrings,
``bert_ds.data.english_corpus``), repeated ``--copies`` times; a larger corpus should not raise peak memory, since
work is done one chunk (its dupe_factor shards) at a time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bert_ds.data.english_corpus import build_english_corpus

SEQ_LEN = 128
REPO = Path(__file__).resolve().parents[3]


# ---- baseline: Google's create_pretraining_data.py algorithm, pure Python -------------------------------------------

MaskedLm = collections.namedtuple("MaskedLm", ["index", "label"])


def _google_truncate(tokens_a, tokens_b, max_num_tokens, rng):
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        trunc = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del trunc[0]
        else:
            trunc.pop()


def _google_mask(tokens, masked_lm_prob, max_predictions, vocab_words, rng):
    cand_indexes = [i for i, t in enumerate(tokens) if t not in ("[CLS]", "[SEP]")]
    rng.shuffle(cand_indexes)
    output = list(tokens)
    num_to_predict = min(max_predictions, max(1, int(round(len(cand_indexes) * masked_lm_prob))))
    masked = []
    for index in cand_indexes:
        if len(masked) >= num_to_predict:
            break
        # Google's loop as written (the baseline being timed), not bert_ds's rule: masking.replace_chosen.
        if rng.random() < 0.8:
            token = "[MASK]"
        elif rng.random() < 0.5:
            token = tokens[index]
        else:
            token = vocab_words[rng.randint(0, len(vocab_words) - 1)]
        output[index] = token
        masked.append(MaskedLm(index, tokens[index]))
    masked.sort(key=lambda m: m.index)
    return output, [m.index for m in masked], [m.label for m in masked]


def _google_instances(all_documents, document_index, max_seq_length, short_seq_prob, masked_lm_prob,
                      max_predictions, vocab_words, rng):
    document = all_documents[document_index]
    max_num_tokens = max_seq_length - 3
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)
    instances, current_chunk, current_length, i = [], [], 0, 0
    while i < len(document):
        current_chunk.append(document[i])
        current_length += len(document[i])
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                a_end = rng.randint(1, len(current_chunk) - 1) if len(current_chunk) >= 2 else 1
                tokens_a = [t for seg in current_chunk[:a_end] for t in seg]
                tokens_b = []
                is_random_next = len(current_chunk) == 1 or rng.random() < 0.5
                if is_random_next:
                    target_b_length = target_seq_length - len(tokens_a)
                    for _ in range(10):
                        random_document_index = rng.randint(0, len(all_documents) - 1)
                        if random_document_index != document_index:
                            break
                    random_document = all_documents[random_document_index]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    i -= len(current_chunk) - a_end
                else:
                    tokens_b = [t for seg in current_chunk[a_end:] for t in seg]
                _google_truncate(tokens_a, tokens_b, max_num_tokens, rng)
                tokens = ["[CLS]", *tokens_a, "[SEP]", *tokens_b, "[SEP]"]
                out, positions, labels = _google_mask(tokens, masked_lm_prob, max_predictions, vocab_words, rng)
                instances.append((out, len(tokens_a) + 2, positions, labels, int(is_random_next)))
            current_chunk, current_length = [], 0
        i += 1
    return instances


def baseline_create(corpus: Path, tokenizer_dir: Path, out: Path, dupe_factor: int, seed: int) -> int:
    import numpy as np

    from bert_ds.data.format import Sample, encode_sample, id_dtype_for_vocab
    from bert_ds.data.index import ShardWriter, shard_name
    from bert_ds.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    vocab = {t: i for i, t in enumerate(tok.vocab)}
    rng = random.Random(seed)
    all_documents = [[]]
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                all_documents.append([])
                continue
            tokens = tok.tokenizer.encode(line, add_special_tokens=False).tokens  # one call per sentence
            if tokens:
                all_documents[-1].append(tokens)
    all_documents = [d for d in all_documents if d]
    rng.shuffle(all_documents)
    instances = []
    for _ in range(dupe_factor):
        for document_index in range(len(all_documents)):
            instances.extend(_google_instances(all_documents, document_index, SEQ_LEN, 0.1, 0.15, 20, tok.vocab, rng))
    rng.shuffle(instances)
    dtype = id_dtype_for_vocab(tok.vocab_size)
    per_shard = 10000
    for s in range(0, len(instances), per_shard):
        with ShardWriter(out / shard_name(s // per_shard)) as w:
            for k, (tokens, seg_a, positions, labels, nsp) in enumerate(instances[s:s + per_shard], start=s):
                sample = Sample(np.array([vocab[t] for t in tokens], dtype=dtype), seg_a,
                                np.array(positions, dtype=np.uint16), np.array([vocab[t] for t in labels], dtype=dtype),
                                nsp)
                w.write(f"{k:012d}.pair", encode_sample(sample, dtype))
            w.close()
    return len(instances)


# ---- measurement in a child process ------------------------------------------------------------------------------


def _child(spec: dict) -> None:
    out = Path(spec["out"])
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    from bert_ds.data.create import create_shards  # imports (numpy, tokenizers) are not part of the work timed

    wall, cpu = time.perf_counter(), time.process_time()
    if spec["impl"] == "bert_ds":
        samples = create_shards([spec["corpus"]], spec["tokenizer"], out, seq_len=SEQ_LEN, dupe_factor=spec["dupe"],
                                seed=1, workers=1, progress=False).total_samples
    else:
        samples = baseline_create(Path(spec["corpus"]), Path(spec["tokenizer"]), out, spec["dupe"], 1)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"samples": samples, "cpu_s": cpu, "wall_s": wall, "peak_rss_mb": rss_mb}))


def _measure(impl: str, corpus: Path, tokenizer: Path, dupe: int, work: Path) -> dict:
    spec = {"impl": impl, "corpus": str(corpus), "tokenizer": str(tokenizer), "dupe": dupe, "out": str(work / "out")}
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "bert_ds.devtools.benchmarks.create", "--child", json.dumps(spec)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(f"benchmark child failed:\n{proc.stderr}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["pairs_per_cpu_s"] = result["samples"] / result["cpu_s"]
    return result


def _tokenizer_rate(corpus: Path, tokenizer: Path) -> float:
    code = ("import sys, time; from bert_ds.data.tokenizer import load_tokenizer; t = load_tokenizer(sys.argv[2]); "
            "lines = [x for x in open(sys.argv[1], encoding='utf-8').read().splitlines() if x]\n"
            "best = float('inf')\n"
            "for _ in range(3):  # best of three: the first call also warms the tokenizer up\n"
            "    c = time.process_time(); ids, _ = t.encode_batch(lines); best = min(best, time.process_time() - c)\n"
            "print(len(ids) / best)")
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code, str(corpus), str(tokenizer)], capture_output=True, text=True,
                          env=env, check=True)
    return float(proc.stdout.strip())


def _corpus_copies(src: Path, copies: int, work: Path) -> Path:
    text = src.read_text(encoding="utf-8")
    out = work / f"corpus_x{copies}.txt"
    with open(out, "w", encoding="utf-8") as f:
        for _ in range(copies):
            f.write(text.rstrip("\n") + "\n\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help="BERT-layout corpus (default: the test suite's English corpus)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer dir (default: an 8,000-token vocab trained here)")
    parser.add_argument("--copies", type=int, nargs=2, default=[8, 32], metavar=("SMALL", "LARGE"),
                        help="corpus repetitions for the throughput runs / the memory comparison (default 8 32)")
    parser.add_argument("--baseline-copies", type=int, default=2,
                        help="corpus repetitions for the baseline (it also runs dupe 1 at 4x this, for its memory)")
    parser.add_argument("--json", type=Path, help="also write the rows and ratios here (tools/benchmark.py reads it)")
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return

    with tempfile.TemporaryDirectory(prefix="bench_create_") as tmp:
        work = Path(tmp)
        corpus = args.corpus
        if corpus is None:
            corpus = build_english_corpus(work / "english.txt")
        tokenizer = args.tokenizer
        if tokenizer is None:
            from bert_ds.data.tokenizer import train_tokenizer

            tokenizer = train_tokenizer([corpus], work / "tokenizer", vocab_size=8000)
        small, large = (_corpus_copies(corpus, n, work) for n in args.copies)
        base = _corpus_copies(corpus, args.baseline_copies, work)
        base4 = _corpus_copies(corpus, 4 * args.baseline_copies, work)
        mb = {p: p.stat().st_size / 2**20 for p in (small, large, base, base4)}
        print(f"tokenizer alone (WordPieceTokenizer.encode_batch, one thread, in a child, best of 3): "
              f"{_tokenizer_rate(corpus, tokenizer):,.0f} tokens/cpu-s")
        print(f"seq_len {SEQ_LEN}, one core; corpus {corpus} ({mb[small] / args.copies[0]:.2f} MiB) repeated; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        print(f"{'run':44s} {'pairs':>8s} {'cpu s':>7s} {'wall s':>7s} {'pairs/cpu-s':>12s} {'peak RSS MiB':>13s}")
        rows = {}
        for name, impl, path, dupe in (
            (f"bert_ds      dupe 5, {mb[small]:6.1f} MiB", "bert_ds", small, 5),
            (f"bert_ds      dupe 1, {mb[small]:6.1f} MiB", "bert_ds", small, 1),
            (f"bert_ds      dupe 1, {mb[large]:6.1f} MiB", "bert_ds", large, 1),
            (f"Google-style dupe 5, {mb[base]:6.1f} MiB", "baseline", base, 5),
            (f"Google-style dupe 1, {mb[base]:6.1f} MiB", "baseline", base, 1),
            (f"Google-style dupe 1, {mb[base4]:6.1f} MiB", "baseline", base4, 1),
        ):
            r = rows[name] = _measure(impl, path, tokenizer, dupe, work)
            print(f"{name:44s} {r['samples']:8d} {r['cpu_s']:7.1f} {r['wall_s']:7.1f} {r['pairs_per_cpu_s']:12,.0f} "
                  f"{r['peak_rss_mb']:13.0f}", flush=True)
        v = [r["pairs_per_cpu_s"] for r in rows.values()]
        rss = [r["peak_rss_mb"] for r in rows.values()]
        print(f"speed-up over the Google-style baseline: dupe 5 x{v[0] / v[3]:.1f}, dupe 1 x{v[1] / v[4]:.1f} "
              f"(x{v[1] / v[5]:.1f} against its {mb[base4]:.1f} MiB run); "
              f"peak RSS at {args.copies[1]}x vs "
              f"{args.copies[0]}x corpus: {rss[2]:.0f} vs {rss[1]:.0f} MiB (Google-style, which holds the corpus: "
              f"{rss[5]:.0f} MiB at {mb[base4]:.1f} MiB vs {rss[4]:.0f} at {mb[base]:.1f}) "
              f"(targets: >= 10,000 pairs/s at dupe 5, >= 3,000 at dupe 1)")
        if args.json:
            args.json.write_text(json.dumps({
                "rows": {" ".join(name.split()): r for name, r in rows.items()},
                "speedup_dupe5": v[0] / v[3], "speedup_dupe1": v[1] / v[4],
                "corpus_mib": {"small": mb[small], "large": mb[large], "baseline": mb[base],
                               "baseline_large": mb[base4]}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
