"""``bert-ds-train-tokenizer`` on a disk that fills: one line naming the file and the output, exit 74 (the storage
failed, not the input: ``ExitCode.IO_ERROR``), nothing left.

Issue 16 item 7: tokenizers' Rust writer raised a bare ``Exception: No space left on device (os error 28)`` with a
traceback and exit 1. The files are now written by Python, so the failure is an OSError with the file's name.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import BertWordPieceTokenizer

from bert_ds.exit_codes import ExitCode
from tests.helpers import HANG_GUARD_S, child_env
from tests.helpers.faults import limit_file_size

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(Path(sys.executable).parent / "bert-ds-train-tokenizer")


def _train(corpus: Path, out: Path, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([TRAIN, "--input", str(corpus), "--vocab-size", "4000", "--out", str(out)],
                          capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=HANG_GUARD_S, **popen)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == ExitCode.IO_ERROR and len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_a_file_size_limit_fails_in_one_line_and_leaves_nothing(english_corpus, tmp_path):
    out = tmp_path / "deep" / "tok"
    line = _one_error_line(_train(english_corpus, out, preexec_fn=limit_file_size(4096)))
    assert "writing vocab.txt for" in line and str(out) in line and "File too large" in line, line
    assert not (tmp_path / "deep").exists()  # no staging directory, no half-made parents


def test_a_full_tmpfs_fails_in_one_line_and_leaves_nothing(english_corpus, tmp_path):
    mnt = tmp_path / "full"
    mnt.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20k", "tmpfs", str(mnt)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root): the file-size-limit test covers the failure path")
    try:
        line = _one_error_line(_train(english_corpus, mnt / "tok"))
        assert "No space left on device" in line and str(mnt / "tok") in line, line
        assert list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_vocab_txt_is_byte_identical_to_the_tokenizers_writer(tokenizer_dir, tmp_path):
    """Python writes vocab.txt now: the bytes must equal what tokenizers' own ``save_model`` writes."""
    (tmp_path / "theirs").mkdir()
    BertWordPieceTokenizer(str(tokenizer_dir / "vocab.txt")).save_model(str(tmp_path / "theirs"))
    assert (tokenizer_dir / "vocab.txt").read_bytes() == (tmp_path / "theirs" / "vocab.txt").read_bytes()
