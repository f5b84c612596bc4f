"""``tools/extract_features.py`` against transformers' own ``output_hidden_states`` on an export made by the real
converter: each sequence run alone, unpadded, must give the rows the tool wrote from padded batches."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from bert_ds.downstream.features import FeatureSpec, extract_features
from tests.helpers.hf_export import random_tiny_export

REPO = Path(__file__).resolve().parents[1]
MAX_LEN = 24


def _cli():
    spec = importlib.util.spec_from_file_location("tools_extract_features", REPO / "tools" / "extract_features.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def export_dir(tokenizer_dir, tmp_path_factory) -> Path:
    # Four layers, so "the last four" are all encoder layers as in the paper (not the embedding output).
    return random_tiny_export(tokenizer_dir, tmp_path_factory.mktemp("features_export"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def text_file(english_corpus, tmp_path_factory) -> Path:
    """Real sentences of varied length (one longer than MAX_LEN WordPieces), a blank line, and a sentence pair."""
    sentences = [s for s in english_corpus.read_text(encoding="utf-8").splitlines() if s.strip()]
    short = [s for s in sentences if 3 <= len(s.split()) <= 8 and s.replace(" ", "").replace(",", "").isalpha()][:4]
    long = next(s for s in sentences if len(s.split()) > 40)
    lines = [short[0], long, "", short[1], f"{short[2]} ||| {short[3]}"]
    path = tmp_path_factory.mktemp("features_text") / "input.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _reference(export_dir: Path, a: str, b: str | None) -> tuple[list[str], tuple[torch.Tensor, ...]]:
    """WordPieces and hidden states (each (T, H)) of one sequence, unbatched, straight from transformers."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
    model = transformers.BertModel.from_pretrained(export_dir).eval()
    enc = tokenizer(a, b, truncation=True, max_length=MAX_LEN, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc, output_hidden_states=True).hidden_states
    return tokenizer.convert_ids_to_tokens(enc["input_ids"][0]), tuple(h[0] for h in hidden)


def _input_pairs(text_file: Path) -> list[tuple[int, str, str | None]]:
    out = []
    for number, line in enumerate(text_file.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            a, _, b = line.partition(" ||| ")
            out.append((number, a, b or None))
    return out


def test_last_four_layers_concatenated_per_token(export_dir, text_file, tmp_path, capsys):
    out = tmp_path / "features.npy"
    # Batch size 3 over 4 sequences: padding inside a batch and a short last batch.
    assert _cli()(["--model", str(export_dir), "--input", str(text_file), "--out", str(out),
                   "--max-seq-length", str(MAX_LEN), "--batch-size", "3", "--device", "cpu"]) == 0
    assert "wrote" in capsys.readouterr().out
    features = np.load(out)
    sidecar = json.loads(out.with_suffix(".json").read_text())
    hidden_size = transformers.AutoConfig.from_pretrained(export_dir).hidden_size
    pairs = _input_pairs(text_file)
    assert features.dtype == np.float32 and list(features.shape) == sidecar["shape"]
    assert features.shape[0] == len(pairs) == 4 and features.shape[2] == 4 * hidden_size
    assert sidecar["hidden_state_indices"] == [4, 3, 2, 1] and sidecar["pooling"] == "tokens"
    assert [s["line"] for s in sidecar["sequences"]] == [1, 2, 4, 5]
    assert [s["truncated"] for s in sidecar["sequences"]] == [False, True, False, False]
    assert [s["pair"] for s in sidecar["sequences"]] == [False, False, False, True]
    for row, (_, a, b), seq in zip(features, pairs, sidecar["sequences"], strict=True):
        tokens, hidden = _reference(export_dir, a, b)
        assert seq["tokens"] == tokens
        want = torch.cat([hidden[-1], hidden[-2], hidden[-3], hidden[-4]], dim=-1).numpy()
        np.testing.assert_allclose(row[:len(tokens)], want, rtol=1e-4, atol=1e-5)
        assert not row[len(tokens):].any()  # padding positions are zeros
    assert features.shape[1] == MAX_LEN  # the truncated line is the longest


@pytest.mark.parametrize("layers, combine, pooling", [((0, -1), "sum", "cls"), ((-2,), "concat", "mean"),
                                                      ((1, 2), "mean", "tokens"), ((-5, 4), "concat", "cls")])
def test_other_layers_combinations_and_poolings(export_dir, text_file, tmp_path, layers, combine, pooling):
    out = tmp_path / "f.npy"
    sidecar = extract_features(export_dir, text_file, out, FeatureSpec(layers, combine, pooling),
                               max_seq_length=MAX_LEN, batch_size=2, device="cpu")
    features = np.load(out)
    assert list(features.shape) == sidecar["shape"]
    for row, (_, a, b) in zip(features, _input_pairs(text_file), strict=True):
        _, hidden = _reference(export_dir, a, b)
        chosen = torch.stack([hidden[i] for i in layers])
        per_token = chosen.sum(0) if combine == "sum" else chosen.mean(0) if combine == "mean" else \
            torch.cat(list(chosen), dim=-1)
        want = per_token[0] if pooling == "cls" else per_token.mean(0) if pooling == "mean" else per_token
        got = row[:len(want)] if pooling == "tokens" else row
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("args, pattern", [
    (["--layers", "-6"], "indices run from -5 to 4"),
    (["--layers", "4,-1"], "name the same layer twice"),
    (["--layers", "last"], "comma-separated integers"),
    (["--max-seq-length", "512"], "max_position_embeddings=128"),
])
def test_bad_input_exits_2(export_dir, text_file, tmp_path, capsys, args, pattern):
    out = tmp_path / "f.npy"
    assert _cli()(["--model", str(export_dir), "--input", str(text_file), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bert-ds-extract-features: error: ") and len(err.splitlines()) == 1 and pattern in err, err
    assert list(tmp_path.iterdir()) == []


def test_default_layers_of_a_model_with_fewer_than_four(tokenizer_dir, text_file, tmp_path):
    """The default (the paper's last four) takes every encoder layer of a 2-layer model, never the embeddings; an
    explicit -4 is still refused."""
    small = random_tiny_export(tokenizer_dir, tmp_path / "two_layers", num_hidden_layers=2)
    out = tmp_path / "features.npy"
    assert _cli()(["--model", str(small), "--input", str(text_file), "--out", str(out), "--pooling", "cls",
                   "--device", "cpu"]) == 0
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["layers"] == [-1, -2] and sidecar["hidden_state_indices"] == [2, 1]
    assert np.load(out).shape[1] == 2 * transformers.AutoConfig.from_pretrained(small).hidden_size
    assert _cli()(["--model", str(small), "--input", str(text_file), "--out", str(tmp_path / "x.npy"),
                   "--layers=-1,-4", "--device", "cpu"]) == 2
