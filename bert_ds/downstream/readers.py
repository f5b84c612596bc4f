"""Readers for fine-tuning data as users have it: GLUE task TSVs, SQuAD JSON, SWAG CSV, CoNLL-2003 column files, and
generic CSV / JSON-lines files. ``read_split(spec, path)`` returns normalised records per task shape:

* classification / regression: ``{"text", "text_pair", "label", "idx"}`` (label None in unlabelled test files);
* token: ``{"tokens", "tags", "idx"}``;
* multiple_choice: ``{"context", "endings", "label", "idx"}``;
* qa: ``{"id", "question", "context", "answers": {"text", "answer_start"}, "is_impossible", "title"}``.

Every malformed input raises ``DownstreamInputError`` (a ValueError) naming the file, the line and the column (a
field number and name, or a JSON path): wrong column count, missing header columns, a label outside the preset's set,
bytes that are not UTF-8, a cell over ``MAX_CELL_CHARS``, bad JSON, a tag outside the IOB scheme of the file's other
tags. A training SQuAD answer whose span ``answer_start .. answer_start + len(text)`` (what training labels) does not
hold its text is skipped and counted, as Google's ``run_squad.py`` skips the answers it cannot find; more than
``MAX_MISPLACED_ANSWER_SHARE`` of them refuse the file. Records carry the ``line`` they start on, for messages about
them further on. GLUE TSVs are split on tabs with no quoting (their sentences contain unbalanced quotes:
transformers' GLUE processors read them with ``quotechar=None``).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from collections.abc import Iterator
from pathlib import Path

from bert_ds.downstream.tasks import TaskSpec, TsvLayout, task_spec
from bert_ds.errors import BadInput

__all__ = ["MAX_CELL_CHARS", "MAX_MISPLACED_ANSWER_SHARE", "DownstreamInputError", "read_split", "read_records",
           "read_glue_tsv", "read_squad_json", "misplaced_answer", "read_swag_csv", "read_conll", "iter_lines"]

MAX_CELL_CHARS = 1_000_000
"""Longest accepted cell (characters). SQuAD's longest context is ~26k characters; a bigger cell is a broken file
(an unclosed quote swallowing the rest of a CSV, or the wrong file), refused before it reaches a tokenizer."""
_MAX_LINE_BYTES = 8 * MAX_CELL_CHARS

MAX_MISPLACED_ANSWER_SHARE = 0.01
"""Largest share of a SQuAD training file's answers whose ``answer_start`` may miss the answer text; those are
skipped (with a warning that counts them), as ``run_squad.py`` skips them ("Could not find answer"). Such answers
are rare slips in real files (SQuAD v1.1's train set has a handful in 87,599); more than 1% means the offsets are
wrong as a whole (another encoding, another version of the contexts) and the file is refused."""

log = logging.getLogger(__name__)


class DownstreamInputError(BadInput):
    """A fine-tuning input file that cannot be read; the message names the file, the line and the column."""

    def __init__(self, path: str | Path, line: int, column: int | str, message: str):
        self.path, self.line, self.column = str(path), line, column
        super().__init__(f"{path}: line {line}, column {column}: {message}")


def _col(index: int, names: tuple[str, ...] | list[str] | None = None) -> str:
    """1-based column number, with its header name when there is one."""
    if names is not None and index < len(names):
        return f"{index + 1} ({names[index]})"
    return str(index + 1)


def iter_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, text without its line ending) for each line of a UTF-8 file; a leading byte-order mark is
    dropped. Undecodable bytes and over-long lines raise DownstreamInputError at their line and column."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, "rb") as f:
        number = 0
        while True:
            raw = f.readline(_MAX_LINE_BYTES + 1)
            if not raw:
                return
            number += 1
            if len(raw) > _MAX_LINE_BYTES:
                raise DownstreamInputError(path, number, 1, f"line longer than {_MAX_LINE_BYTES} bytes")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                column = len(raw[:exc.start].decode("utf-8", errors="replace")) + 1
                raise DownstreamInputError(path, number, column,
                                           f"not UTF-8 (byte 0x{raw[exc.start]:02x}); save the file as UTF-8") from None
            if number == 1 and text.startswith("\ufeff"):
                text = text[1:]
            yield number, text.rstrip("\r\n") if text.endswith("\n") else text.rstrip("\r")


def _check_cells(path, number: int, cells: list[str], names=None) -> None:
    for i, cell in enumerate(cells):
        if len(cell) > MAX_CELL_CHARS:
            raise DownstreamInputError(path, number, _col(i, names),
                                       f"cell of {len(cell)} characters, over the {MAX_CELL_CHARS} limit")


# --------------------------------------------------------------------------------------------------- GLUE TSV
def _glue_label(spec: TaskSpec, value: str, path, number: int, column: str):
    if spec.shape == "regression":
        try:
            score = float(value)
        except ValueError:
            raise DownstreamInputError(path, number, column, f"score {value!r} is not a number") from None
        # STS-B similarity scores are in [0, 5] (Cer et al. 2017).
        if not math.isfinite(score) or not 0.0 <= score <= 5.0:
            raise DownstreamInputError(path, number, column, f"score {value!r} outside [0, 5]")
        return score
    if value not in spec.labels:
        raise DownstreamInputError(path, number, column, f"label {value!r} not in {spec.name}'s labels {spec.labels}")
    return value


def _choose_glue_layout(spec: TaskSpec, path, first: str) -> TsvLayout:
    """Labelled or test layout, from the first line (CoLA train/dev have no header: any other first line is data)."""
    fields = first.split("\t")
    train, test = spec.train_layout, spec.test_layout
    if train.header is None:
        return test if tuple(fields) == test.header else train
    if train.label in fields:
        layout = train
    elif test.text in fields:
        layout = test
    else:
        raise DownstreamInputError(path, 1, 1, f"header {fields} is not a {spec.name} header: expected "
                                   f"{list(train.header)} (train/dev) or {list(test.header)} (test)")
    for role in ("text", "text_pair", "label", "idx"):
        name = getattr(layout, role)
        if name is not None and name not in fields:
            raise DownstreamInputError(path, 1, len(fields) + 1, f"header lacks column {name!r}: expected "
                                       f"{list(layout.header)}, got {fields}")
    return layout


def read_glue_tsv(spec: TaskSpec, path: str | Path, labelled: bool | None = None,
                  drop_malformed_rows: bool | None = None) -> list[dict]:
    """A GLUE task file (train, dev or test) of ``spec``'s layout. ``labelled=True`` refuses a file without labels,
    ``False`` one with labels; None accepts both (test files give ``label: None``). ``drop_malformed_rows`` (default:
    the preset's) skips lines with the wrong column count, with one warning that counts them, instead of refusing."""
    drop = spec.drop_malformed_rows if drop_malformed_rows is None else drop_malformed_rows
    lines = iter_lines(path)
    first = next(lines, None)
    if first is None:
        raise DownstreamInputError(path, 1, 1, "empty file")
    layout = _choose_glue_layout(spec, path, first[1])
    has_label = layout.label is not None
    if labelled is not None and labelled != has_label:
        kind = "a labelled (train/dev)" if labelled else "an unlabelled (test)"
        raise DownstreamInputError(path, 1, 1, f"expected {kind} {spec.name} file, got the other layout")
    # Columns by name: the file's own header (MNLI dev has more annotator columns than train), or CoLA's positions.
    header_names = layout.names if layout.header is None else tuple(first[1].split("\t"))
    index = {name: i for i, name in enumerate(header_names)}
    width = len(header_names)
    body = lines if layout.header is not None else _chain(first, lines)
    records, dropped = [], []
    for number, text in body:
        cells = text.split("\t")
        if len(cells) != width:
            if drop:
                dropped.append(number)
                continue
            column = _col(min(len(cells), width), header_names)
            raise DownstreamInputError(path, number, column, f"{len(cells)} tab-separated columns, expected {width} "
                                       f"({list(header_names)})")
        _check_cells(path, number, cells, header_names)
        label = None
        if has_label:
            i = index[layout.label]
            label = _glue_label(spec, cells[i], path, number, _col(i, header_names))
        records.append({
            "text": cells[index[layout.text]],
            "text_pair": cells[index[layout.text_pair]] if layout.text_pair else None,
            "label": label,
            "idx": cells[index[layout.idx]] if layout.idx else number,
            "line": number,
        })
    if dropped:
        log.warning("%s: dropped %d lines with a column count other than %d (lines %s%s)", path, len(dropped), width,
                    ", ".join(map(str, dropped[:5])), ", ..." if len(dropped) > 5 else "")
    if not records:
        raise DownstreamInputError(path, 2, 1, "no examples after the header")
    return records


def _chain(first, rest):
    yield first
    yield from rest


# --------------------------------------------------------------------------------------------------- SQuAD JSON
class _Locator:
    """Line numbers of JSON string values, found by searching the text for them (json.loads keeps no positions).
    Values are looked up in file order, so each search starts where the previous one ended: linear in the file."""

    def __init__(self, text: str):
        self.text, self.pos, self.line, self.misses = text, 0, 1, 0

    def line_of(self, value: str) -> int:
        if self.misses > 3:  # values written with other escapes ("\/"): stop scanning the rest of the file each time
            return self.line
        for needle in (json.dumps(value, ensure_ascii=False), json.dumps(value)):
            at = self.text.find(needle, self.pos)
            if at >= 0:
                self.line += self.text.count("\n", self.pos, at)
                self.pos = at
                return self.line
        self.misses += 1
        return self.line


def _read_json_document(path: str | Path):
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = len(raw[raw.rfind(b"\n", 0, exc.start) + 1:exc.start].decode("utf-8", errors="replace")) + 1
        raise DownstreamInputError(path, line, column, f"not UTF-8 (byte 0x{raw[exc.start]:02x})") from None
    try:
        return json.loads(text), text
    except json.JSONDecodeError as exc:
        raise DownstreamInputError(path, exc.lineno, exc.colno, f"not valid JSON: {exc.msg}") from None


def misplaced_answer(context: str, start: int, text: str) -> str | None:
    """None when ``answer_start`` holds the answer as training labels it: the characters
    ``context[start:start + len(text)]`` (the span transformers' ``run_qa.py`` maps to token positions, as
    :func:`bert_ds.downstream.qa.train_features` does) equal the answer text, whitespace runs collapsed to one space
    and the ends stripped on both sides. Else what the span holds instead. Google's ``run_squad.py`` checks the
    whitespace words around the span instead, which passes a span that starts inside the answer's word and labels
    part of the next word."""
    wanted = " ".join(text.split())
    if not wanted:
        return None
    held = " ".join(context[start:start + len(text)].split())
    return None if held == wanted else held


def _drop_misplaced(path, records: list[dict], misplaced: list[tuple], answered: int) -> list[dict]:
    """Skip the training questions whose answer is not at its ``answer_start`` (as run_squad.py skips "Could not
    find answer"), or refuse the file when they are more than MAX_MISPLACED_ANSWER_SHARE of its answers."""
    if not misplaced:
        return records
    line, field, qid, start, held, text = misplaced[0]
    if len(misplaced) > MAX_MISPLACED_ANSWER_SHARE * answered:
        raise DownstreamInputError(path, line, field, f"question {qid!r}: answer_start {start} holds {held!r}, not "
                                   f"the answer {text!r} ({len(misplaced)} of {answered} training answers miss their "
                                   f"text, over the {MAX_MISPLACED_ANSWER_SHARE:.0%} run_squad.py-style skip limit)")
    log.warning("%s: skipped %d of %d training questions whose answer_start does not hold the answer text, as "
                "run_squad.py does (first: question %r at line %d, answer_start %d holds %r, not %r)", path,
                len(misplaced), answered, qid, line, start, held, text)
    bad = {m[2] for m in misplaced}
    return [r for r in records if r["id"] not in bad]


class _SquadFields:
    """Typed field access into a SQuAD document, every failure one DownstreamInputError naming the JSON path."""

    def __init__(self, path: str | Path) -> None:
        self.path = path

    def fail(self, line: int, field: str, message: str):
        raise DownstreamInputError(self.path, line, field, message)

    def need(self, obj, key: str, kind: type, field: str, line: int):
        value = obj.get(key) if isinstance(obj, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            self.fail(line, f"{field}.{key}", f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    def answers(self, qa: dict, context: str, q_field: str, line: int) -> tuple[list[str], list[int]]:
        """(texts, starts) of a question's answers; each span must lie inside the context."""
        texts, starts = [], []
        for k, answer in enumerate(self.need(qa, "answers", list, q_field, line)):
            k_field = f"{q_field}.answers[{k}]"
            answer_text = self.need(answer, "text", str, k_field, line)
            start = self.need(answer, "answer_start", int, k_field, line)
            if not 0 <= start <= len(context) - len(answer_text):
                self.fail(line, f"{k_field}.answer_start", f"answer_start {start} puts {answer_text!r} outside the "
                          f"context ({len(context)} characters)")
            texts.append(answer_text)
            starts.append(start)
        return texts, starts

    def impossible(self, qa: dict, texts: list[str], version: int | None, q_field: str, line: int) -> bool:
        """``is_impossible``, checked against the version's rule (v1.1: answered; v2.0: agrees with the answers)."""
        impossible = qa.get("is_impossible", False)
        if not isinstance(impossible, bool):
            self.fail(line, f"{q_field}.is_impossible", f"expected true/false, got {impossible!r}")
        if version == 1 and (impossible or not texts):
            self.fail(line, f"{q_field}.answers", "SQuAD v1.1 question without an answer")
        if version == 2 and impossible == bool(texts):
            self.fail(line, f"{q_field}.is_impossible", f"is_impossible={impossible} but {len(texts)} answers")
        return impossible or not texts


def read_squad_json(path: str | Path, version: int | None = None, training: bool = False) -> list[dict]:
    """Questions of a SQuAD v1.1 / v2.0 file (``{"data": [{"title", "paragraphs": [{"context", "qas": [...]}]}]}``).
    ``version=1`` requires at least one answer per question; ``version=2`` requires ``is_impossible`` to agree with
    the answers (none for an impossible question); None accepts both. ``training``: the first answer (the one
    training uses) must lie at its ``answer_start`` (:func:`misplaced_answer`), else the question is skipped
    (:data:`MAX_MISPLACED_ANSWER_SHARE`); evaluation scores answer texts only, so dev files are not checked."""
    doc, text = _read_json_document(path)
    where, f = _Locator(text), _SquadFields(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        f.fail(1, "data", "a SQuAD file is an object with a 'data' list")
    records, seen, misplaced = [], {}, []
    for a, article in enumerate(doc["data"]):
        a_field = f"data[{a}]"
        title = article.get("title", "") if isinstance(article, dict) else ""
        line = where.line_of(title) if title else 1
        for p, paragraph in enumerate(f.need(article, "paragraphs", list, a_field, line)):
            p_field = f"{a_field}.paragraphs[{p}]"
            context = f.need(paragraph, "context", str, p_field, line)
            if len(context) > MAX_CELL_CHARS:
                f.fail(line, f"{p_field}.context", f"{len(context)} characters, over the {MAX_CELL_CHARS} limit")
            for q, qa in enumerate(f.need(paragraph, "qas", list, p_field, line)):
                q_field = f"{p_field}.qas[{q}]"
                qid = f.need(qa, "id", str, q_field, line)
                line = where.line_of(qid)
                if qid in seen:
                    f.fail(line, f"{q_field}.id", f"duplicate question id {qid!r} (first at {seen[qid]})")
                seen[qid] = q_field
                question = f.need(qa, "question", str, q_field, line)
                texts, starts = f.answers(qa, context, q_field, line)
                impossible = f.impossible(qa, texts, version, q_field, line)
                held = misplaced_answer(context, starts[0], texts[0]) if training and texts else None
                if held is not None:
                    misplaced.append((line, f"{q_field}.answers[0].answer_start", qid, starts[0], held, texts[0]))
                records.append({"id": qid, "title": title, "question": question, "context": context,
                                "answers": {"text": texts, "answer_start": starts}, "is_impossible": impossible,
                                "line": line})
    if not records:
        f.fail(1, "data", "no questions")
    return _drop_misplaced(path, records, misplaced, sum(bool(r["answers"]["text"]) for r in records))


# --------------------------------------------------------------------------------------------------- SWAG CSV
_SWAG_ENDINGS = ("ending0", "ending1", "ending2", "ending3")


def _csv_rows(path) -> Iterator[tuple[int, list[str]]]:
    """(line number, cells) of a CSV file with standard quoting; a quoted cell may span lines (reported at the
    first)."""
    lines = iter_lines(path)
    state = {"line": 0}

    def text_lines():
        for number, text in lines:
            state["line"] = number
            yield text

    csv.field_size_limit(max(csv.field_size_limit(), MAX_CELL_CHARS + 1))
    reader = csv.reader(text_lines())
    start = 1
    try:
        for row in reader:
            yield start, row
            start = state["line"] + 1
    except csv.Error as exc:
        raise DownstreamInputError(path, start, 1, f"malformed CSV: {exc}") from None


def read_swag_csv(spec: TaskSpec, path: str | Path, labelled: bool | None = None) -> list[dict]:
    """SWAG's CSV (header ``,video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0..ending3,label``; test
    files lack ``label``). As the paper and transformers' ``run_swag`` do, the context is ``sent1`` and choice k is
    ``sent2 + " " + ending<k>``."""
    rows = _csv_rows(path)
    first = next(rows, None)
    if first is None:
        raise DownstreamInputError(path, 1, 1, "empty file")
    header = first[1]
    for name in ("sent1", "sent2") + _SWAG_ENDINGS:
        if name not in header:
            raise DownstreamInputError(path, 1, len(header) + 1, f"header lacks column {name!r} (header: {header})")
    has_label = "label" in header
    if labelled is not None and labelled != has_label:
        raise DownstreamInputError(path, 1, len(header) + 1, "expected a labelled file (train/val): no 'label' column"
                                   if labelled else "expected an unlabelled (test) file, got a 'label' column")
    at = {name: i for i, name in enumerate(header)}
    records = []
    for number, cells in rows:
        if len(cells) != len(header):
            raise DownstreamInputError(path, number, _col(min(len(cells), len(header)), header),
                                       f"{len(cells)} columns, expected {len(header)}")
        _check_cells(path, number, cells, header)
        label = None
        if has_label:
            value = cells[at["label"]]
            if value not in spec.labels:
                raise DownstreamInputError(path, number, _col(at["label"], header),
                                           f"label {value!r} not in {spec.labels}")
            label = int(value)
        sent2 = cells[at["sent2"]]
        records.append({"context": cells[at["sent1"]],
                        "endings": [f"{sent2} {cells[at[e]]}" for e in _SWAG_ENDINGS],
                        "label": label,
                        "idx": cells[at["fold-ind"]] if "fold-ind" in at else number, "line": number})
    if not records:
        raise DownstreamInputError(path, 2, 1, "no examples after the header")
    return records


# --------------------------------------------------------------------------------------------------- CoNLL-2003
def read_conll(spec: TaskSpec, path: str | Path) -> list[dict]:
    """Sentences of a CoNLL-2003 column file: ``token POS chunk NER`` per line, a blank line between sentences,
    ``-DOCSTART-`` lines between documents. Tags must be in ``spec.labels``."""
    records, tokens, tags, start = [], [], [], 0
    width = None
    for number, text in iter_lines(path):
        fields = text.split()
        if not fields:
            if tokens:
                records.append({"tokens": tokens, "tags": tags, "idx": start, "line": start})
            tokens, tags = [], []
            continue
        if fields[0] == "-DOCSTART-":
            continue
        if width is None:
            width = len(fields)
            if width != 4:
                raise DownstreamInputError(path, number, _col(min(width, 4)), f"{width} columns, expected 4: "
                                           "token POS chunk NER")
        if len(fields) != width:
            raise DownstreamInputError(path, number, _col(min(len(fields), width)),
                                       f"{len(fields)} columns, expected {width} like the lines above")
        _check_cells(path, number, fields)
        if fields[-1] not in spec.labels:
            raise DownstreamInputError(path, number, _col(width - 1), f"tag {fields[-1]!r} not in {spec.labels}")
        if not tokens:
            start = number
        tokens.append(fields[0])
        tags.append(fields[-1])
    if tokens:
        records.append({"tokens": tokens, "tags": tags, "idx": start, "line": start})
    if not records:
        raise DownstreamInputError(path, 1, 1, "no sentences")
    return records


# --------------------------------------------------------------------------------------------------- CSV / JSON lines
def read_records(path: str | Path) -> list[dict]:
    """Rows of a ``.csv`` file (header line, standard quoting) or a JSON-lines file (``.jsonl`` / ``.json``, one object
    a line), as dicts keyed by column name."""
    rows = _numbered_rows(path)
    for row in rows:
        del row["_line"]
    return rows


def _numbered_rows(path: str | Path) -> list[dict]:
    """``read_records`` with each row's line number under ``"_line"``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    suffix = path.suffix.lower()
    rows = []
    if suffix == ".csv":
        csv_rows = _csv_rows(path)
        first = next(csv_rows, None)
        if first is None:
            raise DownstreamInputError(path, 1, 1, "empty file: expected a header line")
        header = first[1]
        if len(set(header)) != len(header) or not all(header):
            raise DownstreamInputError(path, 1, 1, f"header needs distinct, non-empty column names: {header}")
        for number, cells in csv_rows:
            if not cells:
                continue
            if len(cells) != len(header):
                raise DownstreamInputError(path, number, _col(min(len(cells), len(header)), header),
                                           f"{len(cells)} columns, expected {len(header)} ({header})")
            _check_cells(path, number, cells, header)
            rows.append({**dict(zip(header, cells, strict=True)), "_line": number})
    elif suffix in (".jsonl", ".json"):
        for number, line in iter_lines(path):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DownstreamInputError(path, number, exc.colno, f"not a JSON object: {exc.msg}") from None
            if not isinstance(row, dict):
                raise DownstreamInputError(path, number, 1, f"expected a JSON object, got {type(row).__name__}")
            for key, value in row.items():
                if isinstance(value, str) and len(value) > MAX_CELL_CHARS:
                    raise DownstreamInputError(path, number, repr(key), f"value of {len(value)} characters, over "
                                               f"the {MAX_CELL_CHARS} limit")
            rows.append({**row, "_line": number})
    else:
        raise DownstreamInputError(path, 1, 1, f"unknown format {suffix!r}; use .csv, .jsonl or .json (JSON lines)")
    if not rows:
        raise DownstreamInputError(path, 2, 1, "no examples")
    return rows


def _field(row: dict, name: str, path, required: bool = True):
    value = row.get(name)
    if value is None or value == "":
        if required:
            present = sorted(k for k in row if k != "_line")
            raise DownstreamInputError(path, row["_line"], repr(name), f"no value (columns: {present})")
        return None
    return value


def _words(value) -> list[str]:
    """A JSON list of words, a JSON list written into a CSV cell, or a whitespace-separated string."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if isinstance(value, list):
        return [str(v) for v in value]
    return str(value).split()


def _records_for(spec: TaskSpec, path, columns: dict[str, str]) -> list[dict]:
    rows = _numbered_rows(path)
    out = []
    for row in rows:
        line = row["_line"]
        if spec.shape in ("classification", "regression"):
            label = _field(row, columns["label"], path, required=False)
            if label is not None and spec.shape == "regression":
                try:
                    label = float(label)
                except (TypeError, ValueError):
                    raise DownstreamInputError(path, line, repr(columns["label"]),
                                               f"regression target {label!r} is not a number") from None
                if not math.isfinite(label):
                    raise DownstreamInputError(path, line, repr(columns["label"]), f"target {label!r} not finite")
            elif label is not None:
                label = str(label)
                if spec.labels is not None and label not in spec.labels:
                    raise DownstreamInputError(path, line, repr(columns["label"]),
                                               f"label {label!r} not in {spec.labels}")
            pair = columns.get("text_pair")
            out.append({"text": str(_field(row, columns["text"], path)),
                        "text_pair": str(_field(row, pair, path)) if pair else None,
                        "label": label, "idx": row.get("idx", line), "line": line})
        elif spec.shape == "token":
            tokens = _words(_field(row, columns["tokens"], path))
            tags = _words(_field(row, columns["tags"], path))
            if len(tokens) != len(tags):
                raise DownstreamInputError(path, line, repr(columns["tags"]),
                                           f"{len(tokens)} words in {columns['tokens']!r} but {len(tags)} tags")
            out.append({"tokens": tokens, "tags": tags, "idx": row.get("idx", line), "line": line})
        elif spec.shape == "multiple_choice":
            if columns["endings"] in row:
                endings = _words(row[columns["endings"]]) if not isinstance(row[columns["endings"]], list) else \
                    [str(e) for e in row[columns["endings"]]]
            else:  # CSV: ending0, ending1, ... columns
                endings = [str(row[k]) for k in sorted((k for k in row if k.startswith("ending")
                                                        and k[6:].isdigit()), key=lambda k: int(k[6:]))]
            if len(endings) < 2:
                raise DownstreamInputError(path, line, repr(columns["endings"]), "need at least two endings")
            label = _field(row, columns["label"], path, required=False)
            if label is not None:
                try:
                    label = int(label)
                except (TypeError, ValueError):
                    label = -1
                if not 0 <= label < len(endings):
                    raise DownstreamInputError(path, line, repr(columns["label"]),
                                               f"label {row[columns['label']]!r} is not an ending index "
                                               f"0..{len(endings) - 1}")
            out.append({"context": str(_field(row, columns["context"], path)), "endings": endings, "label": label,
                        "idx": row.get("idx", line), "line": line})
        else:
            raise BadInput(f"task {spec.name!r}: shape {spec.shape!r} is not read from CSV/JSON lines")
    if spec.shape == "token":
        _check_iob_scheme(path, out, columns["tags"])
    return out


_IOB_PREFIXED = re.compile(r"[BIES]-\S")
_IOB_TAG = re.compile(r"O|[BIES]-\S.*")


def _check_iob_scheme(path, records: list[dict], column: str) -> None:
    """A file whose tags use the IOB scheme (some tag is ``B-TYPE`` / ``I-TYPE``, or IOBES's ``E-`` / ``S-``) must
    use it for every tag: seqeval reads any other tag's first letter as the prefix ("MISC" is an entity of type
    "ISC"), a silently wrong entity F1. I- may start an entity (IOB1, CoNLL-2003's original files), so only tags
    outside the scheme are refused. A file of plain tags (no prefixed tag: POS-like tags) is left as it is."""
    tags = [(r["line"], t) for r in records for t in r["tags"]]
    example = next(((line, t) for line, t in tags if _IOB_PREFIXED.match(t)), None)
    if example is None:
        return
    for line, tag in tags:
        if not _IOB_TAG.fullmatch(tag):
            raise DownstreamInputError(path, line, repr(column), f"tag {tag!r} is outside the IOB scheme of the "
                                       f"file's other tags (O, B-TYPE, I-TYPE, E-TYPE, S-TYPE; {example[1]!r} on "
                                       f"line {example[0]})")


# --------------------------------------------------------------------------------------------------- entry point
def read_split(spec: TaskSpec | str, path: str | Path, *, labelled: bool | None = None,
               columns: dict[str, str] | None = None, drop_malformed_rows: bool | None = None,
               training: bool = False) -> list[dict]:
    """Normalised records of one split file of task ``spec`` (a TaskSpec or a preset name). ``labelled`` (GLUE,
    SWAG) insists on a labelled or an unlabelled file; ``columns`` overrides a generic task's column names;
    ``drop_malformed_rows`` (GLUE) overrides the preset's choice (see ``TaskSpec.drop_malformed_rows``);
    ``training`` (SQuAD) checks each answer against its ``answer_start`` (:func:`read_squad_json`)."""
    if isinstance(spec, str):
        spec = task_spec(spec)
    if spec.format == "glue_tsv":
        return read_glue_tsv(spec, path, labelled, drop_malformed_rows)
    if spec.format == "squad_json":
        version = {"squad_v1": 1, "squad_v2": 2}.get(spec.name)
        return read_squad_json(path, version, training)
    if spec.format == "swag_csv":
        return read_swag_csv(spec, path, labelled)
    if spec.format == "conll":
        return read_conll(spec, path)
    return _records_for(spec, path, {**spec.columns, **(columns or {})})
