"""The export's file modes follow the user's umask (mkdtemp alone gives 0700, safetensors alone 0600), so others on a
shared cluster can load it when the umask allows, and nobody can when it does not."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from bert_ds.export import convert_checkpoint
from bert_ds.model import BertForPreTraining
from tests.helpers.ds_checkpoint import VOCAB, tiny_config, write_stage0_run, write_tokenizer_dir


@pytest.fixture
def umask():
    """Set the process umask for one test, restoring the previous one after."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask, dir_mode, file_mode", [(0o022, 0o755, 0o644), (0o002, 0o775, 0o664),
                                                       (0o077, 0o700, 0o600)])
def test_export_modes_follow_the_umask(tmp_path, umask, mask, dir_mode, file_mode):
    tokenizer = write_tokenizer_dir(tmp_path / "tokenizer", VOCAB)
    torch.manual_seed(0)
    ckpt = write_stage0_run(tmp_path / "run", BertForPreTraining(tiny_config(len(VOCAB)), kernels="torch"), tokenizer)
    umask(mask)
    out = tmp_path / "exports" / "hf"
    convert_checkpoint(ckpt, out)
    assert stat.S_IMODE(out.stat().st_mode) == dir_mode
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert "model.safetensors" in files and "config.json" in files
    assert files == dict.fromkeys(files, file_mode)
