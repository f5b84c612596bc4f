"""The fault and bad-input table of issue 8: every case breaks one thing, runs one real command
(``bert_ds.runtime.pretrain`` on one or two DeepSpeed CPU ranks, or a ``tools/`` CLI), and checks the exit code, the
first line of the message (it must name the culprit), the time to exit, that no process of the command's tree outlives
it, and that nothing was lost (the previous checkpoint still loads and ``latest`` names it, no partial tag, no output
where none belongs, and for interrupted runs: resumed weights bit-identical to an uninterrupted run with dropout on).

The recipe is the shipped ``ds_configs/tiny_cpu.json`` (dropout 0.1, ZeRO-2, LAMB, two phases) cut to 6 + 2 steps
(``tests.helpers.faults.fault_recipe``); the data is the real English text of the session fixtures. With
``BERT_DS_FAULT_REPORT=table.md`` every case appends its row (case, item, exit code, seconds to exit, first line,
what was lost) to that markdown file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch

from bert_ds import checkpoint as ckpt
from bert_ds.data.format import HEADER_SIZE
from bert_ds.data.reader import verify_shard_set
from tests.helpers import HANG_GUARD_S
from tests.helpers.checkpoint_damage import rerecord_checksum
from tests.helpers.faults import (
    FINAL_TAG,
    IN_PROCESS,
    LAUNCHED,
    PHASE1_END,
    REPO,
    FaultContext,
    Launch,
    Outcome,
    Trigger,
    fault_recipe,
    first_member,
    kill_loader_worker,
    kill_rank,
    limit_file_size,
    limit_memory,
    patch_file,
    rehash,
    run_row,
    signal_every_rank,
    tool_cmd,
)
from tests.helpers.faults import FaultCase as Case
from tests.helpers.ranks import rank_command, spawn_ranks
from tests.helpers.runs import assert_close_params, weights

LAUNCHER_EXIT = r"launch\.py:\d+:sigkill_handler\].*exits with return code"
"""The deepspeed launcher's line when a rank dies: it names the rank's command line (``--local_rank=N``)."""
KILLED = 128 + signal.SIGKILL  # a rank killed by SIGKILL: bert-ds deepspeed exits 137 (exit_codes)
VOCAB_SIZE = 4000  # the ``tokenizer_dir`` fixture's


# ---- the context a case works in -----------------------------------------------------------------------------------

@dataclass
class Ctx(FaultContext):
    state: dict = field(default_factory=dict)

    def fixture(self, name: str):
        return self.request.getfixturevalue(name)

    def args(self, *extra: str, data: tuple[Path, ...] | None = None, recipe: Path | None = None,
             run: Path | None = None) -> list[str]:
        data = data or (self.s128, self.s512)
        return ["--recipe", str(recipe or self.recipe), "--data", *map(str, data), "--tokenizer", str(self.tokenizer),
                "--output", str(run or self.run), *extra]

    def copy_shards(self, which: str = "s128") -> Path:
        dst = self.tmp / which
        shutil.copytree(getattr(self, which), dst)
        return dst

    def copy_trained_run(self) -> Path:
        """A private copy of the 2-step run (``phase1-step000002``) to resume, corrupt or read."""
        shutil.copytree(self.fixture("trained_run"), self.run)
        return self.run


def _tags(run: Path) -> list[str]:
    ckpt_dir = run / "checkpoints"
    return sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith(("phase", ".phase"))) \
        if ckpt_dir.is_dir() else []


def _intact(run: Path, tag: str) -> str:
    """``latest`` names ``tag``, no partial or half-deleted tag is left, and ``tag`` consolidates to finite weights."""
    ckpt_dir = run / "checkpoints"
    assert ckpt.read_latest(ckpt_dir) == tag, (ckpt.read_latest(ckpt_dir), _tags(run))
    debris = [p.name for p in ckpt_dir.iterdir() if p.name.endswith((".tmp", ".old", ".deleting"))]
    assert not debris, debris
    state = ckpt.consolidated_state_dict(ckpt_dir, tag)
    assert all(torch.isfinite(t).all() for t in state.values())
    return f"nothing: latest={tag} loads"


def _nothing_written(run: Path) -> str:
    assert not run.exists(), sorted(p.name for p in run.rglob("*"))
    return "nothing: refused before compute, --output not created"


def _no_checkpoint(run: Path) -> str:
    assert _tags(run) == [] and not (run / "checkpoints" / "latest").exists(), _tags(run)
    return "nothing: stopped at the first batch, no checkpoint written"


def _identical(run: Path, reference: Path, tags: tuple[str, ...] = (PHASE1_END, FINAL_TAG)) -> None:
    for tag in tags:
        got, want = weights(run, tag), weights(reference, tag)
        differ = [name for name in want if not torch.equal(got[name], want[name])]
        assert not differ, f"{tag}: {len(differ)} of {len(want)} tensors differ from the uninterrupted run"


def _resume_exactly(ctx: Ctx, *extra: str) -> str:
    """Finish the interrupted run with ``--resume auto`` on 2 ranks (spawned directly: the row's command was the
    launched one): both phase ends bit-identical to the reference."""
    spawn_ranks(2, ctx.args("--resume", "auto", *extra), check=True)
    _identical(ctx.run, ctx.fixture("fault_reference_run"))
    return f"resumed to {FINAL_TAG}: weights bit-identical to the uninterrupted run (dropout 0.1)"


# ---- item 1 and "Also": kills, pre-emption, rank-count change ----------------------------------------------------

def kill_mid_phase1(ctx: Ctx) -> Launch:
    return Launch(rank_command(2, ctx.args()), Trigger(r"^step 3 \|", kill_rank(1)))


def check_kill_mid_phase1(ctx: Ctx, out: Outcome) -> str:
    return f"{_intact(ctx.run, 'phase1-step000002')}; {_resume_exactly(ctx)}"


def kill_at_handoff(ctx: Ctx) -> Launch:
    return Launch(rank_command(2, ctx.args()), Trigger(r"phase 2 starts from", kill_rank(1)))


def check_kill_at_handoff(ctx: Ctx, out: Outcome) -> str:
    assert not any(t.startswith("phase2") for t in _tags(ctx.run)), _tags(ctx.run)
    return f"{_intact(ctx.run, PHASE1_END)}; {_resume_exactly(ctx)}"


def _eval_sets(ctx: Ctx, kill_lands_in_it: bool = False) -> tuple[Path, Path]:
    """Held-out sets for ``--eval-data`` (seq 128, seq 512): small ones, or (``kill_lands_in_it``) the whole corpus
    at seq 128, whose evaluation outlasts the time a kill takes to land."""
    sets = ctx.fixture("eval_shards")
    return (sets["whole128"] if kill_lands_in_it else sets["small128"]), sets["small512"]


def kill_during_eval(ctx: Ctx) -> Launch:
    # Evaluation runs right after a step's console line and before that step's checkpoint (eval and checkpoint
    # intervals are both 2): a kill on "step 4" lands in the evaluation of step 4.
    cmd = rank_command(2, ctx.args("--eval-data", *map(str, _eval_sets(ctx, kill_lands_in_it=True))))
    return Launch(cmd, Trigger(r"^step 4 \|", kill_rank(1)))


def check_kill_during_eval(ctx: Ctx, out: Outcome) -> str:
    # The resume evaluates too (on the small sets: what is checked is that evaluating leaves training exact).
    assert "eval step 4 " not in out.text() and "phase1-step000004" not in out.text(), "the kill missed the eval"
    return f"{_intact(ctx.run, 'phase1-step000002')}; " + _resume_exactly(
        ctx, "--eval-data", *map(str, _eval_sets(ctx)))


def sigterm_every_rank(ctx: Ctx) -> Launch:
    return Launch(rank_command(2, ctx.args()), Trigger(r"^step 3 \|", signal_every_rank(signal.SIGTERM)))


def check_sigterm(ctx: Ctx, out: Outcome) -> str:
    step = int(re.search(r"checkpointed at phase 1 step (\d+)", out.text()).group(1))
    return f"{_intact(ctx.run, f'phase1-step{step:06d}')}; {_resume_exactly(ctx)}"


def resume_on_one_rank(ctx: Ctx) -> Launch:
    ctx.copy_trained_run()
    return Launch(rank_command(1, ctx.args("--resume", "auto")))


def check_resume_on_one_rank(ctx: Ctx, out: Outcome) -> str:
    reference = ctx.fixture("fault_reference_run")
    for tag in (PHASE1_END, FINAL_TAG):
        got, want = ckpt.read_run_state(ctx.run / "checkpoints", tag), ckpt.read_run_state(
            reference / "checkpoints", tag)
        assert (got.consumed_samples, got.loader["consumed_global_batches"]) == \
            (want.consumed_samples, want.loader["consumed_global_batches"])
        diffs = assert_close_params(weights(ctx.run, tag), weights(reference, tag), f"{tag} 2 -> 1 ranks")
    return (f"nothing: same samples consumed; {FINAL_TAG} within {diffs['tensor_rel']:.1e} relative of the 2-rank "
            f"run (bound 1e-5)")


def kill_loader_worker_mid_step(ctx: Ctx) -> Launch:
    return Launch(rank_command(2, ctx.args()), Trigger(r"^step 3 \|", kill_loader_worker(0)))


def kill_loader_worker_at_save(ctx: Ctx) -> Launch:
    # "step 2" is followed by step 2's checkpoint: the worker dies during the save (or, on a slow machine, just after
    # it). Its SIGCHLD handler only records the death; the loop raises at the next step boundary, so the save
    # completes either way and step 2 is the last checkpoint.
    return Launch(rank_command(2, ctx.args()), Trigger(r"^step 2 \|", kill_loader_worker(0)))


def check_worker_killed(ctx: Ctx, out: Outcome) -> str:
    return _intact(ctx.run, "phase1-step000002")


def check_worker_killed_mid_step(ctx: Ctx, out: Outcome) -> str:
    # The kill lands after the harness reads the "step 3" line: on a loaded machine, step 4 and its checkpoint (the
    # recipe saves every 2 steps) may come first (seen once in a full suite run). Either is whole and newest.
    latest = ckpt.read_latest(ctx.run / "checkpoints")
    assert latest in ("phase1-step000002", "phase1-step000004"), (latest, _tags(ctx.run))
    return _intact(ctx.run, latest)


# ---- items 2-4: shard content ----------------------------------------------------------------------------------

def _flip_token_byte(shards: Path, shard: str, offset: int) -> None:
    """The low byte of token 4 of the record at ``offset``: still a valid id, so only the checksum can tell."""
    patch_file(shards / shard, offset + HEADER_SIZE + 2 * 4, b"\x07")


def flipped_byte_preflight(ctx: Ctx) -> Launch:
    shards = ctx.copy_shards()
    member = first_member(shards, ctx.recipe)
    _flip_token_byte(shards, member.shard, member.offset)
    ctx.culprit = f"s128/{member.shard}"
    return Launch(rank_command(2, ctx.args("--verify-shards", "sha256", data=(shards, ctx.s512))))


def flipped_byte_first_open(ctx: Ctx) -> Launch:
    shards = ctx.copy_shards()
    member = first_member(shards, ctx.recipe)
    _flip_token_byte(shards, member.shard, member.offset)
    ctx.culprit = f"s128/{member.shard}"
    return Launch(rank_command(2, ctx.args(data=(shards, ctx.s512))))  # default --verify-shards size


def flipped_byte_verify_cli(ctx: Ctx) -> Launch:
    shards = ctx.copy_shards()
    _flip_token_byte(shards, "shard-000001.tar", first_member(shards, ctx.recipe).offset)
    ctx.culprit = "s128/shard-000001.tar"  # the CLI names a shard by its set's directory name
    return Launch(tool_cmd("verify_shards.py", [str(shards), "--level", "sha256"]))


def token_id_over_vocab(ctx: Ctx) -> Launch:
    shards = ctx.copy_shards()
    member = first_member(shards, ctx.recipe)
    patch_file(shards / member.shard, member.offset + HEADER_SIZE + 2 * 5, (VOCAB_SIZE + 7).to_bytes(2, "little"))
    rehash(shards, member.shard)  # the checksum passes: only the id check can catch it
    ctx.culprit = f"s128/{member.shard}:{member.name}"
    return Launch(rank_command(2, ctx.args(data=(shards, ctx.s512))))


def _bad_length(ctx: Ctx, *, rehashed: bool) -> Path:
    shards = ctx.copy_shards()
    member = first_member(shards, ctx.recipe)
    patch_file(shards / member.shard, member.offset, (128 + 3).to_bytes(2, "little"))  # field 'length'
    if rehashed:
        rehash(shards, member.shard)
    ctx.culprit = f"s128/{member.shard}:{member.name}"
    return shards


def bad_length_headers_preflight(ctx: Ctx) -> Launch:
    shards = _bad_length(ctx, rehashed=False)
    return Launch(rank_command(2, ctx.args("--verify-shards", "headers", data=(shards, ctx.s512))))


def bad_length_first_open(ctx: Ctx) -> Launch:
    shards = _bad_length(ctx, rehashed=True)
    return Launch(rank_command(2, ctx.args(data=(shards, ctx.s512))))


def _wrong_count(ctx: Ctx) -> Path:
    shards = ctx.copy_shards()
    shard = first_member(shards, ctx.recipe).shard
    index = json.loads((shards / "index.json").read_text())
    entry = next(e for e in index["shards"] if e["name"] == shard)
    entry["samples"] += 1
    index["total_samples"] += 1
    (shards / "index.json").write_text(json.dumps(index, indent=1))
    ctx.culprit = f"s128/{shard}"
    return shards


def wrong_count_headers_preflight(ctx: Ctx) -> Launch:
    return Launch(rank_command(2, ctx.args("--verify-shards", "headers", data=(_wrong_count(ctx), ctx.s512))))


def wrong_count_first_open(ctx: Ctx) -> Launch:
    return Launch(rank_command(2, ctx.args(data=(_wrong_count(ctx), ctx.s512))))


def check_refused_before_step(ctx: Ctx, out: Outcome) -> str:
    assert not re.search(r"^step \d+ \|", out.text(), re.M)
    return _nothing_written(ctx.run)


def check_stopped_at_first_batch(ctx: Ctx, out: Outcome) -> str:
    assert not re.search(r"^step \d+ \|", out.text(), re.M)
    return _no_checkpoint(ctx.run)


def check_cli_only_reads(ctx: Ctx, out: Outcome) -> str:
    assert sorted(p.name for p in (ctx.tmp / "s128").iterdir()) == sorted(p.name for p in ctx.s128.iterdir())
    return "nothing: read-only check"


# ---- item 5 and 9: data prep on a huge line and on bad input -------------------------------------------------------

HUGE_LINE_BYTES = 50 * 2**20 + 17
RLIMIT_AS_BYTES = 3 * 2**30


def _huge_line_corpus(ctx: Ctx) -> Path:
    """A BERT-layout file: the real corpus, then one 50 MB single-line document, then the corpus again."""
    corpus = ctx.fixture("english_corpus").read_text(encoding="utf-8")
    path = ctx.tmp / "huge_line.txt"
    with open(path, "w", encoding="utf-8") as f:
        f.write(corpus.rstrip("\n") + "\n\n")
        word = "antidisestablishmentarianism "
        f.write(word * (HUGE_LINE_BYTES // len(word)) + "\n\n")
        f.write(corpus)
    return path


def huge_line_create_shards(ctx: Ctx) -> Launch:
    corpus = _huge_line_corpus(ctx)
    return Launch(tool_cmd("create_shards.py", ["--input", str(corpus), "--tokenizer", str(ctx.tokenizer),
                                                "--seq-len", "128", "--out", str(ctx.tmp / "out"),
                                                "--samples-per-shard", "1000"]),
                  preexec=limit_memory(RLIMIT_AS_BYTES))


def check_huge_line_shards(ctx: Ctx, out: Outcome) -> str:
    report = verify_shard_set(ctx.tmp / "out", "sha256")
    assert report.ok and report.samples > 1000, report.errors
    return f"nothing: {report.samples} samples from the corpus text, sha256-clean, under a 3 GiB address-space limit"


def huge_line_train_tokenizer(ctx: Ctx) -> Launch:
    corpus = _huge_line_corpus(ctx)
    return Launch(tool_cmd("train_tokenizer.py", ["--input", str(corpus), "--vocab-size", "4000",
                                                  "--out", str(ctx.tmp / "out")]),
                  preexec=limit_memory(RLIMIT_AS_BYTES))


def check_huge_line_tokenizer(ctx: Ctx, out: Outcome) -> str:
    vocab = (ctx.tmp / "out" / "vocab.txt").read_text(encoding="utf-8").split()
    assert len(vocab) > 1000 and "antidisestablishmentarianism" not in vocab
    return f"nothing: {len(vocab)}-token vocabulary from the corpus text, under a 3 GiB address-space limit"


def tokenizer_bad_input(ctx: Ctx) -> Launch:
    empty = ctx.tmp / "empty.txt"
    empty.write_text("\n\n   \n")
    ctx.culprit = str(empty)
    return Launch(tool_cmd("train_tokenizer.py", ["--input", str(empty), "--out", str(ctx.tmp / "out")]))


def check_tokenizer_bad_input(ctx: Ctx, out: Outcome) -> str:
    assert "Traceback" not in out.text()
    assert not (ctx.tmp / "out").exists(), sorted(p.name for p in (ctx.tmp / "out").rglob("*"))
    return "nothing: --out not created, no traceback"


# ---- item 6: planted pickles -------------------------------------------------------------------------------------

class _Payload:
    """Unpickling this runs ``touch MARKER``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(ctx: Ctx, file_name: str) -> None:
    target = ctx.copy_trained_run() / "checkpoints" / "phase1-step000002" / file_name
    state = torch.load(target, weights_only=False)  # our own, trusted file
    state["extra"] = _Payload(ctx.tmp / "PWNED")
    torch.save(state, target)
    rerecord_checksum(target)  # past the checksums, to the unpickling defence
    ctx.culprit = str(target)


def pickle_resume(ctx: Ctx) -> Launch:
    _plant(ctx, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    return Launch(rank_command(2, ctx.args("--resume", "auto")))


def pickle_evaluate(ctx: Ctx) -> Launch:
    _plant(ctx, "mp_rank_00_model_states.pt")
    return Launch(tool_cmd("evaluate.py", ["--checkpoint", str(ctx.run / "checkpoints"), "--data", str(ctx.s128),
                                           "--max-batches", "1"]))


def pickle_convert(ctx: Ctx) -> Launch:
    _plant(ctx, "mp_rank_00_model_states.pt")
    return Launch(tool_cmd("convert_checkpoint.py", ["--checkpoint", str(ctx.run / "checkpoints"),
                                                     "--out", str(ctx.tmp / "hf")]))


def check_pickle(ctx: Ctx, out: Outcome) -> str:
    assert not (ctx.tmp / "PWNED").exists(), "the planted payload ran"
    assert not (ctx.tmp / "hf").exists() and _tags(ctx.run) == ["phase1-step000002"]
    return "nothing: payload never ran, no tag or HF dir written, latest unchanged"


# ---- items 7, 8, 9, 10, 11 ---------------------------------------------------------------------------------------

def _drain(proc: subprocess.Popen, lines: list[str], seen: threading.Event) -> None:
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 1 |"):
            seen.set()
    seen.set()


def second_run_same_output(ctx: Ctx) -> Launch:
    """The first run (2 ranks) is stopped (SIGSTOP) after its first step, holding the lock, while the second starts;
    the check lets it continue and finish."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(rank_command(2, ctx.args()), cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    lines: list[str] = []
    seen = threading.Event()
    threading.Thread(target=_drain, args=(first, lines, seen), daemon=True).start()
    assert seen.wait(HANG_GUARD_S) and first.poll() is None, "".join(lines)[-3000:]
    tree = [psutil.Process(first.pid), *psutil.Process(first.pid).children(recursive=True)]
    for proc in tree:
        proc.suspend()
    ctx.state.update(first=first, tree=tree, lines=lines)
    ctx.culprit = str(ctx.run)
    return Launch(rank_command(1, ctx.args("--resume", "auto")))


def check_second_run(ctx: Ctx, out: Outcome) -> str:
    for proc in ctx.state["tree"]:
        if proc.is_running():
            proc.resume()
    first = ctx.state["first"]
    assert first.wait(HANG_GUARD_S) == 0, "".join(ctx.state["lines"])[-4000:]
    _identical(ctx.run, ctx.fixture("fault_reference_run"))
    return "nothing: the first run finished bit-identical to an undisturbed run"


def disk_full(ctx: Ctx) -> Launch:
    ctx.copy_trained_run()
    ctx.culprit = str(ctx.run / "checkpoints")
    # every rank may write 1 MiB per file; a model-states file of this run is ~4 MB
    return Launch(rank_command(2, ctx.args("--resume", "auto")), preexec=limit_file_size(2**20))


def check_disk_full(ctx: Ctx, out: Outcome) -> str:
    assert _tags(ctx.run) == ["phase1-step000002"], _tags(ctx.run)
    return _intact(ctx.run, "phase1-step000002") + "; the partial phase1-step000004.tmp removed"


def debris_of_killed_prune(ctx: Ctx) -> Launch:
    ckpt_dir = ctx.copy_trained_run() / "checkpoints"
    half = ckpt_dir / ".phase1-step000001.deleting"  # a prune killed mid-rmtree
    half.mkdir()
    shutil.copyfile(ckpt_dir / "phase1-step000002" / "run_state.json", half / "run_state.json")
    (ckpt_dir / "phase1-step000003.tmp").mkdir()  # a save killed mid-write
    (ckpt_dir / "phase1-step000003.tmp" / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 4096)
    ctx.culprit = ".phase1-step000001.deleting"
    return Launch(rank_command(2, ctx.args("--resume", "auto", "--max-steps", "4")))


def check_debris(ctx: Ctx, out: Outcome) -> str:
    assert _tags(ctx.run) == ["phase1-step000002", "phase1-step000004"], _tags(ctx.run)
    return _intact(ctx.run, "phase1-step000004") + "; debris gone"


def stale_extension_lock(ctx: Ctx) -> Launch:
    """The build directory holds the finished extension and torch's lock left by a build killed two hours ago (a
    copy of this machine's build directory, so the start need not compile for minutes)."""
    from bert_ds.runtime.caches import HOLDER_LOCK_NAME, extensions_root

    ext = ctx.tmp / "torch_extensions"
    shutil.copytree(extensions_root(), ext, symlinks=True, ignore=shutil.ignore_patterns(HOLDER_LOCK_NAME, "lock"))
    lock = ext / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    old = time.time() - 7200
    os.utime(lock, (old, old))
    ctx.culprit = str(lock)
    return Launch(rank_command(2, ctx.args("--max-steps", "2")), env={"TORCH_EXTENSIONS_DIR": str(ext)})


def check_stale_extension_lock(ctx: Ctx, out: Outcome) -> str:
    assert not Path(ctx.culprit).exists()
    assert _tags(ctx.run) == ["phase1-step000002"], _tags(ctx.run)
    return "nothing: the killed build's lock removed by the first rank holding the build lock, the run trained"


def keep_last_one(ctx: Ctx) -> Launch:
    fault_recipe(ctx.tmp / "recipe.json", **{"logging.keep_last_k": 1})
    return Launch(rank_command(2, ctx.args()))


def check_keep_last_one(ctx: Ctx, out: Outcome) -> str:
    assert _tags(ctx.run) == [PHASE1_END, FINAL_TAG], _tags(ctx.run)
    assert ckpt.read_run_state(ctx.run / "checkpoints", PHASE1_END).phase_done is True
    return _intact(ctx.run, FINAL_TAG) + f"; {PHASE1_END} (phase end) kept and loads with keep_last_k=1"


# ---- bad input -----------------------------------------------------------------------------------------------------

def recipe_typo(ctx: Ctx) -> Launch:
    recipe = fault_recipe(ctx.tmp / "typo.json", **{"optimizer.weight_decya": 0.01})
    ctx.culprit = str(recipe)
    return Launch(rank_command(1, ctx.args(recipe=recipe)))


def seq_len_order(ctx: Ctx) -> Launch:
    ctx.culprit = str(ctx.s512)
    return Launch(rank_command(1, ctx.args(data=(ctx.s512, ctx.s128))))


def vocab_mismatch(ctx: Ctx) -> Launch:
    other = ctx.tmp / "tokenizer"
    shutil.copytree(ctx.tokenizer, other)
    with open(other / "vocab.txt", "a", encoding="utf-8") as f:
        f.write("zzzextratoken\n")
    args = ctx.args()
    args[args.index("--tokenizer") + 1] = str(other)
    return Launch(rank_command(1, args))


def missing_shard(ctx: Ctx) -> Launch:
    shards = ctx.copy_shards()
    (shards / "shard-000003.tar").unlink()
    return Launch(rank_command(1, ctx.args(data=(shards, ctx.s512))))


def truncated_shard(ctx: Ctx) -> Launch:
    shards = ctx.copy_shards()
    path = shards / "shard-000002.tar"
    os.truncate(path, path.stat().st_size - 10240)
    return Launch(rank_command(1, ctx.args(data=(shards, ctx.s512))))


def missing_tokenizer(ctx: Ctx) -> Launch:
    args = ctx.args()
    ctx.culprit = str(ctx.tmp / "no_tokenizer")
    args[args.index("--tokenizer") + 1] = ctx.culprit
    return Launch(rank_command(1, args))


def phase2_without_checkpoint(ctx: Ctx) -> Launch:
    return Launch(rank_command(1, ctx.args("--phase", "2", data=(ctx.s512,))))


def resume_changed_recipe(ctx: Ctx) -> Launch:
    ctx.copy_trained_run()
    # Not the lr: a changed lr resumes (with a warning), the non-finite guard's advice.
    recipe = fault_recipe(ctx.tmp / "changed.json", **{"phases.0.warmup_fraction": 0.5})
    return Launch(rank_command(1, ctx.args("--resume", "auto", recipe=recipe)))


def check_run_unchanged(ctx: Ctx, out: Outcome) -> str:
    assert _tags(ctx.run) == ["phase1-step000002"]
    return _intact(ctx.run, "phase1-step000002") + ", untouched"


def batch_not_divisible(ctx: Ctx) -> Launch:
    recipe = fault_recipe(ctx.tmp / "batch.json", **{"phases.0.global_batch_size": 4})  # micro 4 x 2 ranks > 4
    return Launch(rank_command(2, ctx.args(recipe=recipe)))


def huge_lr(ctx: Ctx) -> Launch:
    # lr 1e3 with the recipe's warm-up: the first steps are finite, then the weights overflow. (1e20 without warm-up
    # gives NaN logits from step 1: no checkpoint may be written at all, "last good checkpoint: none".)
    fault_recipe(ctx.tmp / "recipe.json", **{"phases.0.lr": 1e3, "phases.0.checkpoint_interval": 1})
    return Launch(rank_command(2, ctx.args()))


def check_huge_lr(ctx: Ctx, out: Outcome) -> str:
    tag = re.search(r"last good checkpoint: (phase1-step\d{6})", out.text()).group(1)
    return _intact(ctx.run, tag) + " (the last good checkpoint)"


# ---- the table -----------------------------------------------------------------------------------------------------



E2E = (pytest.mark.e2e,)
"""A row whose setup needs the trained checkpoint (a 2-rank launch) runs in the whole suite, whatever its level."""

CASES = [
    Case("kill9-rank1-mid-phase1", "1", "kill -9 of rank 1 at phase 1 step 3, then --resume auto", kill_mid_phase1,
         KILLED, r"--local_rank=1.*exits with return code = -9", check_kill_mid_phase1, LAUNCHER_EXIT),
    Case("kill9-rank1-phase-handoff", "1, also", "kill -9 of rank 1 while phase 2 loads phase 1's end",
         kill_at_handoff, KILLED, r"--local_rank=1.*exits with return code = -9", check_kill_at_handoff,
         LAUNCHER_EXIT),
    Case("kill9-rank1-during-eval", "1, also", "kill -9 of rank 1 during the evaluation at step 4", kill_during_eval,
         KILLED, r"--local_rank=1.*exits with return code = -9", check_kill_during_eval, LAUNCHER_EXIT),
    Case("sigterm-every-rank", "1", "SIGTERM to every rank at step 3 (a pre-emption), then --resume auto",
         sigterm_every_rank, 75, r"^pre-empted: checkpointed at phase 1 step \d+; exit 75", check_sigterm,
         r"^pre-empted:"),
    Case("resume-2-to-1-ranks", "also", "a 2-rank checkpoint resumed on 1 rank, dropout on", resume_on_one_rank, 0,
         r"resumed phase1-step000002: phase 1 step 2, 32 samples consumed \(saved on 2 ranks, now 1\)",
         check_resume_on_one_rank, r"resumed phase1-step"),
    Case("loader-worker-killed", "also", "kill -9 of rank 0's loader worker mid step", kill_loader_worker_mid_step,
         1, r"a DataLoader worker died: worker 0 \(pid \d+\) was reading \S+/shard-\d{6}\.tar member #\d+",
         check_worker_killed_mid_step),
    Case("loader-worker-killed-during-save", "also", "kill -9 of rank 0's loader worker as step 2 checkpoints",
         kill_loader_worker_at_save, 1,
         r"^bert_ds\.runtime\.pretrain: error: a DataLoader worker died: worker 0 \(pid \d+\) was reading "
         r"\S+/shard-", check_worker_killed),
    Case("flipped-byte-preflight", "2", "one flipped byte in a token id, --verify-shards sha256",
         flipped_byte_preflight, 2, r"{culprit}: sha256 mismatch \(index\.json says", check_refused_before_step,
         level=IN_PROCESS),
    Case("flipped-byte-first-open", "2", "one flipped byte in a token id, default --verify-shards size",
         flipped_byte_first_open, 2, r"{culprit}: sha256 mismatch \(index\.json says", check_stopped_at_first_batch),
    Case("flipped-byte-verify-cli", "2", "one flipped byte in a token id, tools/verify_shards.py --level sha256",
         flipped_byte_verify_cli, 2, r"{culprit}: sha256 mismatch", check_cli_only_reads, r"sha256 mismatch",
         level=IN_PROCESS),
    Case("token-id-over-vocab", "3", "token id 4007 >= vocab 4000, index.json re-hashed", token_id_over_vocab, 2,
         r"{culprit}: field 'input_ids' holds token id 4007 \(slot \d+\), not below index\.json vocab_size=4000",
         check_stopped_at_first_batch),
    Case("bad-length-headers-preflight", "4", "a record's length field off by 3, --verify-shards headers",
         bad_length_headers_preflight, 2, r"{culprit}: field 'length' or 'num_predictions' disagrees with the record",
         check_refused_before_step, level=IN_PROCESS),
    Case("bad-length-first-open", "4", "a record's length field off by 3 (re-hashed), default size level",
         bad_length_first_open, 2, r"{culprit}: field 'length' or 'num_predictions' disagrees with the record",
         check_stopped_at_first_batch),
    Case("wrong-count-headers-preflight", "4", "index.json per-shard count +1, --verify-shards headers",
         wrong_count_headers_preflight, 2, r"{culprit}: sample count mismatch \(index\.json says \d+, file has \d+\)",
         check_refused_before_step, level=IN_PROCESS),
    Case("wrong-count-first-open", "4", "index.json per-shard count +1, default size level",
         wrong_count_first_open, 2, r"{culprit}: sample count mismatch \(index\.json says \d+, file has \d+\)",
         check_stopped_at_first_batch),
    Case("huge-line-create-shards", "5", "a 50 MB single-line document, create_shards under RLIMIT_AS 3 GiB",
         huge_line_create_shards, 0, r"skipped 1 line\(s\) over --max-document-bytes", check_huge_line_shards,
         r"^wrote \d+ shards"),
    Case("huge-line-train-tokenizer", "5", "a 50 MB single-line document, train_tokenizer under RLIMIT_AS 3 GiB",
         huge_line_train_tokenizer, 0, r"skipped 1 line\(s\) over --max-document-bytes", check_huge_line_tokenizer,
         r"^wrote .*vocab\.txt"),
    Case("pickle-resume", "6", "a pickle planted in rank 1's ZeRO optimizer file, --resume auto", pickle_resume, 2,
         r"{culprit}: refused to load.*posix\.system", check_pickle),
    Case("pickle-evaluate", "6", "a pickle planted in the model states, tools/evaluate.py", pickle_evaluate, 2,
         r"{culprit}: refused to load.*posix\.system", check_pickle, level=IN_PROCESS, marks=E2E),
    Case("pickle-convert", "6", "a pickle planted in the model states, tools/convert_checkpoint.py", pickle_convert,
         2, r"{culprit}: refused to load.*posix\.system", check_pickle, level=IN_PROCESS, marks=E2E),
    Case("second-run-same-output", "7", "a second run on the --output a live run holds", second_run_same_output, 2,
         r"{culprit} is in use by another bert_ds run \(pid \d+ on host", check_second_run),
    Case("disk-full", "8", "1 MiB file-size limit on every rank (EFBIG) at the step-4 save", disk_full, 74,
         r"cannot save checkpoint phase1-step000004 in {culprit} \(.*MiB free there, a checkpoint of this run needs",
         check_disk_full),
    Case("half-deleted-tag", "9", "a prune and a save killed midway left .<tag>.deleting and <tag>.tmp",
         debris_of_killed_prune, 0, r"removed the debris of interrupted saves/prunes: .*{culprit}", check_debris,
         r"removed the debris"),
    Case("train-tokenizer-bad-input", "9", "train_tokenizer on a file with no text", tokenizer_bad_input, 2,
         r"^bert-ds-train-tokenizer: error: no text to train a tokenizer on in {culprit}", check_tokenizer_bad_input,
         level=IN_PROCESS),
    Case("stale-extension-lock", "10", "torch's deepspeed_shm_comm build lock left by a build killed 2 hours ago",
         stale_extension_lock, 0, r"removing {culprit}: left by an extension build that was killed",
         check_stale_extension_lock, r"removing .*: left by an extension build that was killed"),
    Case("phase-end-kept", "11", "keep_last_k 1 through phase 2", keep_last_one, 0,
         rf"^checkpoint .*{FINAL_TAG}$", check_keep_last_one, rf"^checkpoint .*{FINAL_TAG}"),
    Case("recipe-typo", "input", "recipe key optimizer.weight_decya", recipe_typo, 2,
         r"optimizer\.weight_decya", lambda ctx, out: _nothing_written(ctx.run)),
    Case("seq-len-order", "input", "--data given as seq 512 then 128", seq_len_order, 2,
         r"--data {culprit} \(phases\[0\]\)/index\.json: field 'seq_len' is 512 but the run expects 128",
         lambda ctx, out: _nothing_written(ctx.run), level=IN_PROCESS),
    Case("vocab-mismatch", "input", "a tokenizer with one more token than the shards'", vocab_mismatch, 2,
         r"field 'vocab_(sha256|size)'", lambda ctx, out: _nothing_written(ctx.run), level=IN_PROCESS),
    Case("missing-shard", "input", "shard-000003.tar deleted", missing_shard, 2,
         r"s128/shard-000003\.tar: missing", lambda ctx, out: _nothing_written(ctx.run), level=IN_PROCESS),
    Case("truncated-shard", "input", "shard-000002.tar cut by 10 KiB", truncated_shard, 2,
         r"s128/shard-000002\.tar: byte size mismatch", lambda ctx, out: _nothing_written(ctx.run), level=IN_PROCESS),
    Case("missing-tokenizer", "input", "--tokenizer names no directory", missing_tokenizer, 2,
         r"{culprit}", lambda ctx, out: _nothing_written(ctx.run), level=IN_PROCESS),
    Case("phase2-without-checkpoint", "input", "--phase 2 on an empty --output", phase2_without_checkpoint, 2,
         r"--phase 2 starts from phase 1's final checkpoint", lambda ctx, out: _nothing_written(ctx.run),
         level=IN_PROCESS),
    Case("resume-changed-recipe", "input", "--resume auto with phases[0].warmup_fraction changed",
         resume_changed_recipe, 2, r"different recipe; field\(s\) \['phases\[0\]\.warmup_fraction'\] differ",
         check_run_unchanged, level=IN_PROCESS, marks=E2E),
    Case("batch-not-divisible", "input", "global batch 4 with micro batch 4 on 2 ranks", batch_not_divisible, 2,
         r"phases\[0\]\.global_batch_size=4 is not divisible by phases\[0\]\.micro_batch_size=4 x world size 2",
         lambda ctx, out: _nothing_written(ctx.run), level=IN_PROCESS),
    Case("nonfinite-loss", "input", "phase 1 lr 1e3, a checkpoint every step", huge_lr, 3,
         r"non-finite .* for 3 consecutive steps .*last good checkpoint: phase1-step\d{6}", check_huge_lr),
]


# ---- fixtures and the one test ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eval_shards(english_corpus, tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    """Held-out-style eval sets (another seed): the whole corpus at seq 128 (~1.7k samples), and the corpus's last
    documents at seq 128 and 512 (~60k characters: a hundred-odd samples each)."""
    from bert_ds.data.create import create_shards
    from tests.helpers.eval_shards import write_corpus_tail

    root = tmp_path_factory.mktemp("fault_eval")
    tail = write_corpus_tail(english_corpus, root / "tail.txt", 60_000)
    sets = {"whole128": (english_corpus, 128), "small128": (tail, 128), "small512": (tail, 512)}
    for name, (text, seq) in sets.items():
        create_shards([text], tokenizer_dir, root / name, seq_len=seq, dupe_factor=1, seed=99,
                      samples_per_shard=10_000, progress=False)
    return {name: root / name for name in sets}


def test_table_has_every_item():
    items = {part.strip() for case in CASES for part in case.item.split(",")}
    assert {str(i) for i in range(1, 12)} <= items and len(CASES) >= 25
    assert len({case.id for case in CASES}) == len(CASES)


@pytest.mark.e2e
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES
                                  if c.level == LAUNCHED])
def test_fault(case: Case, request, tmp_path, shards_128, shards_512, tokenizer_dir):
    ctx = Ctx(tmp=tmp_path, request=request, s128=shards_128, s512=shards_512, tokenizer=tokenizer_dir)
    run_row(case, ctx, tracebacks=True)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES
                                  if c.level == IN_PROCESS])
def test_fault_in_process(case: Case, request, tmp_path, shards_128, shards_512, tokenizer_dir):
    """The refusals pre-flight decides, checked as each rank would decide them, without ranks (the default tier);
    the launched rows above prove the exit code and the line reach the user through real ranks."""
    test_fault(case, request, tmp_path, shards_128, shards_512, tokenizer_dir)
