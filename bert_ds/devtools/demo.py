"""The end-to-end demo behind ``make demo``: real English text to a fill-mask pipeline on 2 CPU ranks, in minutes.

Steps, each printed as it starts:

1. corpus: the English text every Debian machine has (``bert_ds.data.english_corpus``: the licence texts of
   ``/usr/share/common-licenses`` and the Python standard library's docstrings), split by document into training
   text and held-out text (every tenth document), then held-out sentences that duplicate training text removed
   (``bert_ds.devtools.heldout_dedup``: near-twin documents, exact and near duplicates), so no held-out sentence is
   trained on;
2. a WordPiece tokenizer trained on the training text;
3. seq-32 warm-up shards, seq-128 and seq-512 training shards and held-out eval shards (tqdm bars);
4. a sequence-length warm-up (``ds_configs/demo_warmup_cpu.json``: one phase at seq 32) and its export (see
   :func:`_pretrain` for why);
5. both phases of ``ds_configs/demo_cpu.json`` (ZeRO-2, LAMB) on 2 CPU ranks with the ``deepspeed`` launcher, started
   from the warm-up's weights (``--init-from-hf``), one console line per log interval, evaluating on the held-out
   shards;
6. the Hugging Face export (``bert_ds.export``, verified against bert_ds's logits);
7. the exported model's held-out masked-LM accuracy computed with transformers, next to the unigram baseline (always
   answering the most frequent masked token of the same positions), overall and at [MASK] positions alone (see
   :class:`Score`), and ``pipeline("fill-mask")`` on held-out sentences;
8. the curves (``bert-ds-plot-run``, :mod:`bert_ds.devtools.plot_run`);
9. does pre-training help? A sentence-level task built from the same text, word-order acceptability
   (``bert_ds.devtools.pretraining_gain``), fine-tuned from the export and from random initialisation with the same
   seeds and learning rates, scored on held-out sentences next to the majority label; the demo's last line. The
   export must win by ``pretraining_gain.MIN_GAIN``.

Output directory (default ``demo_run/``): ``data/`` (corpus, tokenizer, shards and ``inputs.json``, what they were
made from) is reused when a later run would make the same data and rebuilt otherwise; ``warmup_run/``,
``warmup_export/``, ``run/``, ``export/``, ``finetune/``, ``curves.png`` and ``train.log`` are replaced by every
run. A directory the demo did not make is never touched.

Command line (what ``make demo`` runs): ``bert-ds-demo [--out demo_run] [--quick]``, also ``python tools/demo.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bert_ds.cli import alias
from bert_ds.cli_args import build_parser, defaults_of
from bert_ds.devtools.heldout_dedup import DedupReport, DedupRule, deduplicate_file, leaks, read_documents
from bert_ds.devtools.pretraining_gain import MIN_GAIN, TASK
from bert_ds.errors import StepFailed
from bert_ds.exit_codes import ExitCode

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["DEMO_RECIPE", "DemoError", "DemoSettings", "Score", "data_inputs", "demo_recipe", "export_scores",
           "fill_mask_examples", "NotDemoDirectory", "main", "prepare_data", "run_demo", "split_corpus"]

REPO = Path(__file__).resolve().parents[2]
DEMO_RECIPE = REPO / "ds_configs" / "demo_cpu.json"
WARMUP_RECIPE = REPO / "ds_configs" / "demo_warmup_cpu.json"
MARKER = ".bert_ds_demo"
"""Written into the output directory: the demo replaces outputs only inside a directory that holds it."""
TRAIN_RANKS = 2
MIN_RATIO = 2.0
"""The full demo fails unless the export's held-out masked-LM accuracy is this multiple of the baseline."""


class DemoError(StepFailed):
    """A step failed or the export did not learn enough: the message says which and what to do."""


class NotDemoDirectory(DemoError):
    """The output directory exists and holds something the demo did not write: it is left alone."""

    exit_code = ExitCode.BAD_INPUT


@dataclass(frozen=True)
class DemoSettings:
    """Everything the data depends on besides the corpus text (recorded in ``data/inputs.json``)."""

    vocab_size: int = 4000
    """A 1 MB corpus supports a small vocabulary (BERT's 30,522 would leave most entries rare)."""
    heldout_every: int = 10
    """Every N-th document (from the 6th) is held out."""
    dupe_factor_128: int = 5
    dupe_factor_512: int = 2
    dupe_factor_eval: int = 2
    """Two masked copies of the held-out text: ~8,000 masked positions per eval set at either length."""
    warmup_seq_len: int = 32
    dupe_factor_warmup: int = 5
    """The sequence-length warm-up's shards (``ds_configs/demo_warmup_cpu.json``; see :func:`run_demo`)."""
    seed: int = 1234
    samples_per_shard: int = 2000
    dedup: DedupRule = field(default_factory=DedupRule)
    """What the held-out text may not share with the training text (``bert_ds.devtools.heldout_dedup``)."""


@dataclass(frozen=True)
class Score:
    """Held-out masked-LM accuracy of one eval set next to its unigram baseline, overall and at [MASK] positions.

    The headline is the standard masked-LM accuracy (what ``bert_ds.evaluate`` and MLPerf report): over every position
    the shards chose for prediction (15% of tokens: 80% shown as [MASK], 10% as a random token, 10% unchanged),
    against always answering the most frequent original token of those positions. The [MASK] positions alone are
    reported beside it: there the model cannot copy its input, and a small model on a short CPU budget stays close
    to the baseline (what ``fill-mask`` shows)."""

    name: str
    accuracy: float
    """Correct predictions over every chosen position, [MASK], random and unchanged."""
    baseline: float
    """Share of the chosen positions whose original token is the most frequent one there."""
    baseline_token: str
    positions: int
    mask_accuracy: float
    """Correct predictions at positions whose input was [MASK] / those positions."""
    mask_baseline: float
    """Share of the [MASK] positions whose original token is the most frequent one there."""
    mask_baseline_token: str
    mask_positions: int

    @property
    def ratio(self) -> float:
        return self.accuracy / self.baseline if self.baseline else float("inf")

    @property
    def mask_ratio(self) -> float:
        return self.mask_accuracy / self.mask_baseline if self.mask_baseline else float("inf")


def _say(text: str) -> None:
    print(text, flush=True)


def split_corpus(corpus: Path, train: Path, heldout: Path, every: int) -> tuple[int, int]:
    """Split a BERT-layout file by document (blank-line separated): every ``every``-th document, starting at index
    ``every // 2``, goes to ``heldout``. Returns (training documents, held-out documents)."""
    docs = [d.strip("\n") for d in corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    held = [d for i, d in enumerate(docs) if i % every == every // 2]
    kept = [d for i, d in enumerate(docs) if i % every != every // 2]
    if not held or not kept:
        raise DemoError(f"{corpus}: {len(docs)} documents are too few to hold out every {every}th one")
    train.write_text("\n\n".join(kept) + "\n", encoding="utf-8")
    heldout.write_text("\n\n".join(held) + "\n", encoding="utf-8")
    return len(kept), len(held)


def _own_dir(out: Path) -> None:
    """Create ``out`` or accept it when it is the demo's; refuse a directory with anything else in it."""
    if out.exists() and not out.is_dir():
        raise NotDemoDirectory(f"{out} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise NotDemoDirectory(f"{out} holds files the demo did not write (no {MARKER} in it); choose another --out or "
                        f"empty it")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by bert_ds.devtools.demo: data/ is reused, the other outputs are replaced\n")


def _data_dirs(data: Path) -> dict[str, Path]:
    shards = {name: data / "shards" / name for name in ("warmup", "train128", "train512", "eval128", "eval512")}
    corpus = data / "corpus"
    return {"train": corpus / "train.txt", "heldout": corpus / "heldout.txt", "dedup": corpus / "dedup.json",
            "tokenizer": data / "tokenizer", **shards}


def data_inputs(corpus_sha256: str, settings: DemoSettings) -> dict:
    """What the data is made from, as ``data/inputs.json`` records it: the corpus text's sha256, the settings (the
    dedup rule's parameters among them), the dedup module's own sha256 (its rule may change without a parameter
    changing) and the shard format version. Data recorded with other inputs is rebuilt."""
    import bert_ds.devtools.heldout_dedup as dedup_module
    from bert_ds.data.format import FORMAT_VERSION

    dedup_code = hashlib.sha256(Path(dedup_module.__file__).read_bytes()).hexdigest()
    return {"corpus_sha256": corpus_sha256, "settings": asdict(settings), "dedup_code_sha256": dedup_code,
            "format_version": FORMAT_VERSION}


def _data_inputs(settings: DemoSettings) -> tuple[dict, Path]:
    """:func:`data_inputs` of the corpus as it would be built now, with the corpus file (in a temporary directory the
    caller removes)."""
    from bert_ds.data.english_corpus import build_english_corpus

    tmp = Path(tempfile.mkdtemp(prefix="bert_ds_demo_corpus_"))
    corpus = build_english_corpus(tmp / "english.txt", max_chars=10**9)  # all of it: ~1 MB
    return data_inputs(hashlib.sha256(corpus.read_bytes()).hexdigest(), settings), corpus


def _data_complete(dirs: dict[str, Path]) -> bool:
    from bert_ds.data.index import INDEX_NAME

    shards = [dirs[k] / INDEX_NAME for k in ("warmup", "train128", "train512", "eval128", "eval512")]
    return all(p.is_file() for p in [dirs["train"], dirs["heldout"], dirs["dedup"], dirs["tokenizer"] / "vocab.txt",
                                     *shards])


def _split_and_deduplicate(corpus: Path, dirs: dict[str, Path], settings: DemoSettings) -> DedupReport:
    """Step 1's split, then the held-out text cleared of training text, checked and its counts kept in
    ``dedup.json`` (shown again when the data is reused)."""
    n_train, n_held = split_corpus(corpus, dirs["train"], dirs["heldout"], settings.heldout_every)
    _say(f"    corpus: {n_train} training and {n_held} held-out documents -> {dirs['train'].parent}/")
    try:
        report = deduplicate_file(dirs["train"], dirs["heldout"], settings.dedup)
    except ValueError as exc:
        raise DemoError(str(exc)) from exc
    left = leaks(read_documents(dirs["train"]), read_documents(dirs["heldout"]), settings.dedup)
    if left:  # the claim docs/demo.md makes, checked on the files the shards are made from
        raise DemoError(f"{dirs['heldout']} still shares {len(left)} sentences with the training text: {left[:3]}")
    dirs["dedup"].write_text(json.dumps(asdict(report), indent=1) + "\n")
    return report


def prepare_data(out: Path, settings: DemoSettings) -> dict[str, Path]:
    """Corpus split, tokenizer and the four shard sets under ``out/data``: reused when ``data/inputs.json`` matches
    what they would be made from now, rebuilt otherwise. Returns the paths by name (``_data_dirs``)."""
    data = out / "data"
    dirs = _data_dirs(data)
    inputs, corpus = _data_inputs(settings)
    try:
        recorded = json.loads((data / "inputs.json").read_text()) if (data / "inputs.json").is_file() else None
        if recorded == inputs and _data_complete(dirs):
            _say(f"    reusing {data}/: corpus, tokenizer and shards were made from the same text and settings "
                 f"(corpus sha256 {inputs['corpus_sha256'][:12]}; delete {data} to rebuild)")
            _say("    " + DedupReport(**json.loads(dirs["dedup"].read_text())).line())
            return dirs
        if data.exists():
            why = "incomplete" if recorded == inputs else "made from other text, settings or dedup rule"
            _say(f"    rebuilding {data}/: the previous data was {why}")
            shutil.rmtree(data)
        dirs["train"].parent.mkdir(parents=True)
        report = _split_and_deduplicate(corpus, dirs, settings)
    finally:
        shutil.rmtree(corpus.parent, ignore_errors=True)
    _say("    " + report.line())
    _build_data(dirs, settings)
    (data / "inputs.json").write_text(json.dumps(inputs, indent=1) + "\n")  # last: marks the data complete
    return dirs


def _build_data(dirs: dict[str, Path], settings: DemoSettings) -> None:
    from bert_ds.data.create import create_shards
    from bert_ds.data.tokenizer import train_tokenizer

    _say(f"==> [2/9] WordPiece tokenizer ({settings.vocab_size} tokens, uncased) on the training text")
    train_tokenizer([dirs["train"]], dirs["tokenizer"], vocab_size=settings.vocab_size)
    _say(f"    -> {dirs['tokenizer']}/vocab.txt")
    _say(f"==> [3/9] shards: seq {settings.warmup_seq_len} (warm-up), 128 and 512 of the training text, 128 and 512 "
         f"of the held-out text (static 15% masking, NSP pairs)")
    plan = [("warmup", "train", settings.warmup_seq_len, settings.dupe_factor_warmup),
            ("train128", "train", 128, settings.dupe_factor_128), ("train512", "train", 512, settings.dupe_factor_512),
            ("eval128", "heldout", 128, settings.dupe_factor_eval), ("eval512", "heldout", 512,
                                                                      settings.dupe_factor_eval)]
    for name, text, seq_len, dupe in plan:
        index = create_shards([dirs[text]], dirs["tokenizer"], dirs[name], seq_len=seq_len, dupe_factor=dupe,
                              seed=settings.seed, workers=min(2, os.cpu_count() or 1),
                              samples_per_shard=settings.samples_per_shard, progress=True)
        _say(f"    {name}: {index.total_samples} samples in {len(index.shards)} shards -> {dirs[name]}/")


def demo_recipe(quick: bool, path: Path = DEMO_RECIPE) -> dict:
    """A demo recipe (``ds_configs/demo_cpu.json`` or ``demo_warmup_cpu.json``); ``quick`` cuts every phase to 6 steps
    (the warm-up to 10): a test-sized run of every step, too short to learn."""
    recipe = json.loads(path.read_text())
    if quick:
        recipe["name"] = recipe["name"] + "_quick"
        for phase in recipe["phases"]:
            phase["steps"] = 10 if len(recipe["phases"]) == 1 else 6
            phase["eval_interval"] = 0  # evaluate at the phase end only
        recipe["logging"]["interval"] = 5
    return recipe


def _train_command(recipe: Path, data: list[Path], eval_data: list[Path], tokenizer: Path, run: Path,
                   extra: tuple[str, ...] = ()) -> list[str]:
    from bert_ds.runtime.distributed import free_port

    launcher = Path(sys.executable).parent / "deepspeed"
    if not launcher.is_file():
        raise DemoError(f"{launcher}: the deepspeed launcher is not installed in this environment (run `make venv`)")
    evaluation = ["--eval-data", *map(str, eval_data)] if eval_data else []
    return [str(launcher), "--num_gpus", str(TRAIN_RANKS), "--master_port", str(free_port()),
            str(REPO / "bert_ds" / "runtime" / "pretrain.py"), "--recipe", str(recipe), "--data", *map(str, data),
            "--tokenizer", str(tokenizer), *evaluation, "--output", str(run), *extra]


def _progress_line(line: str) -> str | None:
    """The console form of a launcher output line, or None to leave it in train.log only: bert_ds's step, eval and
    checkpoint lines and its phase hand-off note (without the timestamp); DeepSpeed's start-up chatter stays out."""
    if line.startswith(("step ", "eval step ", "checkpoint ", "bert_ds.runtime.pretrain: error", "Traceback")):
        return line.rstrip()
    if " bert_ds.runtime.pretrain INFO phase " in line:
        return line.split(" INFO ", 1)[1].rstrip()
    return None


def train(cmd: list[str], log_path: Path) -> None:
    """Run a ``_train_command`` on ``TRAIN_RANKS`` CPU ranks; the launcher's output goes to ``log_path`` and bert_ds's
    progress lines also to the console."""
    _say("    $ " + " ".join(cmd))
    # CPU ranks even where a GPU exists (the recipe is sized for them); one thread per rank on a 2-core machine.
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    env.setdefault("OMP_NUM_THREADS", "1")
    with open(log_path, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        shown = None
        for line in proc.stdout:
            log.write(line)
            text = _progress_line(line)
            if text is not None and text != shown:  # every rank logs the hand-off note: show it once
                print("    " + text, flush=True)
                shown = text
        code = proc.wait()
    if code != 0:
        tail = "".join(log_path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-30:])
        raise DemoError(f"training exited with status {code}; the last lines of {log_path}:\n{tail}")


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' load-time notes (the export's NSP head is unused by a masked-LM model, by design)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()


def _pretraining_model(export_dir: Path):
    """The export's ``BertForPreTraining`` as transformers loads it."""
    import transformers

    with _quiet_transformers():
        return transformers.BertForPreTraining.from_pretrained(export_dir).eval()


def _predictions(model, loader) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """(input token, prediction, label) at every chosen position of every batch, each of shape (N,)."""
    import torch

    from bert_ds.config import IGNORE_INDEX

    with torch.no_grad():
        for batch in loader:
            hidden = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                token_type_ids=batch["token_type_ids"]).last_hidden_state  # (B, S, H)
            labels = batch["masked_lm_ids"]  # (B, P), IGNORE_INDEX in unused slots
            valid = labels != IGNORE_INDEX
            rows = torch.arange(labels.shape[0]).unsqueeze(1).expand_as(labels)[valid]  # (N,)
            positions = batch["masked_lm_positions"][valid]  # (N,)
            logits = model.cls.predictions(hidden[rows, positions])  # (N, V): only the chosen positions
            yield batch["input_ids"][rows, positions], logits.argmax(-1), labels[valid]


def export_scores(export_dir: Path, eval_dirs: dict[str, Path], batch_size: int = 16) -> list[Score]:
    """:class:`Score` of the exported model, run by transformers, on each held-out shard set."""
    from bert_ds.data.loader import build_eval_loader
    from bert_ds.data.tokenizer import read_vocab, vocab_sha256

    model = _pretraining_model(export_dir)
    vocab = read_vocab(export_dir / "vocab.txt")
    mask_id = vocab.index("[MASK]")
    scores = []
    for name, data_dir in eval_dirs.items():
        # The export's vocab.txt must hash like the shards' tokenizer: the ids below mean the same words.
        loader = build_eval_loader(data_dir, micro_batch_size=batch_size,
                                   expected_vocab_sha256=vocab_sha256(export_dir / "vocab.txt"))
        labels_all: Counter = Counter()
        mask_labels: Counter = Counter()
        correct = mask_correct = 0
        for inputs, predicted, labels in _predictions(model, loader):
            hit, at_mask = predicted == labels, inputs == mask_id
            correct += int(hit.sum())
            mask_correct += int(hit[at_mask].sum())
            labels_all.update(labels.tolist())
            mask_labels.update(labels[at_mask].tolist())
        (top, top_count), (mask_top, mask_top_count) = labels_all.most_common(1)[0], mask_labels.most_common(1)[0]
        positions, mask_positions = sum(labels_all.values()), sum(mask_labels.values())
        scores.append(Score(name, correct / positions, top_count / positions, vocab[top], positions,
                            mask_correct / mask_positions, mask_top_count / mask_positions, vocab[mask_top],
                            mask_positions))
    return scores


def _word_counts(path: Path) -> Counter:
    import re

    return Counter(re.findall(r"[a-z]+", path.read_text(encoding="utf-8").lower()))


def _pick_sentences(heldout: Path, counts: Counter, vocab: set[str], count: int) -> list[tuple[str, str]]:
    """(sentence with one word replaced by [MASK], that word) for ``count`` held-out sentences of 8-24 words, one
    per held-out document while they last. The masked word is the sentence's most frequent word in the training text
    among its letters-only words that are whole vocabulary entries, after the first two words: a word the context
    determines often enough for a small model, chosen by a rule rather than by looking at the predictions."""
    picked: list[tuple[str, str]] = []
    docs = [d.splitlines() for d in heldout.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    for doc in docs * 2:  # a second pass takes a second sentence per document if the first gave too few
        for sentence in doc:
            words = sentence.split()
            candidates = [(counts[w.lower()], -i, i) for i, w in enumerate(words)
                          if i >= 2 and w.isalpha() and w.isascii() and w.lower() in vocab]
            if not 8 <= len(words) <= 24 or not candidates or "[" in sentence:
                continue
            if any(sentence == s.replace("[MASK]", w) for s, w in picked):
                continue
            i = max(candidates)[2]
            picked.append((" ".join([*words[:i], "[MASK]", *words[i + 1:]]), words[i]))
            break
        if len(picked) == count:
            break
    return picked


def fill_mask_examples(export_dir: Path, heldout: Path, train_text: Path, count: int = 6) -> list[dict]:
    """``pipeline("fill-mask")`` over the export on ``count`` held-out sentences: per sentence its masked text, the
    original word and the top 3 (token, score)."""
    from transformers import pipeline

    from bert_ds.data.tokenizer import read_vocab

    vocab = set(read_vocab(export_dir / "vocab.txt"))
    sentences = _pick_sentences(heldout, _word_counts(train_text), vocab, count)
    with _quiet_transformers():
        fill = pipeline("fill-mask", model=str(export_dir), device=-1, top_k=3)
    results = []
    for text, word in sentences:
        predictions = fill(text)
        results.append({"text": text, "word": word,
                        "top": [(p["token_str"], float(p["score"])) for p in predictions]})
    return results


REPLACED = {"warmup_run": "warm-up run", "warmup_export": "warm-up export", "run": "run", "export": "export",
            "finetune": "fine-tuning runs"}
"""The directories a run writes under ``--out`` (besides ``data/``, which is reused) and what they are called: a
second run removes each just before it writes it again."""


def replace_output(path: Path) -> None:
    """Remove ``path`` (one of :data:`REPLACED` under ``--out``) left by a previous run, saying so."""
    if path.exists():
        _say(f"    replacing the previous {REPLACED[path.name]} {path}")
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _export(run: Path, export_dir: Path) -> None:
    import io

    from bert_ds.export import convert_checkpoint

    replace_output(export_dir)
    chatter = io.StringIO()  # DeepSpeed's zero_to_fp32 narrates on stdout: shown only if the export fails
    try:
        with contextlib.redirect_stdout(chatter), _quiet_transformers():
            mlm_diff, _ = convert_checkpoint(run / "checkpoints", export_dir, verify=True)
    except Exception as exc:
        raise DemoError(f"export of {run / 'checkpoints'} failed: {exc}\n{chatter.getvalue()[-3000:]}") from exc
    _say(f"    -> {export_dir}/ (reloaded with transformers: same token ids, max |MLM logit diff| {mlm_diff:.1e})")


def _plot(run: Path, png: Path) -> None:
    # A process of its own, as a user would run it: matplotlib's Agg backend and pyplot state stay out of the demo's.
    args = [str(run), "--out", str(png)]
    _say("    $ bert-ds-plot-run " + " ".join(args))
    proc = subprocess.run([sys.executable, "-m", "bert_ds.devtools.plot_run", *args], cwd=REPO, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise DemoError(f"bert-ds-plot-run exited with status {proc.returncode}: {proc.stderr.strip()}")
    _say("    " + proc.stdout.strip())


def _report(scores: list[Score], examples: list[dict]) -> None:
    _say("    fill-mask on held-out sentences (top 3 with probabilities; the word that was there in brackets):")
    for ex in examples:
        top = " | ".join(f"{token} {score:.2f}" for token, score in ex["top"])
        _say(f"      {ex['text']}\n        [{ex['word']}] -> {top}")
    for s in scores:
        _say(f"    held-out masked-LM accuracy of the export ({s.name}): {100 * s.accuracy:.1f}% of {s.positions} "
             f"masked positions vs unigram baseline {100 * s.baseline:.1f}% (always {s.baseline_token!r}): "
             f"{s.ratio:.2f}x")
        _say(f"      at the {s.mask_positions} [MASK] positions alone: {100 * s.mask_accuracy:.1f}% vs "
             f"{100 * s.mask_baseline:.1f}% (always {s.mask_baseline_token!r}): {s.mask_ratio:.2f}x")


def _write_recipe(path: Path, quick: bool, source: Path) -> dict:
    """Write the (quick or full) demo recipe from ``source`` to ``path``; returns it."""
    recipe = demo_recipe(quick, source)
    path.write_text(json.dumps(recipe, indent=1) + "\n")
    return recipe


def _pretrain(out: Path, dirs: dict[str, Path], quick: bool) -> Path:
    """Steps 4-6: the sequence-length warm-up, its export, then both phases from its weights; returns the run.

    The warm-up: the tiny model's attention stays almost uniform over 128 positions for thousands of steps (its
    gradient into the query/key weights is spread over every position), so at [MASK] it answers the most frequent
    tokens. At 32 positions it learns to look at the neighbouring words within a few hundred steps, and keeps doing
    so at 128 (measured: the weight on the adjacent tokens 8x uniform after the warm-up, 2x without it). A separate
    one-phase run (``ds_configs/demo_warmup_cpu.json``), exported and handed to the main run with
    ``--init-from-hf``: the two phases themselves run exactly as a user's would."""
    warm_run, warm_export, run = out / "warmup_run", out / "warmup_export", out / "run"
    log_path = out / "train.log"
    log_path.write_text("")
    for path in (warm_run, warm_export, run):
        replace_output(path)
    recipe = out / "warmup_recipe.json"
    warmup = _write_recipe(recipe, quick, WARMUP_RECIPE)
    _say(f"==> [4/9] sequence-length warm-up at seq {warmup['phases'][0]['seq_len']} "
         f"({'quick: ' if quick else ''}{recipe}; from {WARMUP_RECIPE.relative_to(REPO)}), {TRAIN_RANKS} CPU ranks")
    train(_train_command(recipe, [dirs["warmup"]], [], dirs["tokenizer"], warm_run), log_path)
    _export(warm_run, warm_export)
    recipe = out / "recipe.json"
    _write_recipe(recipe, quick, DEMO_RECIPE)
    _say(f"==> [5/9] pre-training, both phases from the warm-up's weights ({'quick: ' if quick else ''}{recipe}; from "
         f"{DEMO_RECIPE.relative_to(REPO)}), ZeRO-2 + LAMB on {TRAIN_RANKS} CPU ranks")
    train(_train_command(recipe, [dirs["train128"], dirs["train512"]], [dirs["eval128"], dirs["eval512"]],
                         dirs["tokenizer"], run, ("--init-from-hf", str(warm_export))), log_path)
    return run


def _pretraining_gain(out: Path, dirs: dict[str, Path], export_dir: Path, quick: bool):
    """Step 9: the export vs random init, fine-tuned on word-order acceptability (quick: one small run, shape
    only)."""
    from bert_ds.devtools.pretraining_gain import GainSettings, compare

    settings = (GainSettings(n_train=160, n_eval=96, seeds=(1,), epochs=1.0, learning_rates=(1e-3,)) if quick
                else GainSettings())
    _say(f"==> [9/9] does pre-training help? fine-tune on {TASK}: {settings.n_train} training sentences, "
         f"{settings.n_eval} deduplicated held-out ones, seeds {list(settings.seeds)}, learning rates "
         f"{list(settings.learning_rates)}; the export vs the same architecture from random init")
    work = out / "finetune"
    replace_output(work)
    with _quiet_transformers():
        result = compare(export_dir, dirs["train"], dirs["heldout"], work, settings)
    for lr in settings.learning_rates:
        pairs = zip(settings.seeds, result.pretrained[lr], result.random_init[lr], strict=True)
        _say(f"    lr {lr:g}: " + ", ".join(f"seed {seed} pre-trained {100 * pre:.1f} random init {100 * rnd:.1f}"
                                             for seed, pre, rnd in pairs) + " (accuracy %)")
    return result


def run_demo(out: Path, *, quick: bool = False, settings: DemoSettings | None = None,
             min_ratio: float | None = None) -> list[Score]:
    """All nine steps into ``out``; returns the export's held-out scores. Raises DemoError when a step fails or
    (unless ``min_ratio`` is None) when an eval set's masked-LM accuracy is below ``min_ratio`` times its unigram
    baseline or fine-tuning the export does not beat random init by ``MIN_GAIN`` (step 9)."""
    settings = settings or DemoSettings()
    out = Path(out)
    _own_dir(out)
    _say("==> [1/9] corpus: English text on this machine (/usr/share/common-licenses, Python stdlib docstrings)")
    dirs = prepare_data(out, settings)
    export_dir, png, log_path = out / "export", out / "curves.png", out / "train.log"
    run = _pretrain(out, dirs, quick)
    _say("==> [6/9] Hugging Face export")
    _export(run, export_dir)
    _say("==> [7/9] the export under transformers: held-out accuracy and fill-mask")
    scores = export_scores(export_dir, {"seq 128": dirs["eval128"], "seq 512": dirs["eval512"]})
    _report(scores, fill_mask_examples(export_dir, dirs["heldout"], dirs["train"]))
    _say("==> [8/9] curves")
    _plot(run, png)
    gain = _pretraining_gain(out, dirs, export_dir, quick)
    _say(f"\ndone. run: {run}/ (checkpoints/, tensorboard/: `tensorboard --logdir {run / 'tensorboard'}`)\n"
         f"      warm-up: {out / 'warmup_run'}/, its export {out / 'warmup_export'}/\n"
         f"      training log: {log_path}\n      plot: {png}\n      export: {export_dir}/ "
         f"(transformers: BertForPreTraining / AutoModelForMaskedLM / pipeline('fill-mask'))\n"
         f"      fine-tuning runs: {out / 'finetune'}/")
    _say(gain.line())
    weak = [s for s in scores if min_ratio is not None and s.ratio < min_ratio]
    if weak:
        raise DemoError("the export did not learn enough: " + "; ".join(
            f"{s.name}: {100 * s.accuracy:.1f}% is {s.ratio:.2f}x the baseline, below {min_ratio}x"
            for s in weak))
    if min_ratio is not None and not gain.helps:
        raise DemoError(f"pre-training did not help: fine-tuned from the export, {TASK} is {100 * gain.margin:+.1f} "
                        f"points from the better of random init and the majority label, below +{100 * MIN_GAIN:.0f}")
    return scores


@dataclass
class DemoArgs:
    """``bert-ds-demo``'s options (:mod:`bert_ds.cli_args`)."""

    out: Path = Path("demo_run")
    """Output directory; one the demo did not create is refused."""
    quick: bool = defaults_of(run_demo)["quick"]
    """10 warm-up steps and 6 + 6 instead of the full recipes (seconds of training; for tests): reports the accuracy
    and the fine-tuning gain without requiring them."""


def cli_parser() -> argparse.ArgumentParser:
    return build_parser(DemoArgs, "bert-ds-demo", "The bert_ds demo: real English text -> tokenizer -> shards -> "
                        "both phases with ZeRO-2 and LAMB on 2 CPU ranks -> Hugging Face export -> held-out accuracy "
                        "vs the unigram baseline and fill-mask -> plot.")


main = alias("demo")


def _run(args: DemoArgs) -> None:
    """``bert-ds-demo`` / ``tools/demo.py`` (``make demo``). Exit status 0 when the export reaches ``MIN_RATIO`` times
    the unigram baseline on held-out text and fine-tuning it beats random init by ``MIN_GAIN`` (``--quick`` only
    reports both), 1 when a step fails or either falls short (a DemoError), 2 when OUT is not the demo's directory
    (NotDemoDirectory: nothing was touched, a usage error). A second run reuses OUT/data when the corpus and settings
    are unchanged. What :func:`run_demo` returns is its report, not an exit status."""
    start = time.monotonic()
    run_demo(args.out, quick=args.quick, min_ratio=None if args.quick else MIN_RATIO)
    print(f"demo finished in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
