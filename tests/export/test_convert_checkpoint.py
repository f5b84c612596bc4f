"""The converter on real DeepSpeed checkpoints (ZeRO 0, 2 and 3 on one CPU/gloo rank, saved by the training loop's
``save_checkpoint``), and its refusals."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from bert_ds.checkpoint import RUN_STATE_NAME, tag_for
from bert_ds.data.tokenizer import read_vocab
from bert_ds.export import convert as convert_module
from bert_ds.export import convert_checkpoint, verify_export
from bert_ds.export.keymap import PADDED_VOCAB_KEYS
from tests.helpers import HANG_GUARD_S
from tests.helpers.ds_checkpoint import REPO, TAG, VOCAB, stage_checkpoint_dir


def _load_cli():
    spec = importlib.util.spec_from_file_location("tools_convert_checkpoint", REPO / "tools" / "convert_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


cli = _load_cli()

STAGES = (0, 2, 3)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """One subprocess writes all stages: DeepSpeed's process group stays out of the pytest process."""
    out = tmp_path_factory.mktemp("ds")
    result = subprocess.run([sys.executable, "-m", "tests.helpers.ds_checkpoint", str(out), "--stages",
                             *map(str, STAGES)], capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_convert_and_load_in_transformers(checkpoints, tmp_path, stage, capsys):
    out = tmp_path / "hf"
    assert cli(["--checkpoint", str(stage_checkpoint_dir(checkpoints, stage)), "--out", str(out)]) == 0
    assert "verified" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "vocab.txt", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert read_vocab(out) == VOCAB
    assert json.loads((out / "tokenizer_config.json").read_text())["do_lower_case"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # the temp dir was renamed, nothing else left

    # The exported weights are the trained module's, vocab rows trimmed.
    reference = torch.load(checkpoints / f"stage{stage}_reference.pt")
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    model = transformers.BertForPreTraining.from_pretrained(out)
    exported = model.state_dict()
    for name, tensor in reference.items():
        expected = tensor[:vocab] if name in PADDED_VOCAB_KEYS else tensor
        torch.testing.assert_close(exported[name], expected, rtol=0, atol=0, msg=name)
    assert torch.equal(exported["cls.predictions.decoder.weight"], exported["bert.embeddings.word_embeddings.weight"])
    assert set(load_file(out / "model.safetensors")) >= set(reference) - {"cls.predictions.bias"}

    fill = transformers.pipeline("fill-mask", model=str(out), tokenizer=str(out))
    predictions = fill("the cat [MASK] on the mat.")
    assert len(predictions) == 5 and all(p["token_str"] for p in predictions)

    _, info = transformers.AutoModelForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"]
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in info["unexpected_keys"]} <= {"bert.pooler",
                                                                                          "cls.seq_relationship"}
    _, info = transformers.BertForSequenceClassification.from_pretrained(out, num_labels=3,
                                                                        output_loading_info=True)
    assert set(info["missing_keys"]) <= {"classifier.weight", "classifier.bias"}
    assert all(k.startswith("cls.") for k in info["unexpected_keys"])


def test_explicit_tag_and_no_verify(checkpoints, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()  # an existing empty directory is fine
    assert convert_checkpoint(stage_checkpoint_dir(checkpoints, 2), out, tag=TAG, verify=False) is None
    assert (out / "model.safetensors").is_file()


STEP3, STEP5, STEP7 = tag_for(0, 3), tag_for(0, 5), tag_for(0, 7)


def _fake_checkpoint(root: Path, tags=(STEP5,), latest=True, vocab_tokens=29, vocab_size=29) -> Path:
    """Just enough layout for the refusals, which all happen before any tensor is read."""
    ckpt = root / "ckpt"
    ckpt.mkdir()
    for tag in tags:
        (ckpt / tag).mkdir()
        (ckpt / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
        (ckpt / tag / RUN_STATE_NAME).write_text("{}")
    if latest and tags:
        (ckpt / "latest").write_text(tags[-1])
    from bert_ds.config import model_preset

    model_preset("tiny", vocab_size=vocab_size).save(ckpt / "model_config.json")
    (ckpt / "tokenizer").mkdir()
    (ckpt / "tokenizer" / "vocab.txt").write_text("".join(f"{t}\n" for t in VOCAB[:vocab_tokens]))
    return ckpt


@pytest.mark.parametrize("case, pattern", [
    ("empty", "no bert_ds checkpoint here"),
    ("no_latest", rf"no 'latest' file .*complete ones: \['{STEP5}'\]$"),
    ("bad_tag", rf"tag 'phase1-step000009' not found; available: \['{STEP3}', '{STEP5}'\]"),
    ("incomplete", rf"{STEP7}: no run_state.json, so this checkpoint is incomplete .*\['{STEP5}'\]"),
    ("vocab", r"model_config.json: vocab_size=29 but .*vocab.txt has 28 tokens"),
    ("out_exists", "already exists and is not an empty directory"),
    ("missing_dir", "not a directory"),
])
def test_bad_input_exits_2_with_one_clear_error(tmp_path, capsys, case, pattern):
    args = ["--out", str(tmp_path / "out")]
    if case == "empty":
        (tmp_path / "ckpt").mkdir()
        ckpt = tmp_path / "ckpt"
    elif case == "no_latest":
        ckpt = _fake_checkpoint(tmp_path, latest=False)
        # A save in progress and a tag being replaced are not checkpoints: never listed.
        (ckpt / f"{STEP7}.tmp").mkdir()
        (ckpt / f".{STEP3}.old").mkdir()
        (ckpt / f".{STEP3}.old" / RUN_STATE_NAME).write_text("{}")
    elif case == "bad_tag":
        ckpt = _fake_checkpoint(tmp_path, tags=(STEP3, STEP5))
        args += ["--tag", "phase1-step000009"]
    elif case == "incomplete":
        ckpt = _fake_checkpoint(tmp_path)
        (ckpt / STEP7).mkdir()
        args += ["--tag", STEP7]
    elif case == "vocab":
        ckpt = _fake_checkpoint(tmp_path, vocab_tokens=28)
    elif case == "out_exists":
        ckpt = _fake_checkpoint(tmp_path)
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "keep.txt").write_text("x")
    else:
        ckpt = tmp_path / "nowhere"
    assert cli(["--checkpoint", str(ckpt), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert re.search(pattern, err), err
    if case == "out_exists":
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_verification_failure_exits_1_and_leaves_nothing(checkpoints, tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(stage_checkpoint_dir(checkpoints, 0), ckpt)
    real_consolidate = convert_module.consolidate_checkpoint

    def consolidate_then_corrupt_one_weight(ref):
        state = real_consolidate(ref)
        # Stands in for a wrong name map: the export writes the corrupted tensor, verification compares
        # against a clean copy.
        clean = {k: v.clone() for k, v in state.items()}
        state["bert.encoder.layer.1.output.dense.weight"][0].add_(0.5)  # one row: LayerNorm cannot cancel it
        monkeypatch.setattr(convert_module, "verify_export",
                            lambda out, _state, config, tokenizer_dir: verify_export(out, clean, config, tokenizer_dir))
        return state

    monkeypatch.setattr(convert_module, "consolidate_checkpoint", consolidate_then_corrupt_one_weight)
    assert cli(["--checkpoint", str(ckpt), "--out", str(tmp_path / "out")]) == 1
    assert "disagrees with bert_ds" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _damage_first_zero_file(ckpt: Path) -> Path:
    target = sorted((ckpt / TAG).glob("*optim_states.pt"))[0]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x40
    target.write_bytes(bytes(data))
    return target


@pytest.mark.parametrize("stage", (0, 2))
def test_damaged_checkpoint_file_is_named_and_nothing_exported(checkpoints, tmp_path, capsys, stage):
    """One flipped byte in a file of the tag fails the sha256 recorded at save: exit 2, one line naming the file."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(stage_checkpoint_dir(checkpoints, stage), ckpt)
    target = _damage_first_zero_file(ckpt) if stage else ckpt / TAG / "mp_rank_00_model_states.pt"
    if not stage:
        with open(target, "r+b") as f:
            f.truncate(target.stat().st_size - 1)
    assert cli(["--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint {TAG} is damaged: {target}:"), err
    assert not (tmp_path / "hf").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize(("field", "value", "pattern"), [
    ("lowercase", False, r"was trained with lowercase=False but .*tokenizer says lowercase=True"),
    ("vocab_sha256", "0" * 64, r"was trained with vocabulary sha256 0000000000000000\.\.\. but .*vocab\.txt has")])
def test_tokenizer_other_than_the_tag_learned_is_refused(checkpoints, tmp_path, capsys, field, value, pattern):
    """The tag records the vocabulary and casing it was trained with; a ``tokenizer/`` that differs is refused, naming
    both, instead of exporting the weights with another tokenizer as "verified"."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(stage_checkpoint_dir(checkpoints, 2), ckpt)
    state_path = ckpt / TAG / RUN_STATE_NAME
    state = json.loads(state_path.read_text())
    state[field] = value
    state_path.write_text(json.dumps(state))
    assert cli(["--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(pattern, err[0]), err
    assert not (tmp_path / "hf").exists()
