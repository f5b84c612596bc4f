"""Token classification (CoNLL-2003 column layout): the first WordPiece of each word carries its tag, the others
are -100; entity-level F1 (seqeval) beats the all-``O`` baseline (entity F1 0)."""

from __future__ import annotations

import json

import pytest
import transformers

from bert_ds.config import IGNORE_INDEX
from bert_ds.downstream.finetune import METRICS_NAME, FinetuneArgs, _encode_tokens, main
from tests.helpers.downstream_data import write_conll


def test_first_subword_carries_the_tag(hub_bert, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(hub_bert)
    words = ["copyrighted", "Foundation", "2004", "x"]
    records = [{"tokens": words, "tags": ["O", "I-ORG", "B-MISC", "O"]}]
    args = FinetuneArgs(model=str(hub_bert), out=str(tmp_path / "o"), task="conll2003", train_file="unused")
    label2id = {t: i for i, t in enumerate(args.spec.labels)}
    (example,), _ = _encode_tokens(records, tokenizer, args, label2id, "test")
    enc = tokenizer(words, is_split_into_words=True)
    firsts = [i for i, w in enumerate(enc.word_ids()) if w is not None and (i == 0 or enc.word_ids()[i - 1] != w)]
    assert len(enc["input_ids"]) > len(words) + 2  # some word is split into several pieces
    assert [example["labels"][i] for i in firsts] == [label2id[t] for t in records[0]["tags"]]
    assert all(label == IGNORE_INDEX for i, label in enumerate(example["labels"]) if i not in firsts)


@pytest.mark.slow  # minutes of CPU fine-tuning
def test_conll_layout_entity_f1(hub_bert, corpus_documents, tmp_path):
    data = write_conll(corpus_documents, tmp_path / "conll", n_train=96, n_dev=64)
    out = tmp_path / "ner"
    assert main(["--model", str(hub_bert), "--task", "conll2003", "--data-dir", str(data), "--out", str(out),
                 "--epochs", "4", "--learning-rate", "2e-4", "--device", "cpu", "--max-seq-length", "64",
                 "--batch-size", "16", "--logging-steps", "5"]) == 0
    metrics = json.loads((out / METRICS_NAME).read_text())
    dev, base = metrics["eval"]["dev"], metrics["baseline"]["dev"]
    print(f"CoNLL layout (numbers B-MISC, '* Software Foundation' ORG): entity F1 {dev['entity_f1']:.3f} vs "
          f"all-O {base['entity_f1']:.3f}; token accuracy {dev['accuracy']:.3f} vs {base['accuracy']:.3f}")
    assert base["entity_f1"] == 0.0
    assert dev["entity_f1"] >= 0.5, dev
