"""The corpora users actually have: WikiExtractor output (both forms, made by running WikiExtractor on a MediaWiki dump
this test writes) and Hugging Face style Parquet, read for shard creation and tokenizer training, with the same limits,
bounded memory and one clear error per malformed file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

from bert_ds.data import text
from bert_ds.data.create import create_shards
from bert_ds.data.create import main as create_main
from bert_ds.data.index import ShardIndex
from bert_ds.data.text import (
    SkipCounts,
    TextLimits,
    detect_format,
    input_bytes,
    input_files,
    iter_documents,
    iter_training_texts,
    split_sentences,
)
from bert_ds.data.tokenizer import load_tokenizer, train_tokenizer
from tests.helpers import HANG_GUARD_S

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ARTICLES = 24
# MediaWiki markup the extractor must turn into plain text: a template it expands, one it drops, links, bold, a heading.
TEMPLATE = "{{Lang|fr|Bonjour tout le monde}}"


def _english_documents(corpus: Path, n: int, *, wiki_safe: bool = False) -> list[list[str]]:
    """The first ``n`` documents (lists of sentences) of the BERT-layout corpus; ``wiki_safe``: only those free of
    what MediaWiki reads as markup (a docstring's ``Callable[[int, str], float]`` is a link that swallows text)."""
    docs = [d.splitlines() for d in corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    if wiki_safe:
        docs = [d for d in docs if not re.search(r"[\[\]{}|]|''|__|~~~", " ".join(d))]
    return docs[:n]


def _wikitext(i: int, sentences: list[str]) -> str:
    half = len(sentences) // 2
    first, *rest = sentences[0].split(" ", 1)
    lead = f"'''{first}''' {rest[0] if rest else ''}".strip()
    body = " ".join([lead, *sentences[1:half]])
    links = f"See [[Free software|free software]] and [[copyleft]]; AT&T said {TEMPLATE}."
    return ("{{Infobox document|name=Doc " + str(i) + "}}\n" + body + "\n\n" + links + "\n\n== History ==\n"
            + " ".join(sentences[half:]) + "\n")


def _page(title: str, ns: int, page_id: int, wikitext: str) -> str:
    return (f"  <page>\n    <title>{escape(title)}</title>\n    <ns>{ns}</ns>\n    <id>{page_id}</id>\n"
            f"    <revision>\n      <id>{1000 + page_id}</id>\n"
            f"      <text xml:space=\"preserve\">{escape(wikitext)}</text>\n    </revision>\n  </page>\n")


def write_dump(path: Path, docs: list[list[str]]) -> Path:
    """A MediaWiki XML export (the layout of ``enwiki-*-pages-articles.xml``) of one article per document, plus the
    template one of them uses."""
    head = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10" xml:lang="en">\n'
            "  <siteinfo>\n    <sitename>Wikipedia</sitename>\n    <dbname>enwiki</dbname>\n"
            "    <base>https://en.wikipedia.org/wiki/Main_Page</base>\n    <generator>MediaWiki 1.41</generator>\n"
            "    <case>first-letter</case>\n    <namespaces>\n      <namespace key=\"0\" case=\"first-letter\" />\n"
            "      <namespace key=\"10\" case=\"first-letter\">Template</namespace>\n    </namespaces>\n"
            "  </siteinfo>\n")
    pages = [_page("Template:Lang", 10, 1, "{{{2}}}")]
    pages += [_page(f"Article {i}", 0, 10 + i, _wikitext(i, d)) for i, d in enumerate(docs)]
    path.write_text(head + "".join(pages) + "</mediawiki>\n", encoding="utf-8")
    return path


def run_wikiextractor(dump: Path, out: Path, *extra: str) -> Path:
    """WikiExtractor as users run it (``python -m wikiextractor.WikiExtractor``); fails the test with its output."""
    proc = subprocess.run([sys.executable, "-m", "wikiextractor.WikiExtractor", str(dump), "-o", str(out), "-q",
                           *extra], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def wiki(english_corpus, tmp_path_factory) -> dict:
    """Runs WikiExtractor (default and ``--json`` output) on a dump of real English articles."""
    pytest.importorskip("wikiextractor", reason="pip install wikiextractor (the 'dev' extra)")
    root = tmp_path_factory.mktemp("wiki")
    docs = _english_documents(english_corpus, ARTICLES, wiki_safe=True)
    assert len(docs) == ARTICLES
    dump = write_dump(root / "dump.xml", docs)
    return {"docs": docs, "doc": run_wikiextractor(dump, root / "doc"),
            "json": run_wikiextractor(dump, root / "json", "--json")}


def test_wikiextractor_output_is_detected_and_both_forms_agree(wiki):
    doc_files, json_files = input_files(wiki["doc"]), input_files(wiki["json"])
    assert [f.relative_to(wiki["doc"]).as_posix() for f in doc_files] == ["AA/wiki_00"]  # no suffix to go by
    assert [detect_format(f) for f in doc_files + json_files] == ["wikiextractor", "wikiextractor-json"]
    from_doc = [d for d, _ in iter_documents(doc_files)]
    assert from_doc == [d for d, _ in iter_documents(json_files)]
    assert len(from_doc) == ARTICLES and sum(n for _, n in iter_documents(doc_files)) == doc_files[0].stat().st_size
    for i, doc in enumerate(from_doc):
        sentences = split_sentences(doc)
        assert f"Article {i}" not in doc  # the title line is dropped
        assert "History." in sentences  # a heading is a paragraph of its own
        assert not re.search(r"\[\[|\]\]|'''|\{\{|== History|&amp;|&lt;", doc)  # markup gone, escapes undone
        # links and bold resolved, the template expanded, WikiExtractor's '&amp;' undone
        assert "See free software and copyleft; AT&T said Bonjour tout le monde." in sentences
    # the splitter found the sentences of the source text, not one per paragraph (WikiExtractor drops a little text
    # it takes for markup, e.g. `Callable[[int, str], float]` in a docstring)
    found = sum(len(split_sentences(d)) for d in from_doc)
    assert found >= 0.9 * sum(len(split_sentences(" ".join(s))) for s in wiki["docs"])


def test_wikiextractor_doc_format_bytes_limits_and_cut(tmp_path):
    """Files in exactly WikiExtractor's layout (extract.py): the tags and blank lines count towards their document,
    an over-long paragraph is skipped and counted, an over-long article is cut between paragraphs."""
    long_para = "word " * 40
    articles = [("1", "First", ["Alpha one. Alpha two.", "Heading.", "Alpha three &amp; four &lt;5&gt;."]),
                ("2", "Second", ["Beta one.", long_para, "Beta two."]),
                ("3", "Empty redirect", []),
                ("4", "Long", [f"Gamma sentence number {k}." for k in range(12)])]
    data = "".join(f'<doc id="{i}" url="https://en.wikipedia.org/wiki?curid={i}" title="{t}">\n{t}\n\n'
                   + "".join(p + "\n" for p in paras) + "\n</doc>\n" for i, t, paras in articles)
    path = tmp_path / "wiki_00"
    path.write_text(data, encoding="utf-8")
    skipped = SkipCounts()
    docs = list(iter_documents([path], TextLimits(max_document_bytes=100), skipped))
    assert [d for d, _ in docs[:3]] == ["Alpha one. Alpha two.\n\nHeading.\n\nAlpha three & four <5>.",
                                       "Beta one.\n\nBeta two.", ""]
    gamma = [d for d, _ in docs[3:]]
    assert "\n\n".join(gamma).split("\n\n") == [f"Gamma sentence number {k}." for k in range(12)]
    assert all(sum(len(p) + 1 for p in d.split("\n\n")) <= 100 for d in gamma)  # its lines, as read, fit
    assert skipped.document_cuts == len(gamma) - 1 > 0
    assert skipped.long_lines == 1 and sum(n for _, n in docs) == len(data.encode())


_DETECTION = [  # (file name, content, detect_format's answer)
    ("wiki_00", '<doc id="7" url="u" title="T">\nT\n\nText.\n</doc>\n', "wikiextractor"),
    ("wiki_01", '\n{"id": "7", "revid": "8", "url": "u", "title": "T \\"q\\"", "text": "Text."}\n',
     "wikiextractor-json"),
    ("wiki_02.json", '{"id": "7", "url": "u", "title": "T", "text": "Text."}\n', "wikiextractor-json"),
    ("records", '{"text": "One. Two.", "source": "web"}\n', "jsonl"),
    ("records.txt", '{"text": "One. Two."}\n', "jsonl"),  # a whole JSON object: JSON lines whatever the suffix
    ("braces.txt", "{braces} are used for sets.\nA second sentence.\n", "bert"),
    ("braces", "{braces} are used for sets.\n", "bert"),
    ("doc.txt", "<doc is a word in no language.\nA second sentence.\n", "bert"),
    ("broken.jsonl", "{braces} are used for sets.\n", "jsonl"),  # the suffix keeps its rule: an error when read
    ("plain.txt", "One sentence.\n\nAnother document.\n", "bert"),
    ("bzh.txt", "BZh is how a bzip2 file starts.\n", "bert"),  # without its block-size digit
    ("empty", "", "bert"),
]


@pytest.mark.parametrize(("name", "content", "expected"), [pytest.param(*case, id=case[0]) for case in _DETECTION])
def test_auto_detection(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    assert detect_format(path) == expected


def test_explicit_formats_and_refusals(tmp_path):
    braces = tmp_path / "braces.txt"
    braces.write_text('{"text": "a JSON-looking first sentence"}\nA second one.\n', encoding="utf-8")
    assert detect_format(braces) == "jsonl"
    assert detect_format(braces, "bert") == "bert"
    assert [d for d, _ in iter_documents([braces], input_format="bert")] == [[
        '{"text": "a JSON-looking first sentence"}', "A second one."]]
    table = tmp_path / "table"  # Parquet by its magic, without the suffix
    pq.write_table(pa.table({"text": ["One. Two."]}), table)
    assert detect_format(table) == "parquet"
    with pytest.raises(ValueError, match=r"input_format='xml' must be one of auto, bert, jsonl, wikiextractor"):
        detect_format(braces, "xml")
    plain = tmp_path / "plain"
    plain.write_text("Just a sentence.\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"plain: not WikiExtractor output \(--input-format wikiextractor\)"):
        detect_format(plain, "wikiextractor")
    import bz2

    packed = tmp_path / "wiki_00.bz2"
    packed.write_bytes(bz2.compress(b'<doc id="1" url="u" title="T">\nT\n\n</doc>\n'))
    with pytest.raises(ValueError, match=r"wiki_00\.bz2: bzip2 \(e\.g\. WikiExtractor -c\)-compressed"):
        detect_format(packed)


# ---- malformed WikiExtractor input ---------------------------------------------------------------------------------

_HEAD = '<doc id="1" url="https://en.wikipedia.org/wiki?curid=1" title="A">\nA\n\n'


@pytest.mark.parametrize(("content", "message"), [
    (_HEAD + "One. Two.\n", r"wiki_00:1: unterminated <doc>: the file ends at line 4 before its </doc>"),
    (_HEAD + "One.\n" + _HEAD + "Two.\n</doc>\n", r"wiki_00:1: unterminated <doc>: a new <doc> starts at line 5"),
    (_HEAD + "One.\n</doc>\nStray text.\n", r"wiki_00:6: text outside a <doc \.\.\.> \.\.\. </doc> block"),
    ('{"id": "1", "url": "u", "title": "A", "text": "One."}\n{"id": "2", "url": "u", "title": "B", "text": \n',
     r"wiki_00:2: not valid JSON"),
], ids=["ends-inside-doc", "doc-inside-doc", "text-outside-doc", "bad-json-line"])
def test_malformed_wikiextractor_input_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "wiki_00"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        list(iter_documents([path]))


def test_cli_unterminated_doc_is_one_line_exit_2(tokenizer_dir, tmp_path, capsys):
    (tmp_path / "AA").mkdir()
    (tmp_path / "AA" / "wiki_00").write_text(_HEAD + "One. Two.\n</doc>\n" + _HEAD + "Cut short", encoding="utf-8")
    code = create_main(["--input", str(tmp_path / "AA"), "--tokenizer", str(tokenizer_dir), "--seq-len", "128",
                       "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert re.search(r"error: .*AA/wiki_00:6: unterminated <doc>: the file ends at line 9", err), err
    assert not (tmp_path / "out").exists()


# ---- Parquet -------------------------------------------------------------------------------------------------------

def _texts(corpus: Path, n: int) -> list[str]:
    return [" ".join(d) for d in _english_documents(corpus, n)]


def write_parquet(path: Path, texts: list, row_group_size: int) -> Path:
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path,
                   row_group_size=row_group_size)
    return path


def test_parquet_reads_like_the_same_jsonl(english_corpus, tokenizer_dir, tmp_path):
    texts = _texts(english_corpus, 40)
    table = write_parquet(tmp_path / "train-00000-of-00001.parquet", texts, row_group_size=7)
    assert pq.ParquetFile(table).num_row_groups == 6
    lines = tmp_path / "same.jsonl"
    lines.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    from_parquet = [d for d, _ in iter_documents([table])]
    assert from_parquet == [d for d, _ in iter_documents([lines])] == texts
    counted = [n for _, n in iter_documents([table])]
    assert counted == [len(t.encode()) + 1 for t in texts]
    assert abs(input_bytes(table) - sum(counted)) < 0.05 * sum(counted)  # the progress bar's total, from metadata
    sets = [create_shards([src], tokenizer_dir, tmp_path / src.stem, seq_len=128, progress=False)
            for src in (table, lines)]
    assert sets[0].extra["input_formats"] == {"parquet": 1} and sets[1].extra["input_formats"] == {"jsonl": 1}
    # one chunk each, the same documents: the same sentences, pairs and masks, byte for byte
    assert [s.sha256 for s in sets[0].shards] == [s.sha256 for s in sets[1].shards] and sets[0].total_samples > 50
    assert sets[0].extra["counts"] == sets[1].extra["counts"]


def test_parquet_limits_and_nulls(tmp_path):
    texts = ["Short one. Short two.", None, "x " * 200, "Last one. Really."]
    path = write_parquet(tmp_path / "t.parquet", texts, row_group_size=2)
    skipped = SkipCounts()
    docs = list(iter_documents([path], TextLimits(max_document_bytes=100), skipped))
    assert [d for d, _ in docs] == ["Short one. Short two.", "", "", "Last one. Really."]
    assert skipped.long_lines == 1 and [n for _, n in docs] == [22, 1, 401, 18]
    assert list(iter_training_texts([path], TextLimits(max_document_bytes=100))) == [
        "Short one. Short two.", "", "", "Last one. Really."]


def test_parquet_is_read_in_bounded_batches(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "t.parquet", [f"Row {i}. Has two sentences." for i in range(3000)],
                         row_group_size=1000)
    sizes: list[int] = []
    real = pq.ParquetFile.iter_batches

    def recording(self, *args, **kwargs):
        for batch in real(self, *args, **kwargs):
            sizes.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", recording)
    assert len(list(iter_documents([path]))) == 3000
    assert max(sizes) == text._PARQUET_BATCH_ROWS <= 1024 and sum(sizes) == 3000


_PEAK = """
import resource, sys
import pyarrow as pa, pyarrow.compute, pyarrow.parquet
from bert_ds.data import text
if len(sys.argv) > 2:  # the control: what reading the whole table takes
    read = lambda: pyarrow.parquet.read_table(sys.argv[1]).column("text").to_pylist()
else:
    read = lambda: text.iter_documents([sys.argv[1]])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = sum(1 for _ in read())
print(n, pa.default_memory_pool().max_memory(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""


def _peak(path: Path, *control: str) -> tuple[int, int, int]:
    """(documents, Arrow's peak allocation in bytes, RSS growth in KiB) of reading ``path`` in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", _PEAK, str(path), *control], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    n, arrow_peak, rss_growth_kib = map(int, proc.stdout.split())
    return n, arrow_peak, rss_growth_kib


def test_parquet_memory_stays_bounded(english_corpus, tmp_path):
    """40 MB of real text in 40 row groups (17 MB of Parquet), read in a fresh process. Measured here: Arrow's peak
    allocation 3.5 MB (reading the table whole: 60 MB; pyarrow's default pre-buffering: 21 MB, the compressed
    column) and the RSS grows by 14 MB (whole: 118 MB), of which only ~0.1 MB per row group depends on the size."""
    corpus = english_corpus.read_text(encoding="utf-8").replace("\n", " ")
    path = tmp_path / "big.parquet"
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for g in range(40):
            starts = [(g * 1000 + k) * 997 % (len(corpus) - 1000) for k in range(1000)]
            writer.write_table(pa.table({"text": [corpus[s:s + 1000] for s in starts]}))
    assert pq.ParquetFile(path).num_row_groups == 40
    n, arrow_peak, rss_growth_kib = _peak(path)
    assert n == 40_000
    assert arrow_peak < 8 * 2**20, arrow_peak
    assert rss_growth_kib < 40 * 2**10, rss_growth_kib


def test_parquet_errors_name_the_file(tmp_path, monkeypatch):
    no_text = tmp_path / "no_text.parquet"
    pq.write_table(pa.table({"id": [1], "content": ["One. Two."]}), no_text)
    with pytest.raises(ValueError, match=r"no_text\.parquet: no 'text' column; its columns are: id, content"):
        list(iter_documents([no_text]))
    numbers = write_parquet(tmp_path / "numbers.parquet", [1, 2], row_group_size=1)
    with pytest.raises(ValueError, match=r"numbers\.parquet: column 'text' holds int64, not strings"):
        list(iter_documents([numbers]))
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet at all\n")
    with pytest.raises(ValueError, match=r"fake\.parquet: not readable as Parquet"):
        list(iter_documents([fake]))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(ValueError, match=r"no_text\.parquet: reading Parquet needs pyarrow.*pip install "
                                         r"'bert_ds\[parquet\]'"):
        list(iter_documents([no_text]))


def test_cli_parquet_without_text_column_is_one_line_exit_2(tokenizer_dir, tmp_path, capsys):
    src = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"content": ["One. Two."], "url": ["u"]}), src)
    code = create_main(["--input", str(src), "--tokenizer", str(tokenizer_dir), "--seq-len", "128",
                       "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "corpus.parquet: no 'text' column; its columns are: content, url" in err
    assert not (tmp_path / "out").exists()


# ---- end to end ----------------------------------------------------------------------------------------------------

def test_shards_and_tokenizer_from_wikiextractor_output(wiki, tokenizer_dir, tmp_path, capsys, shard_reader):
    for form, kind in (("doc", "wikiextractor"), ("json", "wikiextractor-json")):
        create_main(["--input", str(wiki[form]), "--tokenizer", str(tokenizer_dir), "--seq-len", "128",
                     "--out", str(tmp_path / form), "--dupe-factor", "2"])
        listing = capsys.readouterr().out
        assert re.search(rf"wiki_00 \(\d+\.\d+ MiB, {kind}\)", listing), listing
        index = ShardIndex.load(tmp_path / form)
        assert index.extra["input_formats"] == {kind: 1} and index.extra["counts"]["documents"] == ARTICLES
        assert len(shard_reader(tmp_path / form)) == index.total_samples > 100
    assert ([s.sha256 for s in ShardIndex.load(tmp_path / "doc").shards]
            == [s.sha256 for s in ShardIndex.load(tmp_path / "json").shards])
    tok = load_tokenizer(train_tokenizer([wiki["doc"]], tmp_path / "tok", vocab_size=600))
    assert {"license", "software", "history"} <= set(tok.vocab) and "amp" not in tok.vocab


def test_shards_and_tokenizer_from_parquet(english_corpus, tmp_path):
    path = write_parquet(tmp_path / "train.parquet", _texts(english_corpus, 60), row_group_size=10)
    tok_dir = train_tokenizer([path], tmp_path / "tok", vocab_size=600)
    assert {"license", "software"} <= set(load_tokenizer(tok_dir).vocab)
    index = create_shards([path], tok_dir, tmp_path / "out", seq_len=512, samples_per_shard=100,
                          progress=False)
    assert index.extra["input_formats"] == {"parquet": 1} and len(index.shards) >= 2 and index.total_samples > 100
