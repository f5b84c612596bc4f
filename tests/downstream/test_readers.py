"""Readers on files written in the official layouts from real English text, and one clear error naming file, line and
column for each kind of malformed input."""

from __future__ import annotations

import json
import re

import pytest

from bert_ds.downstream.readers import MAX_CELL_CHARS, DownstreamInputError, read_records, read_split
from bert_ds.downstream.tasks import GLUE_TASKS, TASKS
from tests.downstream.layouts import real_sentences, write_conll, write_glue_dir, write_squad, write_swag


def _fields(records: list[dict]) -> list[dict]:
    """Records without the line they start on (``test_records_carry_their_line`` checks it)."""
    return [{k: v for k, v in r.items() if k != "line"} for r in records]


@pytest.fixture(scope="module")
def sentences(english_corpus):
    out = real_sentences(english_corpus, 2000)
    assert any('"' in s for s in out), "the corpus should contain quotes: GLUE TSVs do"
    return out


@pytest.fixture(scope="module")
def glue(tmp_path_factory, sentences):
    root = tmp_path_factory.mktemp("glue")
    return root, write_glue_dir(root, sentences, n=12)


@pytest.mark.parametrize("task", sorted(GLUE_TASKS))
def test_every_glue_split_reads_back_what_was_written(glue, task):
    root, expected = glue
    spec = GLUE_TASKS[task]
    for split, records in expected[task].items():
        path = root / spec.glue_dir / spec.splits[split]
        got = _fields(read_split(task, path))
        assert got == records, f"{task} {split}"
        assert all(r["label"] is None for r in got) == split.startswith("test")


def test_glue_sentences_keep_their_quotes(tmp_path):
    # A lone double quote must not start a quoted field: GLUE files are read with no quoting.
    path = tmp_path / "train.tsv"
    path.write_text('sentence\tlabel\n' + '"a lone quote\t1\n' + 'he said "no" twice\t0\n', encoding="utf-8")
    assert [r["text"] for r in read_split("sst2", path)] == ['"a lone quote', 'he said "no" twice']


def test_mnli_dev_matched_and_mismatched_splits(glue):
    root, expected = glue
    spec = GLUE_TASKS["mnli"]
    assert spec.eval_splits == ("dev_matched", "dev_mismatched")
    for split in ("dev_matched", "dev_mismatched", "test_matched", "test_mismatched"):
        assert (root / "MNLI" / f"{split}.tsv").is_file()
    dev = read_split("mnli", root / "MNLI" / "dev_matched.tsv")
    assert {r["label"] for r in dev} <= {"contradiction", "entailment", "neutral"}
    assert len((root / "MNLI" / "dev_matched.tsv").read_text().splitlines()[1].split("\t")) == 16
    assert len((root / "MNLI" / "train.tsv").read_text().splitlines()[1].split("\t")) == 12
    assert len((root / "MNLI" / "test_matched.tsv").read_text().splitlines()[1].split("\t")) == 10


def test_labelled_flag_refuses_the_other_layout(glue):
    root, _ = glue
    with pytest.raises(DownstreamInputError, match=r"test\.tsv: line 1, column 1: expected a labelled"):
        read_split("rte", root / "RTE" / "test.tsv", labelled=True)
    with pytest.raises(DownstreamInputError, match=r"dev\.tsv: line 1, column 1: expected an unlabelled"):
        read_split("cola", root / "CoLA" / "dev.tsv", labelled=False)
    assert read_split("cola", root / "CoLA" / "test.tsv", labelled=False)[0]["label"] is None


def test_stsb_is_read_as_regression_scores(glue):
    root, _ = glue
    records = read_split("stsb", root / "STS-B" / "train.tsv")
    assert all(isinstance(r["label"], float) and 0 <= r["label"] <= 5 for r in records)
    assert len({r["label"] for r in records}) > 5


def test_squad_v1_and_v2_read_back(tmp_path, sentences):
    for version in (1, 2):
        path = tmp_path / f"squad{version}.json"
        expected = write_squad(path, sentences, 30, version)
        got = _fields(read_split(f"squad_v{version}", path))
        assert got == expected
        for r in got:
            for text, start in zip(r["answers"]["text"], r["answers"]["answer_start"], strict=True):
                assert r["context"][start:start + len(text)] == text
    assert sum(r["is_impossible"] for r in got) == 10


def test_swag_reads_context_and_four_endings(tmp_path, sentences):
    for labelled in (True, False):
        path = tmp_path / ("train.csv" if labelled else "test.csv")
        expected = write_swag(path, sentences, 20, labelled=labelled)
        assert _fields(read_split("swag", path, labelled=labelled)) == expected


def test_conll_sentences_and_tags(tmp_path, sentences):
    path = tmp_path / "eng.train"
    expected = write_conll(path, sentences, 25)
    assert _fields(read_split("conll2003", path)) == expected
    assert "-DOCSTART-" not in {t for r in expected for t in r["tokens"]}


def test_generic_csv_and_jsonl(tmp_path, sentences):
    csv_path = tmp_path / "pair.csv"
    csv_path.write_text('text,text_pair,label\n"a, b",second,yes\n"with ""quotes""",x,no\n', encoding="utf-8")
    assert _fields(read_split("pair", csv_path)) == [
        {"text": "a, b", "text_pair": "second", "label": "yes", "idx": 2},
        {"text": 'with "quotes"', "text_pair": "x", "label": "no", "idx": 3}]
    assert read_records(csv_path)[0] == {"text": "a, b", "text_pair": "second", "label": "yes"}
    jsonl = tmp_path / "reg.jsonl"
    jsonl.write_text("\n".join(json.dumps({"sentence": s, "score": i / 4}) for i, s in enumerate(sentences[:8])),
                     encoding="utf-8")
    got = read_split("regression", jsonl, columns={"text": "sentence", "text_pair": None, "label": "score"})
    assert [r["label"] for r in got] == [i / 4 for i in range(8)] and got[0]["text"] == sentences[0]
    tokens = tmp_path / "tok.jsonl"
    tokens.write_text(json.dumps({"tokens": ["New", "York"], "tags": ["B-LOC", "I-LOC"]}) + "\n", encoding="utf-8")
    assert read_split("token", tokens)[0]["tags"] == ["B-LOC", "I-LOC"]
    mc = tmp_path / "mc.csv"
    mc.write_text("context,ending0,ending1,ending2,label\nctx,a,b,c,2\n", encoding="utf-8")
    assert _fields(read_split("multiple_choice", mc)) == [{"context": "ctx", "endings": ["a", "b", "c"], "label": 2,
                                                           "idx": 2}]


# ------------------------------------------------------------------------------------------------ malformed inputs
def _error(task, path, **kw) -> DownstreamInputError:
    with pytest.raises(DownstreamInputError) as info:
        read_split(task, path, **kw)
    err = info.value
    assert str(err).startswith(f"{path}: line {err.line}, column {err.column}: "), str(err)
    assert "\n" not in str(err)
    return err


def _write(path, text: str | bytes):
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_wrong_column_count_names_line_and_column(tmp_path):
    path = _write(tmp_path / "dev.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta only\n")
    err = _error("rte", path)
    assert (err.line, err.column) == (3, "3 (sentence2)") and "2 tab-separated columns, expected 4" in str(err)
    path = _write(tmp_path / "extra.tsv", "gj04\t1\t\tfine\ngj04\t0\t*\tbad\textra\n")
    err = _error("cola", path)
    assert (err.line, err.column) == (2, "5") and "expected 4" in str(err)


def test_missing_header_names_the_column(tmp_path):
    path = _write(tmp_path / "train.tsv", "index\tquestion\tsentence1\tlabel\n0\tq\ts\tentailment\n")
    err = _error("qnli", path)
    assert err.line == 1 and "header lacks column 'sentence'" in str(err)
    # An RTE file given as QNLI: not a QNLI header at all.
    path = _write(tmp_path / "rte.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n")
    assert "header lacks column 'question'" in str(_error("qnli", path))
    path = _write(tmp_path / "sst.tsv", "text\tlabel\nfine\t1\n")
    assert "lacks column 'sentence'" in str(_error("sst2", path))


def test_label_outside_the_preset_set(tmp_path):
    path = _write(tmp_path / "dev.tsv", "sentence\tlabel\nok\t1\nbad\t2\n")
    err = _error("sst2", path)
    assert (err.line, err.column) == (3, "2 (label)") and "label '2' not in sst2's labels" in str(err)
    # CoLA with a header line: the header is data, its "label" cell is no label.
    path = _write(tmp_path / "cola.tsv", "source\tlabel\toriginal\tsentence\ngj04\t1\t\tok\n")
    assert (_error("cola", path).line, _error("cola", path).column) == (1, "2 (label)")
    path = _write(tmp_path / "sts.tsv", "\t".join(GLUE_TASKS["stsb"].train_layout.header) + "\n" +
                  "\t".join(["0", "g", "f", "y", "1", "s", "s", "a", "b", "5.5"]) + "\n")
    err = _error("stsb", path)
    assert (err.line, err.column) == (2, "10 (score)") and "outside [0, 5]" in str(err)
    path = _write(tmp_path / "mnli.tsv", "\t".join(GLUE_TASKS["mnli"].train_layout.header) + "\n" +
                  "\t".join(["0"] * 11 + ["-"]) + "\n")
    assert _error("mnli", path).column == "12 (gold_label)"


def test_non_utf8_bytes_name_line_and_column(tmp_path):
    path = _write(tmp_path / "train.tsv", b"sentence\tlabel\nfine\t1\ncaf\xe9 au lait\t0\n")
    err = _error("sst2", path)
    assert (err.line, err.column) == (3, 4) and "not UTF-8 (byte 0xe9)" in str(err)
    path = _write(tmp_path / "sq.json", b'{"data": [\n {"title": "caf\xe9"}]}')
    err = _error("squad_v1", path)
    assert (err.line, err.column) == (2, 16)
    path = _write(tmp_path / "x.jsonl", b'{"text": "a", "label": "1"}\n{"text": "\xff"}\n')
    assert _error("sequence", path).line == 2
    path = _write(tmp_path / "eng.train", b"EU NNP B-NP B-ORG\nrejects VBZ B-VP O\nG\xc3rman JJ B-NP B-MISC\n")
    assert (_error("conll2003", path).line, _error("conll2003", path).column) == (3, 2)


def test_oversized_cell(tmp_path):
    big = "x" * (MAX_CELL_CHARS + 1)
    path = _write(tmp_path / "train.tsv", f"index\tsentence1\tsentence2\tlabel\n0\tok\t{big}\t1\n")
    err = _error("wnli", path)
    assert (err.line, err.column) == (2, "3 (sentence2)") and "over the 1000000 limit" in str(err)
    path = _write(tmp_path / "big.csv", f"text,label\n{big},a\n")
    assert (_error("sequence", path).line, _error("sequence", path).column) == (2, "1 (text)")
    path = _write(tmp_path / "big.jsonl", json.dumps({"text": big, "label": "a"}) + "\n")
    assert _error("sequence", path).column == "'text'"


def test_bad_json(tmp_path):
    path = _write(tmp_path / "dev.json", '{"version": "1.1",\n "data": [\n  {"title": "t", "paragraphs": [}\n ]}')
    err = _error("squad_v1", path)
    assert (err.line, err.column) == (3, 33) and "not valid JSON" in str(err)
    path = _write(tmp_path / "rows.jsonl", '{"text": "a", "label": "x"}\n{"text": "b", "label": }\n')
    err = _error("sequence", path)
    assert (err.line, err.column) == (2, 24) and "not a JSON object" in str(err)
    path = _write(tmp_path / "list.jsonl", '["a", "b"]\n')
    assert "expected a JSON object, got list" in str(_error("sequence", path))


def test_squad_structure_errors_name_the_json_path(tmp_path, sentences):
    path = tmp_path / "dev.json"
    write_squad(path, sentences, 6, version=2)
    doc = json.loads(path.read_text())
    doc["data"][0]["paragraphs"][4]["qas"][0]["answers"] = [{"text": "zzz", "answer_start": 10**6}]
    _write(path, json.dumps(doc, indent=1))
    err = _error("squad_v2", path)
    assert err.column == "data[0].paragraphs[4].qas[0].answers[0].answer_start" and "outside the context" in str(err)
    lines = path.read_text().splitlines()
    assert '"q0004"' in lines[err.line - 1], "the line is the question's id"
    doc["data"][0]["paragraphs"][4]["qas"][0]["answers"] = []  # v2: not impossible yet no answer
    _write(path, json.dumps(doc, indent=1))
    assert "is_impossible=False but 0 answers" in str(_error("squad_v2", path))
    v1 = tmp_path / "v1.json"
    write_squad(v1, sentences, 3, version=1)
    doc = json.loads(v1.read_text())
    doc["data"][0]["paragraphs"][1]["qas"][0]["answers"] = []
    _write(v1, json.dumps(doc))
    assert "SQuAD v1.1 question without an answer" in str(_error("squad_v1", v1))
    del doc["data"][0]["paragraphs"][2]["qas"][0]["question"]
    doc["data"][0]["paragraphs"][1]["qas"][0]["answers"] = [{"text": "a", "answer_start": "3"}]
    _write(v1, json.dumps(doc))
    err = _error("squad_v1", v1)
    assert err.column == "data[0].paragraphs[1].qas[0].answers[0].answer_start" and "expected int, got str" in str(err)
    _write(v1, json.dumps({"version": "1.1", "paragraphs": []}))
    assert _error("squad_v1", v1).column == "data"


def test_swag_errors(tmp_path, sentences):
    path = tmp_path / "val.csv"
    write_swag(path, sentences, 5)
    lines = path.read_text().splitlines()
    lines[3] = lines[3][: lines[3].rfind(",")] + ",4"
    _write(path, "\n".join(lines) + "\n")
    err = _error("swag", path)
    assert (err.line, err.column) == (4, "12 (label)") and "label '4' not in" in str(err)
    _write(path, lines[0].replace("ending2", "ending_2") + "\n")
    err = _error("swag", path)
    assert err.line == 1 and "lacks column 'ending2'" in str(err)
    _write(path, lines[0] + "\n" + '0,v,1,"unclosed quote,a,b\n')
    assert "columns, expected 12" in str(_error("swag", path)) or "malformed CSV" in str(_error("swag", path))


def test_conll_errors(tmp_path):
    path = _write(tmp_path / "eng.testa", "-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP\n")
    err = _error("conll2003", path)
    assert (err.line, err.column) == (4, "4") and "3 columns, expected 4" in str(err)
    path = _write(tmp_path / "eng.testb", "EU NNP B-NP B-ORG\nrejects VBZ B-VP B-VERB\n")
    err = _error("conll2003", path)
    assert (err.line, err.column) == (2, "4") and "tag 'B-VERB' not in" in str(err)
    path = _write(tmp_path / "two.txt", "EU B-ORG\n")
    assert "2 columns, expected 4" in str(_error("conll2003", path))


def test_generic_record_errors(tmp_path):
    path = _write(tmp_path / "r.csv", "text,label\na,1\nb\n")
    err = _error("sequence", path)
    assert (err.line, err.column) == (3, "2 (label)")
    path = _write(tmp_path / "missing.csv", "sentence,label\na,1\n")
    err = _error("sequence", path)
    assert (err.line, err.column) == (2, "'text'") and "no value" in str(err)
    path = _write(tmp_path / "tok.jsonl", json.dumps({"tokens": "a b c", "tags": "O O"}) + "\n")
    assert "3 words in 'tokens' but 2 tags" in str(_error("token", path))
    path = _write(tmp_path / "reg.csv", "text,text_pair,label\na,b,high\n")
    assert "regression target 'high' is not a number" in str(_error("regression", path))
    path = _write(tmp_path / "mc.jsonl", json.dumps({"context": "c", "endings": ["a", "b"], "label": 2}) + "\n")
    assert "not an ending index 0..1" in str(_error("multiple_choice", path))
    path = _write(tmp_path / "data.tsv", "text\tlabel\n")
    assert "unknown format '.tsv'" in str(_error("sequence", path))
    path = _write(tmp_path / "empty.csv", "")
    assert _error("sequence", path).line == 1


def test_empty_and_header_only_files(tmp_path):
    for task in ("sst2", "cola", "swag", "conll2003"):
        path = _write(tmp_path / f"{task}.txt", "")
        assert _error(task, path).line == 1
    path = _write(tmp_path / "h.tsv", "sentence\tlabel\n")
    assert "no examples after the header" in str(_error("sst2", path))


def test_cli_style_one_line_errors_for_every_preset(tmp_path):
    # Every preset turns a non-UTF-8 file into one DownstreamInputError line naming file, line and column.
    for name in TASKS:
        path = _write(tmp_path / f"{name}.csv", b"\xff\xfe garbage\n")
        err = _error(name, path)
        assert re.fullmatch(rf"{re.escape(str(path))}: line 1, column 1: not UTF-8.*", str(err)), str(err)


def test_qqp_drops_lines_with_the_wrong_column_count_and_says_so(tmp_path, caplog):
    header = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
    path = _write(tmp_path / "train.tsv", header + "0\t1\t2\tHow?\tWhy?\t0\n1\t3\t4\tcut short\n2\t5\t6\tA?\tB?\t1\n")
    with caplog.at_level("WARNING", logger="bert_ds.downstream.readers"):
        records = read_split("qqp", path)
    assert [r["idx"] for r in records] == ["0", "2"]
    assert "dropped 1 lines with a column count other than 6 (lines 3)" in caplog.text
    err = _error("qqp", path, drop_malformed_rows=False)
    assert (err.line, err.column) == (3, "5 (question2)")
    # Dropping never hides a bad label or undecodable bytes.
    _write(path, header + "0\t1\t2\tHow?\tWhy?\t7\n")
    assert "label '7' not in" in str(_error("qqp", path))


def test_records_carry_their_line(tmp_path, sentences):
    csv_path = tmp_path / "pair.csv"
    csv_path.write_text('text,label\n"two\nlines",a\nthird,b\n', encoding="utf-8")
    assert [r["line"] for r in read_split("sequence", csv_path)] == [2, 4]  # a quoted cell spans lines 2-3
    conll = tmp_path / "eng.train"
    write_conll(conll, sentences, 3)
    lines = conll.read_text(encoding="utf-8").splitlines()
    for record in read_split("conll2003", conll):
        assert lines[record["line"] - 1].split()[0] == record["tokens"][0]


# ------------------------------------------------------------------------------------------------ self-consistency
def _squad_file(path, answers: list[tuple[str, str, int]]) -> None:
    """One paragraph per (context, answer, answer_start)."""
    data = [{"title": f"t{i}", "paragraphs": [{"context": c, "qas": [
        {"id": f"q{i}", "question": "what ?", "answers": [{"text": a, "answer_start": s}]}]}]}
        for i, (c, a, s) in enumerate(answers)]
    path.write_text(json.dumps({"version": "1.1", "data": data}, indent=1), encoding="utf-8")


def test_misplaced_answer_is_the_labelled_span():
    from bert_ds.downstream.readers import misplaced_answer

    context = "The tower is 324 metres tall.  It opened\tin 1889."
    assert misplaced_answer(context, context.index("324"), "324") is None
    assert misplaced_answer(context, context.index("1889"), "1889.") is None
    assert misplaced_answer(context, context.index("opened"), "opened in") is None  # whitespace normalised
    assert misplaced_answer(context, context.index("tall.") + 6, " It") is None  # ends stripped on both sides
    assert misplaced_answer(context, 0, "324") == "The"
    # Inside the answer's word: run_squad.py's whitespace words ("324 metres") contain "324"; the span is "24 ".
    assert misplaced_answer(context, context.index("324") + 1, "324") == "24"
    assert misplaced_answer(context, context.index("324") + 3, "324") == "me"
    assert misplaced_answer(context, context.index("tall.") + 5, "It") == ""  # two spaces
    assert misplaced_answer(context, context.index("tall.") + 6, "It") == "I"


def test_squad_training_answers_off_their_start_are_skipped_or_refused(tmp_path, caplog):
    context = "Paris is the capital of France and has 2,100,000 inhabitants."
    good = (context, "France", context.index("France"))
    bad = (context, "France", 0)
    path = tmp_path / "train-v1.1.json"
    _squad_file(path, [good] * 199 + [bad])  # 1 of 200: 0.5%, under the 1% limit
    with caplog.at_level("WARNING"):
        records = read_split("squad_v1", path, training=True)
    assert len(records) == 199 and "q199" not in {r["id"] for r in records}
    assert "skipped 1 of 200 training questions" in caplog.text and "'q199'" in caplog.text
    assert len(read_split("squad_v1", path)) == 200  # evaluation files are scored on texts only: not checked
    _squad_file(path, [good] * 197 + [bad] * 3)  # 1.5%
    err = _error("squad_v1", path, training=True)
    assert err.column == "data[197].paragraphs[0].qas[0].answers[0].answer_start"
    assert f"{path}: line {err.line}, column {err.column}: question 'q197': answer_start 0 holds 'Paris', not the " \
           "answer 'France' (3 of 200 training answers miss their text, over the 1% " in str(err)
    assert '"q197"' in path.read_text().splitlines()[err.line - 1]


def test_token_tags_outside_the_files_iob_scheme(tmp_path):
    path = tmp_path / "tok.jsonl"
    rows = [{"tokens": ["New", "York"], "tags": ["B-LOC", "I-LOC"]}, {"tokens": ["in", "it"], "tags": ["O", "LOC"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    err = _error("token", path)
    assert str(err) == (f"{path}: line 2, column 'tags': tag 'LOC' is outside the IOB scheme of the file's other "
                        "tags (O, B-TYPE, I-TYPE, E-TYPE, S-TYPE; 'B-LOC' on line 1)")
    # IOB1 (CoNLL-2003's original files: I- may start an entity) and IOBES are inside the scheme; so are files of
    # plain tags without any prefix (part-of-speech tags), which are not entity tags at all.
    for tags in (["I-LOC", "I-LOC"], ["S-LOC", "O"], ["NN", "VB"]):
        path.write_text(json.dumps({"tokens": ["a", "b"], "tags": tags}) + "\n", encoding="utf-8")
        assert read_split("token", path)[0]["tags"] == tags
