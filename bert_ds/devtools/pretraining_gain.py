"""Does pre-training help? The demo's last step: one real-text task fine-tuned from the export and from random init.

The task, shuffled-word detection, is built from the demo's own English text and is neither of the pre-training tasks:
a sentence is shown either as written or with the words between its first and its last word shuffled (label 1), 50/50.
Both versions hold the same words, the same first and last word and the same length, and the tokenizer is uncased, so
only word order tells them apart: a model must know which orders English uses, which masked-LM teaches. Training
sentences come from the demo's training text, evaluation sentences from its held-out documents (never seen in
pre-training or fine-tuning). The same architecture, fine-tuned with the same settings and seeds from random
initialisation (transformers' normal(0, 0.02) init, as pre-training starts), is the comparison; the majority label is
the floor. Fine-tuning is ``bert_ds.downstream.finetune.finetune`` itself.

An earlier version swapped two adjacent words only: measured on a full demo, both starts stayed at the majority label
(pre-trained 50.5%, random 48.8%, majority 48.8%): one swap in twenty words is too faint a signal for a 2-layer model
fine-tuned for 190 steps.
"""

from __future__ import annotations

import csv
import random
import shutil
import statistics
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["GainSettings", "GainResult", "shuffle_examples", "write_shuffle_task", "random_init_copy", "compare"]

TASK = "shuffled-word detection"
MIN_GAIN = 0.05
"""How far (accuracy) the export's median must beat both random init's median and the majority label for the demo
to pass: measured 22-25 points above random init (docs/demo.md), so 5 points is a rule about learning, not noise."""


@dataclass(frozen=True)
class GainSettings:
    """The comparison's fine-tuning settings (identical for both starts)."""

    n_train: int = 2000
    n_eval: int = 600
    seeds: tuple[int, ...] = (1, 2, 3)
    epochs: float = 3.0
    learning_rate: float = 1e-3
    """One rate for both starts. The paper's 5e-5 range is for 110M-parameter models; this 2-layer, 128-wide model
    needs more. Measured on one demo export, seed 1 (pre-trained / random init): 1e-4 60.3% / 50.5%, 3e-4 68.0% /
    47.7%, 1e-3 77.5% / 52.0% (majority 47.7%): random init stays at chance at every rate tried."""
    batch_size: int = 32
    max_seq_length: int = 64


@dataclass
class GainResult:
    pretrained: list[float] = field(default_factory=list)
    """Held-out accuracy per seed, fine-tuned from the export."""
    random_init: list[float] = field(default_factory=list)
    majority: float = 0.0

    @property
    def margin(self) -> float:
        """The export's median over seeds minus the better of random init's median and the majority label."""
        return statistics.median(self.pretrained) - max(statistics.median(self.random_init), self.majority)

    @property
    def helps(self) -> bool:
        return self.margin >= MIN_GAIN

    def line(self) -> str:
        def pct(xs: list[float]) -> str:
            return f"{100 * statistics.median(xs):.1f}%"

        pairs = zip(self.pretrained, self.random_init, strict=True)
        seeds = ", ".join(f"{100 * p:.1f}/{100 * r:.1f}" for p, r in pairs)
        return (f"fine-tune {TASK}: pre-trained {pct(self.pretrained)}  random init {pct(self.random_init)}  "
                f"majority {100 * self.majority:.1f}%  margin {100 * self.margin:+.1f} points  (held-out median of "
                f"{len(self.pretrained)} seeds; per seed pre-trained/random {seeds})")


def _sentences(text: Path) -> list[list[str]]:
    words = []
    for line in text.read_text(encoding="utf-8").splitlines():
        w = line.split()
        if 6 <= len(w) <= 30 and sum(x.isalpha() for x in w[1:]) >= 3:
            words.append(w)
    return words


def shuffle_examples(text: Path, count: int, seed: int) -> list[tuple[str, int]]:
    """``count`` (sentence, label) pairs from ``text`` (one sentence a line): label 1 when the words between the first
    and the last were shuffled into another order. Each sentence is used at most once."""
    rng = random.Random(seed)
    sentences = _sentences(text)
    rng.shuffle(sentences)
    examples = []
    for words in sentences:
        if len(examples) == count:
            break
        label = rng.randrange(2)
        if label:
            inner = words[1:-1]
            shuffled = rng.sample(inner, len(inner))
            if shuffled == inner:
                continue
            words = [words[0], *shuffled, words[-1]]
        examples.append((" ".join(words), label))
    if len(examples) < count:
        raise ValueError(f"{text}: only {len(examples)} usable sentences, {count} wanted")
    return examples


def write_shuffle_task(train_text: Path, heldout_text: Path, out: Path, settings: GainSettings) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text, count in (("train", train_text, settings.n_train), ("dev", heldout_text, settings.n_eval)):
        path = out / f"{name}.csv"
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows(shuffle_examples(text, count, seed=len(name)))
        paths.append(path)
    return paths[0], paths[1]


def random_init_copy(export_dir: Path, out: Path, seed: int) -> Path:
    """The export's architecture and tokenizer with freshly initialised weights (what pre-training started from)."""
    import torch
    import transformers

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch.manual_seed(seed)
    model = transformers.BertForPreTraining(transformers.BertConfig.from_pretrained(export_dir))
    model.save_pretrained(out)
    for path in export_dir.iterdir():
        if path.is_file() and path.suffix in (".txt", ".json") and path.name != "config.json":
            shutil.copy(path, out / path.name)
    return out


def _accuracy(model: Path, train: Path, dev: Path, out: Path, seed: int, settings: GainSettings) -> tuple[float, float]:
    from bert_ds.downstream.finetune import FinetuneArgs, finetune

    if out.exists():
        shutil.rmtree(out)
    metrics = finetune(FinetuneArgs(
        model=str(model), out=str(out), task="sequence", train_file=str(train), validation_file=str(dev),
        text_column="text", label_column="label", max_seq_length=settings.max_seq_length, epochs=settings.epochs,
        batch_size=settings.batch_size, learning_rate=settings.learning_rate, seed=seed, device="cpu",
        logging_steps=1000))
    return metrics["after"]["accuracy"], metrics["majority_accuracy"]


def compare(export_dir: Path, train_text: Path, heldout_text: Path, work: Path,
            settings: GainSettings | None = None) -> GainResult:
    """Fine-tune the export and a random-init copy on the shuffle task for each seed; held-out accuracies."""
    settings = settings or GainSettings()
    train, dev = write_shuffle_task(train_text, heldout_text, work / "data", settings)
    result = GainResult()
    for seed in settings.seeds:
        random_dir = random_init_copy(export_dir, work / "random_init", seed)
        pre, result.majority = _accuracy(export_dir, train, dev, work / f"pretrained_seed{seed}", seed, settings)
        rnd, _ = _accuracy(random_dir, train, dev, work / f"random_seed{seed}", seed, settings)
        result.pretrained.append(pre)
        result.random_init.append(rnd)
    return result
