"""The demo (``make demo``, ``bert-ds-demo``): its pieces on their own, and ``tools/demo.py --quick`` end to end, then
what a second run into the same directory does differently from the first."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bert_ds.devtools.demo import (
    DEMO_RECIPE,
    MARKER,
    WARMUP_RECIPE,
    DemoSettings,
    NotDemoDirectory,
    demo_recipe,
    run_demo,
    split_corpus,
)
from bert_ds.recipe import Recipe
from tests.helpers import HANG_GUARD_S
from tests.helpers.runs import REPO

DEMO = REPO / "tools" / "demo.py"  # what `make demo` runs
SCRIPT = Path(sys.executable).parent / "bert-ds-demo"
SCORE_LINE = re.compile(r"held-out masked-LM accuracy of the export \((seq \d+)\): ([\d.]+)% of (\d+) masked "
                        r"positions vs unigram baseline ([\d.]+)% \(always '(.+)'\): ([\d.]+)x\n"
                        r" +at the (\d+) \[MASK\] positions alone: ([\d.]+)% vs ([\d.]+)% \(always '(.+)'\): "
                        r"([\d.]+)x")
GAIN_LINE = re.compile(r"^fine-tune word-order acceptability \(accuracy\): pre-trained ([\d.]+)  random init ([\d.]+)  "
                       r"majority ([\d.]+)  margin ([+-][\d.]+) points  \(held-out median of (\d+) seeds at each "
                       r"start's best lr: ([\d.e-]+) / ([\d.e-]+); per seed pre-trained/random ([\d./, ]+)\)$", re.M)


def test_split_corpus_holds_out_whole_documents(tmp_path):
    docs = [[f"Document {d} sentence {s}." for s in range(3)] for d in range(25)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join("\n".join(doc) for doc in docs) + "\n\n")
    n_train, n_held = split_corpus(corpus, tmp_path / "train.txt", tmp_path / "heldout.txt", every=10)
    assert (n_train, n_held) == (23, 2)  # every tenth document from the sixth: indices 5 and 15
    held = (tmp_path / "heldout.txt").read_text().split("\n\n")
    train = (tmp_path / "train.txt").read_text()
    assert [block.splitlines() for block in held if block.strip()] == [docs[5], docs[15]]
    assert not any(f"Document {d} " in train for d in (5, 15))
    assert all(f"Document {d} sentence 2." in train for d in range(25) if d % 10 != 5)


def test_demo_refuses_a_directory_it_did_not_make(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(NotDemoDirectory, match=re.escape(f"{tmp_path} holds files the demo did not write")):
        run_demo(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]  # nothing written, nothing removed
    done = subprocess.run([str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"bert-ds-demo: error: {tmp_path} holds files the demo did not write"), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("source", [DEMO_RECIPE, WARMUP_RECIPE], ids=["main", "warmup"])
@pytest.mark.parametrize("quick", [False, True])
def test_demo_recipes_are_valid_and_quick_is_shorter(quick, source):
    data = demo_recipe(quick, source)
    recipe = Recipe.from_dict(data, source=source.name)
    assert recipe.optimizer.name == "lamb" and recipe.deepspeed.zero_stage == 2
    expected = [128, 512] if source == DEMO_RECIPE else [DemoSettings().warmup_seq_len]
    assert [p.seq_len for p in recipe.phases] == expected
    full = Recipe.from_dict(demo_recipe(False, source))
    steps = [p.steps for p in recipe.phases]
    assert (steps < [p.steps for p in full.phases]) == quick and all(s > 0 for s in steps)
    # Dropout as shipped: the demo trains the model users get, not a dropout-free variant.
    config = recipe.model_config(vocab_size=DemoSettings().vocab_size)
    assert config.hidden_dropout_prob == 0.1 and config.attention_probs_dropout_prob == 0.1
    # The main run starts from the warm-up's export: the same model shape, or --init-from-hf refuses it.
    warmup = Recipe.from_dict(demo_recipe(quick, WARMUP_RECIPE))
    assert warmup.model_config(vocab_size=4000) == recipe.model_config(vocab_size=4000)


def _run_demo(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEMO), "--quick", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=HANG_GUARD_S)


@pytest.mark.e2e
def test_quick_demo_end_to_end_and_again(tmp_path, capsys):
    out = tmp_path / "demo"
    first = _run_demo(out)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    scores = {m[1]: m for m in SCORE_LINE.finditer(first.stdout)}
    assert set(scores) == {"seq 128", "seq 512"}, first.stdout[-4000:]
    # 10 + 6 + 6 steps learn next to nothing (the full recipe's figures are in the README, measured by `make demo`):
    # here the numbers must be well formed and consistent: English-like baselines, 80% of chosen positions at [MASK].
    for m in scores.values():
        accuracy, positions, baseline, ratio = float(m[2]), int(m[3]), float(m[4]), float(m[6])
        mask_positions, mask_accuracy, mask_baseline, mask_ratio = int(m[7]), float(m[8]), float(m[9]), float(m[11])
        assert positions > 3000 and 2 < baseline < 15 and 0 <= accuracy <= 100, m[0]
        assert 0.75 < mask_positions / positions < 0.85 and 2 < mask_baseline < 15 and 0 <= mask_accuracy <= 100, m[0]
        assert abs(ratio - accuracy / baseline) < 0.02 and abs(mask_ratio - mask_accuracy / mask_baseline) < 0.02
    examples = re.findall(r"^\s+\[(\w+)\] -> (.+)$", first.stdout, flags=re.M)
    assert len(examples) >= 4, first.stdout[-3000:]
    assert all(len(top.split(" | ")) == 3 for _, top in examples)
    assert "sequence-length warm-up at seq 32" in first.stdout
    # The demo ends with the pre-trained vs random-init fine-tune (quick: one seed and rate on a small task, shape
    # only; the full demo fails unless the export wins, and docs/demo.md has the measured figures).
    gain = GAIN_LINE.search(first.stdout)
    assert gain, first.stdout[-3000:]
    pre, rnd, majority, margin = float(gain[1]), float(gain[2]), float(gain[3]), float(gain[4])
    assert int(gain[5]) == 1 and gain[6] == gain[7] == "0.001" and gain[8] == f"{pre:.1f}/{rnd:.1f}", gain[0]
    assert majority == 50.0, gain[0]  # balanced labels
    assert abs(margin - (pre - max(rnd, majority))) < 0.11, gain[0]
    assert "held-out: " in first.stdout and " near duplicates of training text" in first.stdout
    last = [line for line in first.stdout.splitlines() if line.strip()][-2:]
    assert last[0] == gain[0] and last[1].startswith("demo finished in"), last
    assert "both phases from the warm-up's weights" in first.stdout
    assert f"$ bert-ds-plot-run {out / 'run'} --out {out / 'curves.png'}" in first.stdout
    for line in ("plot: ", "export: ", "run: ", "warm-up: ", "training log: "):
        assert line in first.stdout
    png = out / "curves.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 40_000
    assert (out / MARKER).is_file() and (out / "train.log").stat().st_size > 0

    from transformers import pipeline

    fill = pipeline("fill-mask", model=str(out / "export"), device=-1, top_k=2)
    assert len(fill("This program is free [MASK] .")) == 2

    _again_reuses_the_data_and_replaces_the_outputs(out, capsys)


def _again_reuses_the_data_and_replaces_the_outputs(out: Path, capsys) -> None:
    """A second ``make demo`` into ``out``: the directory is accepted (it holds the demo's marker), the data is
    reused unchanged (same text, settings and dedup rule), and each output of the first run is replaced before it
    is written again. The rest of a second run is the first run's code on the same inputs."""
    from bert_ds.devtools import demo

    data = {p: p.stat().st_mtime_ns for p in (out / "data").rglob("*") if p.is_file()}
    capsys.readouterr()
    demo._own_dir(out)
    dirs = demo.prepare_data(out, DemoSettings())
    said = capsys.readouterr().out
    assert f"reusing {out / 'data'}/" in said and "rebuilding" not in said, said
    assert dirs == demo._data_dirs(out / "data")
    assert {p: p.stat().st_mtime_ns for p in (out / "data").rglob("*") if p.is_file()} == data  # nothing rewritten
    assert {p.name for p in out.iterdir() if p.is_dir()} == {"data", *demo.REPLACED}
    for name, what in demo.REPLACED.items():
        demo.replace_output(out / name)
        assert capsys.readouterr().out == f"    replacing the previous {what} {out / name}\n"
        assert not (out / name).exists()


def test_word_order_task_shuffles_every_other_sentence_of_its_own_text(english_corpus):
    from bert_ds.devtools.pretraining_gain import ORIGINAL, SHUFFLED, usable_sentences, word_order_examples

    sentences = {" ".join(words) for words in usable_sentences(english_corpus)}
    by_words: dict[tuple, set[str]] = {}
    for sentence in sentences:
        words = sentence.split()
        by_words.setdefault((words[0], words[-1], *sorted(words[1:-1])), set()).add(sentence)
    records = word_order_examples(english_corpus, 300, seed=3)
    assert [r["label"] for r in records] == [ORIGINAL, SHUFFLED] * 150  # balanced: the majority label scores 50%
    assert len({r["text"] for r in records}) == 300
    for record in records:
        words = record["text"].split()
        if record["label"] == ORIGINAL:
            assert record["text"] in sentences, record
            continue
        # a sentence of the text with the same first and last word and the same inner words, in another order
        sources = by_words.get((words[0], words[-1], *sorted(words[1:-1])), set())
        assert sources and record["text"] not in sources, record


def test_gain_margin_is_against_the_better_of_random_init_and_majority_at_each_best_rate():
    from bert_ds.devtools.pretraining_gain import MIN_GAIN, GainResult

    result = GainResult(pretrained={3e-4: [0.60, 0.62, 0.61], 1e-3: [0.74, 0.76, 0.70]},
                        random_init={3e-4: [0.55, 0.51, 0.53], 1e-3: [0.50, 0.52, 0.50]}, majority=0.5)
    assert abs(result.margin - (0.74 - 0.53)) < 1e-12 and result.helps
    assert "best lr: 0.001 / 0.0003;" in result.line() and "random 74.0/55.0, 76.0/51.0, 70.0/53.0)" in result.line()
    assert not GainResult({1e-3: [0.55]}, {1e-3: [0.40]}, majority=0.52).helps  # 3 points above majority
    assert GainResult({1e-3: [0.571 + MIN_GAIN]}, {1e-3: [0.57]}, majority=0.5).helps
    assert not GainResult({1e-3: [0.569 + MIN_GAIN]}, {1e-3: [0.57]}, majority=0.5).helps
