"""Both data-prep tools on one ~50 MB single-line document, in a subprocess under a 3 GiB address-space limit.

Before ``text.TextLimits`` such a line was held whole and tokenized whole: a 10 MB line took 1.2 GB RSS in
``create_shards`` and 0.75 GB in ``train_tokenizer``, and a 200 MB one more than 12 GB. Now the line is read in pieces
and skipped, the skip is reported on stdout and recorded, and the peak RSS stays that of a small corpus."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.data.index import ShardIndex
from bert_ds.data.tokenizer import META_NAME
from tests.helpers import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]
AS_LIMIT = 3 * 2**30  # generous: the tools need ~0.1 GB RSS here; an unbounded read needs several GB for 50 MB
LINE_BYTES = 50 * 10**6
MAX_PEAK_RSS = 2**30

# Runs a tool as its own child, then prints that child's peak RSS (KiB on Linux): the pytest process's own children
# would mix in other tests' subprocesses.
_MEASURE = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
            "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


@pytest.fixture(scope="module", params=["txt", "jsonl"])
def hostile_corpus(request, english_corpus, tmp_path_factory) -> Path:
    """A directory: the English corpus plus one file holding a single ~50 MB line of words (BERT layout or JSON)."""
    directory = tmp_path_factory.mktemp(f"hostile_{request.param}")
    words = english_corpus.read_text(encoding="utf-8").split()
    block = " ".join(words)
    line = (block + " ") * (LINE_BYTES // (len(block) + 1) + 1)
    if request.param == "txt":
        (directory / "english.txt").write_text(english_corpus.read_text(encoding="utf-8"), encoding="utf-8")
        (directory / "long.txt").write_text(line + "\n", encoding="utf-8")
    else:
        docs = [d.replace("\n", " ") for d in english_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()]
        with open(directory / "english.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
        (directory / "long.jsonl").write_text(json.dumps({"text": line}) + "\n", encoding="utf-8")
    return directory


def _run_tool(tool: str, *args: str) -> tuple[subprocess.CompletedProcess, int]:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, str(REPO / "tools" / f"{tool}.py"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S,
                          preexec_fn=_limit_address_space)
    assert proc.returncode == 0, proc.stderr
    peak = int(proc.stdout.rsplit("peak_rss_kib", 1)[1]) * 1024
    return proc, peak


def test_train_tokenizer_skips_a_huge_line_in_bounded_memory(hostile_corpus, tmp_path):
    out = tmp_path / "tok"
    proc, peak = _run_tool("train_tokenizer", "--input", str(hostile_corpus), "--vocab-size", "2000", "--out",
                           str(out))
    assert "skipped 1 line(s) over --max-document-bytes" in proc.stdout
    assert json.loads((out / META_NAME).read_text())["skipped"] == {"long_lines": 1, "long_sentences": 0}
    assert peak < MAX_PEAK_RSS, f"peak RSS {peak / 2**20:.0f} MiB"


def test_create_shards_skips_a_huge_line_in_bounded_memory(hostile_corpus, tokenizer_dir, tmp_path):
    out = tmp_path / "shards"
    proc, peak = _run_tool("create_shards", "--input", str(hostile_corpus), "--tokenizer", str(tokenizer_dir),
                           "--seq-len", "128", "--out", str(out))
    assert "skipped 1 line(s) over --max-document-bytes" in proc.stdout
    index = ShardIndex.load(out)
    assert index.extra["skipped"]["long_lines"] == 1 and index.total_samples > 1000
    assert peak < MAX_PEAK_RSS, f"peak RSS {peak / 2**20:.0f} MiB"
