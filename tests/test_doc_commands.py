"""Every shell command of README.md and docs/*.md is run here as written, or names the test that runs its form, or says
why nothing here can run it (issue 14: "every command in the README and docs/ is run by a test or by CI").

``tests/test_docs.py`` checks that each command parses and that its programs, flags and paths exist. This file runs
them. Each shell block gets a fresh directory holding what its commands read and do not make themselves (a corpus, a
WikiExtractor dump, GLUE/SQuAD/SWAG/CoNLL files built from real English text, a tiny model export, a trained tiny run),
with ``bert_ds/``, ``ds_configs/``, ``slurm/`` and ``tools/`` linked from the checkout, and the virtual environment's
``bin/`` first on ``PATH``. The block's runnable commands then run there in order, word for word, each to exit 0. The
inputs are small, so ``--vocab-size 30522`` or ``--workers 16`` run at the scale of the corpus given, not of Wikipedia.

Every command matches exactly one rule of :data:`RULES` (a command no rule knows fails
``test_every_command_has_one_rule``): ``run`` here, ``covered`` by the named tests (the same program and flags on CPU
ranks at a scale this machine holds: 8 GPUs become 2 CPU ranks, 8 Slurm nodes the one-node cluster), or ``cannot``:
nothing here can run it (the network, a 22 GB dump, GPUs), with the reason.
"""

from __future__ import annotations

import bz2
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import HANG_GUARD_S, child_env
from tests.test_docs import DOCUMENTS, ROOT, logical_lines, shell_blocks, shell_text

LINKED = ("bert_ds", "ds_configs", "slurm", "tools")
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Rule:
    pattern: str
    """``re.search`` on the command (continuation lines joined)."""
    kind: str
    """``run``, ``covered`` or ``cannot``."""
    why: str = ""
    """covered: the tests (``path::name``, comma separated) that run the command's form; cannot: the reason."""


DEMO = "tests/test_demo.py::test_quick_demo_end_to_end_and_again"
CI = ".ci/run"
VENV = f"{CI} (make test builds .venv: Makefile target venv)"
TWO_RANKS = "tests/faults/test_fault_table.py::test_fault"
SUPERVISED = ("tests/faults/test_fault_table.py::test_fault, "
              "tests/faults/test_fault_table_preemption.py::test_group_sigterm_checkpoints_exits_75_and_resumes_exactly")
NO_SSH = "tests/launch/test_launch_paths.py::test_two_launchers_with_no_ssh_match_one_node"
MPIRUN = ("tests/launch/test_launch_paths.py::test_mpirun_matches_one_node, "
          "tests/launch/test_preemption_launchers.py::test_supervised_mpirun_sigterm_exits_75_and_resumes_exactly")
SLURM = "tests/launch/test_slurm.py::test_sbatch_runs_both_phases_with_one_srun_task_per_rank"
SLURM_HOSTFILE = "tests/launch/test_launch_paths.py::test_deepspeed_launcher_from_a_slurm_hostfile_matches_one_node"
GLUE = "tests/downstream/test_suite.py::test_glue_suite_table"
BENCH = "tests/test_benchmark.py::test_step_section_compares_both_models_on_real_batches"
GPU_CHECK = "tests/test_gpu_check.py::test_dry_mode_runs_what_it_can_and_skips_the_gpu_items"
KERNEL_REPORT = ("tests/kernels/test_kernel_report.py::"
                 "test_kernel_report_covers_every_shipped_recipe_without_spills_and_with_tensor_cores")
NETWORK = "downloads from the network (this machine reaches only the package registries)"
TIMING = "a developer benchmark of minutes (its figures are printed, not asserted)"

RULES: dict[str, list[Rule]] = {
    "README.md": [
        Rule(r"^make demo", "covered", f"{DEMO}, {CI} (make demo)"),
        Rule(r"^make test", "covered", CI),
        Rule(r"^python3 -m venv|^pip install", "covered", VENV),
        Rule(r"^bert-ds-(train-tokenizer|create-shards|verify-shards) ", "run"),
        Rule(r"^bert-ds deepspeed --num_gpus 8 ", "covered", SUPERVISED),
        Rule(r"^bert-ds-make-hostfile --hosts", "run"),
        Rule(r"^deepspeed --hostfile hostfile bert_ds", "cannot", "pdsh and ssh to node0/node1; the --no_ssh form of "
             f"the same launch is {NO_SSH}"),
        Rule(r"^bert-ds mpirun -np 16 -H node0:8", "covered", MPIRUN),
        Rule(r"^sbatch --nodes=8 .* slurm/pretrain_large\.sh", "covered", SLURM),
        Rule(r"^bert-ds-(evaluate|convert-checkpoint|finetune|extract-features) ", "run"),
        Rule(r"^bert-ds-glue ", "covered", GLUE),
        Rule(r"^bert-ds-gpu-check", "covered", GPU_CHECK),
        Rule(r"^bert-ds-benchmark", "covered", BENCH),
    ],
    "docs/benchmarks.md": [
        Rule(r"^bert-ds-benchmark", "covered", BENCH),
        Rule(r"^python tools/bench_(create|loader|lamb)\.py", "cannot", TIMING),
        Rule(r"^python -m bert_ds\.devtools\.suite_profile .* -- make test", "covered",
             "tests/test_suite_profile.py::test_cpu_is_charged_to_the_test_that_started_the_process"),
        Rule(r"^BERT_DS_TEST_CPU=\S+ PYTEST_ADDOPTS=\"-p tests\.helpers\.cpu_per_test\" make test$|"
             r"^python -m tests\.helpers\.cpu_per_test ", "covered",
             "tests/test_cpu_per_test.py::test_each_process_is_charged_to_the_test_that_ran_it"),
    ],
    "docs/cluster.md": [
        Rule(r"^FOLLOWUPS=5 slurm/submit_chain\.sh", "covered",
             "tests/launch/test_slurm_preemption.py::test_term_only_without_scontrol_follow_up_job_resumes_exactly"),
        Rule(r"^deepspeed --num_gpus 2 bert_ds/runtime/pretrain\.py --recipe ds_configs/tiny_cpu\.json", "run"),
    ],
    "docs/data.md": [
        Rule(r"^(/usr/bin/time -v )?bert-ds-(train-tokenizer|create-shards) ", "run"),
        Rule(r"^mpirun -np 16 bert-ds-create-shards \.\.\.", "covered",
             "tests/data/test_create_parallel.py::test_mpirun_two_ranks_write_the_same_shards"),
        Rule(r"^sbatch --nodes=4 .* slurm/create_shards\.sh", "covered",
             "tests/launch/test_launch_paths.py::test_create_shards_sh_with_two_mpi_ranks_matches_one_process"),
        Rule(r"^pip install", "cannot", f"{NETWORK}; {VENV} installs the dev extra"),
        Rule(r"^wget |^huggingface-cli download", "cannot", NETWORK),
        Rule(r"^python -m wikiextractor\.WikiExtractor", "run"),
        Rule(r"^bert-ds (create|verify)-shards .*s3://", "covered",
             "tests/data/remote/test_remote_cache.py::test_create_shards_uploads_to_s3_and_verify_shards_reads_it"),
        Rule(r"^bert-ds deepspeed --num_gpus 2 .*--data s3://", "covered",
             "tests/data/remote/test_remote_training.py::test_training_from_s3_equals_local_run"),
    ],
    "docs/demo.md": [
        Rule(r"^make demo", "covered", f"{DEMO}, {CI} (make demo)"),
        Rule(r"^bert-ds-demo --out demo_run --quick", "covered", DEMO),
    ],
    "docs/finetune.md": [
        Rule(r"^bert-ds-finetune ", "run"),
        Rule(r"^deepspeed --num_gpus 8 tools/finetune\.py", "covered",
             "tests/downstream/test_finetune_deepspeed.py::test_finetune_on_two_deepspeed_cpu_ranks"),
        Rule(r"^bert-ds-glue ", "covered", GLUE),
    ],
    "docs/kernels.md": [
        Rule(r"^bert-ds-kernel-report", "covered", KERNEL_REPORT),
        Rule(r"^bert-ds-gpu-check", "covered", GPU_CHECK),
    ],
    "docs/launching.md": [
        Rule(r"^bert-ds deepspeed --num_gpus 8 ", "covered", SUPERVISED),
        Rule(r"^bert-ds-make-hostfile --hosts", "run"),
        Rule(r"^deepspeed --hostfile hostfile --no_ssh", "covered", NO_SSH),
        Rule(r"^bert-ds mpirun -np 16 -H node0:8", "covered", MPIRUN),
        Rule(r"^sbatch --nodes=8 .* slurm/pretrain_large\.sh", "covered", SLURM),
        Rule(r"^sbatch --nodes=2 .* slurm/pretrain_base\.sh", "covered",
             "tests/launch/test_launch.py::test_pretrain_scripts_take_sizes_from_the_allocation"),
        Rule(r"^bert-ds-make-hostfile --slurm|^srun ", "covered", SLURM_HOSTFILE),
        Rule(r"^python -m bert_ds\.runtime\.pretrain --recipe ds_configs/tiny_cpu\.json", "run"),
    ],
}


@dataclass(frozen=True)
class Command:
    document: str
    block: str
    """``path:line`` of the block's opening fence."""
    text: str


def _commands(block_text: str) -> list[str]:
    out = []
    for line in logical_lines(block_text):
        line = re.sub(r"\s+", " ", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def all_commands() -> list[Command]:
    return [Command(str(path.relative_to(ROOT)), block.where, text)
            for path in DOCUMENTS for block in shell_blocks(path) for text in _commands(shell_text(block))]


def rule_of(command: Command) -> Rule:
    matches = [r for r in RULES.get(command.document, []) if re.search(r.pattern, command.text)]
    assert len(matches) == 1, f"{command.block}: {len(matches)} rules match {command.text!r}: {matches}"
    return matches[0]


def test_every_command_has_one_rule():
    commands = all_commands()
    assert len(commands) > 50  # the extraction found the documents' commands
    for command in commands:
        rule_of(command)
    used = {(c.document, rule_of(c).pattern) for c in commands}
    stale = [(doc, r.pattern) for doc, rules in RULES.items() for r in rules if (doc, r.pattern) not in used]
    assert not stale, f"rules that match no command (remove them): {stale}"


def _test_exists(node: str) -> bool:
    path, _, name = node.partition("::")
    file = ROOT / path
    return file.is_file() and (not name or re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M))


def test_covered_commands_name_tests_that_exist():
    for command in all_commands():
        rule = rule_of(command)
        if rule.kind == "covered":
            for node in rule.why.split(", "):
                node = node.split(" ")[0]
                assert _test_exists(node), f"{command.block}: {command.text!r} names {node}, which does not exist"
        else:
            assert rule.kind in ("run", "cannot") and (rule.kind == "run" or rule.why), rule


# ---- what the blocks read ---------------------------------------------------------------------------------------

def _documents(corpus: Path) -> list[list[str]]:
    return [d.splitlines() for d in corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()]


def _corpus_dir(corpus: Path, out: Path, max_bytes: int = 150_000) -> None:
    """``corpus/``: the first documents of the English corpus, about ``max_bytes``, in BERT layout."""
    kept, size = [], 0
    for doc in _documents(corpus):
        kept.append("\n".join(doc))
        size += len(kept[-1])
        if size > max_bytes:
            break
    out.mkdir(parents=True)
    (out / "english.txt").write_text("\n\n".join(kept) + "\n", encoding="utf-8")


def _dump(corpus: Path, path: Path) -> None:
    """A bzip2'd MediaWiki export of real English articles, the layout of enwiki-latest-pages-articles.xml.bz2."""
    from tests.data.test_corpora import _english_documents, write_dump

    xml = write_dump(path.with_suffix(""), _english_documents(corpus, 40, wiki_safe=True))
    path.write_bytes(bz2.compress(xml.read_bytes()))
    xml.unlink()


def _parquet(corpus: Path, directory: Path) -> None:
    """Hugging Face's wikimedia/wikipedia layout: train-000NN-of-000MM.parquet with id, url, title and text."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = _documents(corpus)[:60]
    directory.mkdir(parents=True)
    for n, part in enumerate((docs[:30], docs[30:])):
        table = pa.table({"id": [str(i) for i in range(len(part))], "url": ["https://en.wikipedia.org/"] * len(part),
                          "title": [d[0][:40] for d in part], "text": ["\n".join(d) for d in part]})
        pq.write_table(table, directory / f"train-{n:05d}-of-00002.parquet")


def _finetune_data(sandbox: Path, docs: list[list[str]]) -> None:
    from tests.helpers.downstream_data import write_conll, write_mrpc, write_squad, write_stsb, write_swag

    write_mrpc(docs, sandbox / "glue_data" / "MRPC", n_train=32, n_dev=16)
    write_stsb(docs, sandbox / "glue_data" / "STS-B", n_train=32, n_dev=16)
    for version in (1, 2):
        write_squad(docs, sandbox / "squad", n_train_q=16, n_dev_q=8, version=version)
    write_swag(docs, sandbox / "swag" / "regular", n_train=24, n_dev=12)
    write_conll(docs, sandbox / "conll2003", n_train=32, n_dev=16)
    rows = [(" ".join(d[0].split()[:20]), "licence" if "licen" in " ".join(d).lower() else "python") for d in docs]
    for name, part in (("train.csv", rows[:48]), ("dev.csv", rows[48:72])):
        (sandbox / name).write_text("text,label\n" + "".join(f'"{t.replace(chr(34), "")}",{lab}\n' for t, lab in part))


class Sandbox:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True)
        for name in LINKED:
            (root / name).symlink_to(ROOT / name)

    def link(self, name: str, target: Path) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)

    def run(self, command: Command) -> subprocess.CompletedProcess:
        env = child_env(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
        env.pop("VIRTUAL_ENV", None)
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command.text], cwd=self.root, env=env,
                              capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert proc.returncode == 0, (f"{command.block}: {command.text}\nexit {proc.returncode}\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return proc


def _blocks_to_run() -> list[str]:
    seen = []
    for command in all_commands():
        if rule_of(command).kind == "run" and command.block not in seen:
            seen.append(command.block)
    return seen


def _runnable(block: str) -> list[Command]:
    return [c for c in all_commands() if c.block == block and rule_of(c).kind == "run"]


def launching_block() -> str:
    """docs/launching.md's block: its single-process run (``--output runs/tiny``) is what the export blocks read."""
    blocks = [c.block for c in all_commands() if c.document == "docs/launching.md" and rule_of(c).kind == "run"]
    assert blocks, "docs/launching.md has no runnable command: the export blocks have no tiny run to read"
    return blocks[0]


@pytest.fixture(scope="module")
def ran_blocks() -> dict[str, Path]:
    """Sandboxes of the blocks already run in this module (a block runs once; a later block may read its outputs)."""
    return {}


def run_block(block: str, request, ran: dict[str, Path]) -> Path:
    if block not in ran:
        box = Sandbox(request.getfixturevalue("tmp_path_factory").mktemp("doc_commands") / "sandbox")
        _given(block, box, request, ran)
        for command in _runnable(block):
            box.run(command)
        ran[block] = box.root
    return ran[block]


def _tiny_run(request, ran) -> Path:
    return run_block(launching_block(), request, ran) / "runs" / "tiny"


def _given(block: str, box: Sandbox, request, ran: dict[str, Path]) -> None:
    """Put in the sandbox what the block's runnable commands read and do not make."""
    corpus = request.getfixturevalue("english_corpus")
    text = "\n".join(_uncommented(c.text) for c in _runnable(block))
    made = set(re.findall(r"(?:--out|--output|-o) (\S+?)/?(?:\s|$)", text))
    if "corpus/" in text:
        _corpus_dir(corpus, box.root / "corpus")
    if "enwiki-latest-pages-articles.xml.bz2" in text:
        _dump(corpus, box.root / "enwiki-latest-pages-articles.xml.bz2")
    elif re.search(r"(?<![\w])wiki/", text) and "wiki" not in made:
        _dump(corpus, box.root / "dump.xml.bz2")
        subprocess.run([sys.executable, "-m", "wikiextractor.WikiExtractor", "dump.xml.bz2", "-o", "wiki/", "-q"],
                       cwd=box.root, check=True, capture_output=True, timeout=HANG_GUARD_S)
    if "hf_wiki/" in text:
        _parquet(corpus, box.root / "hf_wiki" / "20231101.en")
    for name, fixture in (("tok", "tokenizer_dir"), ("shards128", "shards_128"), ("shards512", "shards_512")):
        if f"{name}/" in text and name not in made:
            box.link(name, request.getfixturevalue(fixture))
    if "runs/large" in text:
        shutil.copytree(_tiny_run(request, ran), box.root / "runs" / "large", symlinks=True)
        box.link("eval512", request.getfixturevalue("shards_512"))
    if "--model hf_model" in text:
        subprocess.run([str(BIN / "bert-ds-convert-checkpoint"), "--checkpoint",
                        str(_tiny_run(request, ran) / "checkpoints"), "--out", str(box.root / "hf_model")],
                       check=True, capture_output=True, timeout=HANG_GUARD_S, env=child_env())
    if "glue_data" in text or "squad" in text or "--train train.csv" in text:
        _finetune_data(box.root, _documents(corpus))
    if "sentences.txt" in text:
        (box.root / "sentences.txt").write_text("\n".join(d[0] for d in _documents(corpus)[:20]) + "\n")


def _uncommented(command: str) -> str:
    return re.sub(r"\s#.*$", "", command)


@pytest.mark.e2e
@pytest.mark.parametrize("block", _blocks_to_run())
def test_block_runs_as_written(block, request, ran_blocks):
    root = run_block(block, request, ran_blocks)
    # What the commands say they write exists (a command that exits 0 having written nothing fails here).
    for command in _runnable(block):
        for out in re.findall(r"(?:--out|--output|-o) (\S+)", _uncommented(command.text)):
            assert (root / out).exists(), f"{command.block}: {command.text!r} did not write {out}"
