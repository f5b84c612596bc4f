"""Fault-table rows of issue 16 items 1, 2, 3 and 7 (the converter racing a prune) and issue 21 items 1, 2 and 5: a
refused resume leaves the run directory byte for byte as it was, tokenizer / shards / checkpoint / export agree on
vocabulary *and* casing, damaged checkpoints are named (and resume falls back to the newest intact tag), an edited
``run_state.json`` is damage like any other, a damaged tag is set aside instead of outliving an intact one in
retention, and a reader holds its tag against pruning.

Same harness and recipe as ``tests/faults/test_fault_table.py`` (``tests.helpers.faults``): real DeepSpeed CPU ranks,
the shipped ``ds_configs/tiny_cpu.json`` (dropout 0.1, ZeRO-2, LAMB) cut to 6 + 2 steps, the session's English corpus;
``BERT_DS_FAULT_REPORT=table.md`` appends each row.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bert_ds import checkpoint as ckpt
from tests.helpers.faults import (
    FINAL_TAG,
    IN_PROCESS,
    LAUNCHED,
    PHASE1_END,
    FaultContext,
    Launch,
    Outcome,
    execute,
    fault_recipe,
    run_row,
    tool_cmd,
    train_fault_run,
    tree_bytes,
)
from tests.helpers.faults import FaultCase as Case
from tests.helpers.ranks import rank_command
from tests.helpers.runs import weights

WARNING_LINE = r"RESUMING FROM AN OLDER CHECKPOINT"


@dataclass
class Ctx(FaultContext):
    snapshot: dict | None = None
    """Every file of the run directory (path -> sha256) as it was before the command."""
    held: contextlib.ExitStack | None = None

    def args(self, *extra: str, data: tuple[Path, ...] | None = None, tokenizer: Path | None = None) -> list[str]:
        data = data or (self.s128, self.s512)
        return ["--recipe", str(self.recipe), "--data", *map(str, data), "--tokenizer", str(tokenizer or
                self.tokenizer), "--output", str(self.run), *extra]

    def copy_run(self, fixture: str = "trained_run") -> Path:
        shutil.copytree(self.request.getfixturevalue(fixture), self.run)
        self.snapshot = tree_bytes(self.run)
        return self.run

    def convert(self, tag: str | None = None) -> Launch:
        return Launch(tool_cmd("convert_checkpoint.py", ["--checkpoint", str(self.run / "checkpoints"), "--out",
                                                         str(self.tmp / "hf"), *(["--tag", tag] if tag else [])]))


def _unchanged(ctx: Ctx, out: Outcome) -> str:
    after = tree_bytes(ctx.run)
    assert after == ctx.snapshot, {k: (ctx.snapshot.get(k), after.get(k)) for k in set(after) | set(ctx.snapshot)
                                   if ctx.snapshot.get(k) != after.get(k)}
    return f"nothing: all {len(after)} files of the run directory byte-identical, no file added or removed"


def _nothing_written(ctx: Ctx, out: Outcome) -> str:
    assert not ctx.run.exists(), sorted(p.name for p in ctx.run.rglob("*"))
    return "nothing: refused before compute, --output not created"


def _no_export(ctx: Ctx, out: Outcome) -> str:
    assert not (ctx.tmp / "hf").exists() and not list(ctx.tmp.glob(".hf.tmp-*"))
    return _unchanged(ctx, out) + "; no HF directory written"


# ---- other tokenizers ---------------------------------------------------------------------------------------------

def _swapped_vocab_tokenizer(ctx: Ctx, meta: dict | None = None) -> Path:
    """The session tokenizer with two ordinary tokens swapped: same size, another vocabulary (other ids)."""
    out = ctx.tmp / "tokenizer2"
    shutil.copytree(ctx.tokenizer, out)
    lines = (out / "vocab.txt").read_text().splitlines()
    lines[200], lines[201] = lines[201], lines[200]
    (out / "vocab.txt").write_text("\n".join(lines) + "\n")
    if meta is not None:
        (out / "tokenizer_meta.json").write_text(json.dumps(meta) + "\n")
    return out


def _relabelled_shards(ctx: Ctx, which: str, **fields) -> Path:
    """A copy of a shard set whose index.json claims ``fields`` (e.g. made with another tokenizer): the index is what
    pre-flight and the loader compare."""
    dst = ctx.tmp / f"{which}-relabelled"
    shutil.copytree(getattr(ctx, which), dst)
    index = json.loads((dst / "index.json").read_text())
    index.update(fields)
    (dst / "index.json").write_text(json.dumps(index, indent=1))
    return dst


def resume_other_tokenizer(ctx: Ctx) -> Launch:
    ctx.copy_run()
    from bert_ds.data.tokenizer import vocab_sha256

    tok = _swapped_vocab_tokenizer(ctx)
    sha = vocab_sha256(tok / "vocab.txt")
    data = (_relabelled_shards(ctx, "s128", vocab_sha256=sha), _relabelled_shards(ctx, "s512", vocab_sha256=sha))
    return Launch(rank_command(2, ctx.args("--resume", "auto", data=data, tokenizer=tok)))


def check_resume_other_tokenizer(ctx: Ctx, out: Outcome) -> str:
    lost = _unchanged(ctx, out)
    export = execute(ctx.convert())
    assert export.returncode == 0, export.text()[-3000:]
    hf_vocab = (ctx.tmp / "hf" / "vocab.txt").read_bytes()
    assert hf_vocab == (ctx.tokenizer / "vocab.txt").read_bytes(), "the export carries another vocabulary"
    return lost + "; the run then exports (exit 0) with its own vocabulary"


def resume_cased_tokenizer(ctx: Ctx) -> Launch:
    ctx.copy_run()
    tok = ctx.tmp / "cased"
    shutil.copytree(ctx.tokenizer, tok)
    (tok / "tokenizer_meta.json").write_text('{"lowercase": false}\n')
    data = (_relabelled_shards(ctx, "s128", lowercase=False), _relabelled_shards(ctx, "s512", lowercase=False))
    return Launch(rank_command(2, ctx.args("--resume", "auto", data=data, tokenizer=tok)))


def fresh_cased_tokenizer_uncased_shards(ctx: Ctx) -> Launch:
    tok = ctx.tmp / "cased"
    shutil.copytree(ctx.tokenizer, tok)
    (tok / "tokenizer_meta.json").write_text('{"lowercase": false}\n')
    ctx.culprit = str(ctx.s128 / "index.json")
    return Launch(rank_command(2, ctx.args(tokenizer=tok)))


def resume_other_shard_set(ctx: Ctx) -> Launch:
    """Same tokenizer, another phase-1 shard set (another seed): the loader state would not continue the stream."""
    ctx.copy_run()
    other = ctx.request.getfixturevalue("other_shards_128")
    return Launch(rank_command(2, ctx.args("--resume", "auto", data=(other, ctx.s512))))


def resume_none_over_checkpoint(ctx: Ctx) -> Launch:
    ctx.copy_run()
    return Launch(rank_command(2, ctx.args()))


def convert_rewritten_tokenizer(ctx: Ctx) -> Launch:
    ctx.copy_run()
    swapped = _swapped_vocab_tokenizer(ctx)
    shutil.copyfile(swapped / "vocab.txt", ctx.run / "checkpoints" / "tokenizer" / "vocab.txt")
    ctx.snapshot = tree_bytes(ctx.run)
    return ctx.convert()


def convert_recased_tokenizer(ctx: Ctx) -> Launch:
    ctx.copy_run()
    (ctx.run / "checkpoints" / "tokenizer" / "tokenizer_meta.json").write_text('{"lowercase": false}\n')
    ctx.snapshot = tree_bytes(ctx.run)
    return ctx.convert()


# ---- damaged checkpoints ------------------------------------------------------------------------------------------

def flip_master_weight_byte(zero_file: Path) -> None:
    """Flip one byte inside the fp32 master weights (``single_partition_of_fp32_groups``) of a ZeRO optimizer file,
    found by their bytes in the file (torch stores each tensor's storage uncompressed)."""
    state = torch.load(zero_file, weights_only=False)  # our own, trusted file
    master = state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    raw = master.detach().contiguous().numpy().tobytes()
    data = bytearray(zero_file.read_bytes())
    at = data.find(raw[:256])
    assert at >= 0 and data.count(raw[:256]) == 1, "master weights not found once in the file"
    data[at + len(raw) // 2] ^= 0x40  # an exponent bit of some weight: a large, silent change
    zero_file.write_bytes(bytes(data))


def _tag_file(ctx: Ctx, tag: str, name: str) -> Path:
    return ctx.run / "checkpoints" / tag / name


def flipped_master_resume(ctx: Ctx) -> Launch:
    ctx.copy_run("trained_run_4")
    target = _tag_file(ctx, "phase1-step000004", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    flip_master_weight_byte(target)
    ctx.culprit = str(target)
    return Launch(rank_command(2, ctx.args("--resume", "auto")))


def check_flipped_master_resume(ctx: Ctx, out: Outcome) -> str:
    assert re.search(r"resuming from phase1-step000002", out.text()), out.text()[-3000:]
    for tag in (PHASE1_END, FINAL_TAG):
        got, want = weights(ctx.run, tag), weights(ctx.request.getfixturevalue("fault_reference_run"), tag)
        differ = [name for name in want if not torch.equal(got[name], want[name])]
        assert not differ, f"{tag}: {len(differ)} tensors differ from the uninterrupted run"
    assert ckpt.read_latest(ctx.run / "checkpoints") == FINAL_TAG
    return (f"steps 3-4 trained again from phase1-step000002 (the damaged phase1-step000004 replaced); {PHASE1_END} "
            f"and {FINAL_TAG} bit-identical to the uninterrupted run (dropout 0.1)")


def flipped_master_convert(ctx: Ctx) -> Launch:
    ctx.copy_run()
    target = _tag_file(ctx, "phase1-step000002", "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    flip_master_weight_byte(target)
    ctx.culprit = str(target)
    ctx.snapshot = tree_bytes(ctx.run)
    return ctx.convert()


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def truncated_model_states_resume(ctx: Ctx) -> Launch:
    ctx.copy_run()
    target = _tag_file(ctx, "phase1-step000002", "mp_rank_00_model_states.pt")
    _truncate(target)
    ctx.culprit = str(target)
    ctx.snapshot = tree_bytes(ctx.run)
    return Launch(rank_command(2, ctx.args("--resume", "auto")))


def truncated_model_states_evaluate(ctx: Ctx) -> Launch:
    ctx.copy_run()
    target = _tag_file(ctx, "phase1-step000002", "mp_rank_00_model_states.pt")
    _truncate(target)
    ctx.culprit = str(target)
    ctx.snapshot = tree_bytes(ctx.run)
    return Launch(tool_cmd("evaluate.py", ["--checkpoint", str(ctx.run / "checkpoints"), "--data", str(ctx.s128),
                                           "--max-batches", "1"]))


# ---- issue 21 items 1-2: run_state.json is verified; damaged tags are set aside ---------------------------------

def _edit_consumed(tag_dir: Path, reseal: bool) -> Path:
    """Change ``loader.consumed_global_batches`` in the tag's run_state.json by editing its bytes (one digit), the
    rest of the file untouched; ``reseal``: also write the digest of the edited content (a forger who knows the
    format)."""
    from bert_ds.checkpoint.integrity import STATE_DIGEST_KEY, seal_run_state

    path = tag_dir / "run_state.json"
    text = path.read_text()
    state = json.loads(text)
    consumed = state["loader"]["consumed_global_batches"]
    old, new = f'"consumed_global_batches": {consumed}', f'"consumed_global_batches": {consumed + 5}'
    assert text.count(old) == 1, text
    text = text.replace(old, new)
    if reseal:
        edited = json.loads(text)
        edited.pop(STATE_DIGEST_KEY)
        text = seal_run_state(edited)
    path.write_text(text)
    return path


def edited_run_state_resume(ctx: Ctx) -> Launch:
    ctx.copy_run("trained_run_4")
    ctx.culprit = str(_edit_consumed(ctx.run / "checkpoints" / "phase1-step000004", reseal=False))
    return Launch(rank_command(2, ctx.args("--resume", "auto")))


def forged_run_state_resume(ctx: Ctx) -> Launch:
    ctx.copy_run("trained_run_4")
    ctx.culprit = str(_edit_consumed(ctx.run / "checkpoints" / "phase1-step000004", reseal=True))
    return Launch(rank_command(2, ctx.args("--resume", "auto")))


def check_fell_back_and_set_aside(ctx: Ctx, out: Outcome) -> str:
    lost = check_flipped_master_resume(ctx, out)
    ckpt_dir = ctx.run / "checkpoints"
    assert (ckpt_dir / "phase1-step000004.damaged" / "run_state.json").read_text() != "", "damaged tag not kept"
    assert re.search(r"damaged checkpoint phase1-step000004 set aside as .*phase1-step000004\.damaged", out.text())
    # issue 22 item 5: the lines bert_ds knows to be moot are gone from what the user reads (2 ranks, ZeRO-2 LAMB)
    assert "untested optimizer" not in out.text() and "all_gather_into_tensor` is deprecated" not in out.text()
    return lost + "; the damaged tag kept as phase1-step000004.damaged"


def edited_run_state_only_tag(ctx: Ctx) -> Launch:
    ctx.copy_run()
    ctx.culprit = str(_edit_consumed(ctx.run / "checkpoints" / "phase1-step000002", reseal=False))
    ctx.snapshot = tree_bytes(ctx.run)
    return Launch(rank_command(2, ctx.args("--resume", "auto")))


def edited_run_state_convert(ctx: Ctx) -> Launch:
    ctx.copy_run()
    ctx.culprit = str(_edit_consumed(ctx.run / "checkpoints" / "phase1-step000002", reseal=True))
    ctx.snapshot = tree_bytes(ctx.run)
    return ctx.convert()


def retention_after_fallback(ctx: Ctx) -> Launch:
    """Tags 2 and 3 (3: an off-interval save, as a pre-emption makes); 3 damaged; the resume falls back to 2 and
    saves 4 (keep_last_k 2): the intact 2 must survive, the damaged 3 must not count."""
    ctx.copy_run("trained_run_3")
    target = _tag_file(ctx, "phase1-step000003", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    flip_master_weight_byte(target)
    ctx.culprit = str(target)
    return Launch(rank_command(2, ctx.args("--resume", "auto", "--max-steps", "4")))


def check_retention_after_fallback(ctx: Ctx, out: Outcome) -> str:
    ckpt_dir = ctx.run / "checkpoints"
    tags = ckpt.list_tags(ckpt_dir)
    assert tags == ["phase1-step000002", "phase1-step000004"], tags
    assert ckpt.read_latest(ckpt_dir) == "phase1-step000004"
    assert (ckpt_dir / "phase1-step000003.damaged").is_dir()
    got, want = weights(ctx.run, "phase1-step000004"), weights(ctx.request.getfixturevalue("trained_run_4"),
                                                                "phase1-step000004")
    assert all(torch.equal(got[k], want[k]) for k in want), "step 4 differs from the uninterrupted run"
    return ("nothing: tags {2, 4} kept (keep_last_k 2), the damaged step 3 set aside as phase1-step000003.damaged; "
            "step 4 bit-identical to the uninterrupted run")


# ---- issue 21 item 5: --init-from-hf compares vocabulary identity, not size -------------------------------------

def init_from_hf_other_vocabulary(ctx: Ctx) -> Launch:
    """A fresh run from an export of the trained run, with a tokenizer of the same size whose ids 200/201 are swapped
    (and shards made with it): the realistic case is a tokenizer trained on one's own corpus at the hub's size."""
    from bert_ds.data.tokenizer import vocab_sha256

    tok = _swapped_vocab_tokenizer(ctx)
    sha = vocab_sha256(tok / "vocab.txt")
    data = (_relabelled_shards(ctx, "s128", vocab_sha256=sha), _relabelled_shards(ctx, "s512", vocab_sha256=sha))
    hf = ctx.request.getfixturevalue("trained_export")
    ctx.culprit = str(hf / "vocab.txt")
    return Launch(rank_command(2, ctx.args("--init-from-hf", str(hf), data=data, tokenizer=tok)))


def init_from_hf_without_vocabulary(ctx: Ctx) -> Launch:
    hf = ctx.tmp / "hf-weights-only"
    shutil.copytree(ctx.request.getfixturevalue("trained_export"), hf)
    for name in ("vocab.txt", "tokenizer.json"):
        (hf / name).unlink(missing_ok=True)
    ctx.culprit = str(hf)
    return Launch(rank_command(2, ctx.args("--init-from-hf", str(hf))))


# ---- item 7: a reader against pruning -------------------------------------------------------------------------------

def convert_while_training_prunes(ctx: Ctx) -> Launch:
    """Training resumes with keep_last_k 1 and a checkpoint every step, so its first save would prune
    phase1-step000002, while a reader holds that tag (the converter's own lock, :func:`bert_ds.checkpoint.reading_tag`,
    taken here so the timing is certain); the converter then exports that very tag."""
    ctx.copy_run()
    fault_recipe(ctx.tmp / "recipe.json", **{"logging.keep_last_k": 1, "phases.0.checkpoint_interval": 1})
    ctx.held = contextlib.ExitStack()
    ctx.held.enter_context(ckpt.reading_tag(ctx.run / "checkpoints", "phase1-step000002"))
    ctx.request.addfinalizer(ctx.held.close)
    return Launch(rank_command(2, ctx.args("--resume", "auto", "--max-steps", "4")))


def check_convert_while_training_prunes(ctx: Ctx, out: Outcome) -> str:
    ckpt_dir = ctx.run / "checkpoints"
    tags = ckpt.list_tags(ckpt_dir)
    assert "phase1-step000002" in tags and ckpt.read_latest(ckpt_dir) == "phase1-step000004", tags
    assert "phase1-step000003" not in tags, tags  # pruning still ran for the tags nobody held
    ctx.held.close()
    export = execute(ctx.convert("phase1-step000002"))
    assert export.returncode == 0 and "verified" in export.text(), export.text()[-3000:]
    return "nothing: the held phase1-step000002 was skipped by pruning (step 3 pruned) and then exported, verified"


# ---- the table ----------------------------------------------------------------------------------------------------



E2E = (pytest.mark.e2e,)
"""Every row needs the trained checkpoint or its export (2-rank launches): the whole suite, at either level."""

CASES = [
    Case("resume-other-tokenizer-same-size", "1", "--resume auto with another tokenizer of the same size (and shards "
         "made with it)", resume_other_tokenizer, 2,
         r"checkpoint .*phase1-step000002 was trained with vocabulary sha256 \w+\.\.\. but --tokenizer "
         r".*tokenizer2 has \w+\.\.\. \(id 200: '.*' in .*phase1-step000002/vocab\.txt but '.*' in "
         r".*tokenizer2/vocab\.txt\)",
         check_resume_other_tokenizer),
    Case("resume-other-shard-set", "1", "--resume auto with another phase-1 shard set, same tokenizer",
         resume_other_shard_set, 2, r"phase1-step000002: loader state: field '\w+' is .* but this loader has",
         _unchanged, level=IN_PROCESS, marks=E2E),
    Case("resume-none-over-checkpoint", "1", "no --resume on an --output holding a checkpoint",
         resume_none_over_checkpoint, 2, r"already holds checkpoint 'phase1-step000002': pass --resume auto",
         _unchanged, level=IN_PROCESS, marks=E2E),
    Case("resume-cased-tokenizer", "1, 2", "--resume auto with the tokenizer marked cased (shards relabelled cased)",
         resume_cased_tokenizer, 2, r"phase1-step000002 was trained uncased \(lowercase=True\) but --tokenizer "
         r".*cased is cased", _unchanged, level=IN_PROCESS, marks=E2E),
    Case("cased-tokenizer-uncased-shards", "2", "tokenizer says cased, shards' index.json uncased",
         fresh_cased_tokenizer_uncased_shards, 2, r"{culprit}: field 'lowercase' is True \(uncased\) but --tokenizer "
         r".*cased is cased", _nothing_written, level=IN_PROCESS),
    Case("convert-rewritten-vocab", "1, 2", "checkpoints/tokenizer/vocab.txt replaced by a same-size vocabulary",
         convert_rewritten_tokenizer, 2, r"^error: .*phase1-step000002 was trained with vocabulary sha256 \w+\.\.\. "
         r"but .*tokenizer/vocab\.txt has \w+\.\.\. \(id 200: '.*' in .*phase1-step000002/vocab\.txt but '.*' in "
         r".*tokenizer/vocab\.txt\)", _no_export),
    Case("convert-recased-tokenizer", "2", "checkpoints/tokenizer/tokenizer_meta.json says cased",
         convert_recased_tokenizer, 2, r"^error: .*phase1-step000002 was trained with lowercase=True but .*tokenizer "
         r"says lowercase=False", _no_export, level=IN_PROCESS, marks=E2E),
    Case("flipped-master-weight-resume", "3", "one byte flipped in rank 1's fp32 master weights of the newest tag "
         "(phase1-step000004), --resume auto", flipped_master_resume, 0,
         r"RESUMING FROM AN OLDER CHECKPOINT: phase1-step000004 is damaged \({culprit}: sha256",
         check_flipped_master_resume, first_line=WARNING_LINE),
    Case("flipped-master-weight-convert", "3", "one byte flipped in rank 1's fp32 master weights, converter",
         flipped_master_convert, 2, r"^error: checkpoint phase1-step000002 is damaged: {culprit}: sha256", _no_export,
         level=IN_PROCESS, marks=E2E),
    Case("truncated-model-states-resume", "3", "mp_rank_00_model_states.pt cut in half, only tag, --resume auto",
         truncated_model_states_resume, 2, r"checkpoint phase1-step000002 is damaged: {culprit}: \d+ bytes, \d+ "
         r"recorded at save", _unchanged, level=IN_PROCESS, marks=E2E),
    Case("truncated-model-states-evaluate", "3", "mp_rank_00_model_states.pt cut in half, evaluation",
         truncated_model_states_evaluate, 2, r"^error: checkpoint phase1-step000002 is damaged: {culprit}: \d+ bytes",
         _unchanged, level=IN_PROCESS, marks=E2E),
    Case("edited-run-state-resume", "21.1", "run_state.json of the newest tag (phase1-step000004): "
         "loader.consumed_global_batches +5, one byte, --resume auto", edited_run_state_resume, 0,
         r"RESUMING FROM AN OLDER CHECKPOINT: phase1-step000004 is damaged \({culprit}: sha256 \w+\.\.\. of its "
         r"content differs", check_fell_back_and_set_aside, first_line=WARNING_LINE),
    Case("forged-run-state-resume", "21.1", "the same edit with run_state_sha256 recomputed, --resume auto",
         forged_run_state_resume, 0, r"RESUMING FROM AN OLDER CHECKPOINT: phase1-step000004 is damaged \({culprit}: "
         r"field 'loader\.consumed_global_batches' is \d+ but the run state saved inside mp_rank_00_model_states\.pt "
         r"holds \d+", check_fell_back_and_set_aside, first_line=WARNING_LINE),
    Case("edited-run-state-only-tag", "21.1", "run_state.json of the only tag edited, --resume auto",
         edited_run_state_only_tag, 2, r"checkpoint phase1-step000002 is damaged: {culprit}: sha256 \w+\.\.\. of its "
         r"content differs", _unchanged),
    Case("edited-run-state-convert", "21.1", "run_state.json edited and resealed, converter", edited_run_state_convert,
         2, r"^error: checkpoint phase1-step000002 is damaged: {culprit}: field 'loader\.consumed_global_batches'",
         _no_export, level=IN_PROCESS, marks=E2E),
    Case("retention-after-fallback", "21.2", "off-interval tag phase1-step000003 damaged; resume falls back to step 2 "
         "and saves step 4 (keep_last_k 2)", retention_after_fallback, 0,
         r"RESUMING FROM AN OLDER CHECKPOINT: phase1-step000003 is damaged \({culprit}: sha256",
         check_retention_after_fallback, first_line=WARNING_LINE),
    Case("init-from-hf-other-vocabulary", "21.5", "--init-from-hf an export whose vocab.txt differs from --tokenizer "
         "at ids 200/201 (same size; shards made with --tokenizer)", init_from_hf_other_vocabulary, 2,
         r"--init-from-hf .*: its vocabulary is not --tokenizer .*tokenizer2's \(id 200: '.*' in {culprit} but '.*' "
         r"in .*tokenizer2/vocab\.txt\)", _nothing_written, level=IN_PROCESS, marks=E2E),
    Case("init-from-hf-without-vocabulary", "21.5", "--init-from-hf a weights-and-config directory (no vocab.txt, no "
         "tokenizer.json)", init_from_hf_without_vocabulary, 2, r"--init-from-hf {culprit}: no vocab\.txt or "
         r"tokenizer\.json, so nothing shows that its token ids mean", _nothing_written, level=IN_PROCESS, marks=E2E),
    Case("convert-while-training-prunes", "7", "a reader holds phase1-step000002 while training (keep_last_k 1) "
         "saves steps 3 and 4", convert_while_training_prunes, 0, r"checkpoint .*phase1-step000004",
         check_convert_while_training_prunes, first_line=r"checkpoint .*phase1-step000004"),
]


@pytest.fixture(scope="module")
def trained_export(trained_run, tmp_path_factory) -> Path:
    """The Hugging Face export of ``trained_run`` (vocab.txt and tokenizer.json included)."""
    root = tmp_path_factory.mktemp("integrity_export")
    # A reader marks the tag it reads (CKPT/.<tag>.readers): convert a copy, as trained_run is shared read-only.
    shutil.copytree(trained_run, root / "run")
    out = root / "hf"
    done = execute(Launch(tool_cmd("convert_checkpoint.py", ["--checkpoint", str(root / "run" / "checkpoints"),
                                                             "--out", str(out)])))
    assert done.returncode == 0, done.text()[-4000:]
    return out


@pytest.fixture(scope="module")
def trained_run_3(shards_128, shards_512, tokenizer_dir, tmp_path_factory) -> Path:
    """Stopped after 3 steps: tags phase1-step000002 and phase1-step000003 (an off-interval save)."""
    root = tmp_path_factory.mktemp("integrity_trained3")
    return train_fault_run(root, shards_128, shards_512, tokenizer_dir, "--max-steps", "3")


@pytest.fixture(scope="module")
def trained_run_4(shards_128, shards_512, tokenizer_dir, tmp_path_factory) -> Path:
    """Stopped after 4 steps: tags phase1-step000002 and phase1-step000004 (keep_last_k 2)."""
    root = tmp_path_factory.mktemp("integrity_trained4")
    return train_fault_run(root, shards_128, shards_512, tokenizer_dir, "--max-steps", "4")


@pytest.fixture(scope="module")
def other_shards_128(english_corpus, tokenizer_dir, tmp_path_factory) -> Path:
    from bert_ds.data.create import create_shards

    out = tmp_path_factory.mktemp("integrity_other") / "s128"
    create_shards([english_corpus], tokenizer_dir, out, seq_len=128, dupe_factor=1, seed=99, samples_per_shard=10_000,
                  progress=False)
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES if c.level == LAUNCHED])
def test_fault(case: Case, request, tmp_path, shards_128, shards_512, tokenizer_dir):
    ctx = Ctx(tmp=tmp_path, request=request, s128=shards_128, s512=shards_512, tokenizer=tokenizer_dir)
    run_row(case, ctx)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES if c.level == IN_PROCESS])
def test_fault_in_process(case: Case, request, tmp_path, shards_128, shards_512, tokenizer_dir):
    """The refusals pre-flight decides, checked as each rank would decide them, without ranks (the default tier);
    the launched rows above prove the exit code and the line reach the user through real ranks."""
    test_fault(case, request, tmp_path, shards_128, shards_512, tokenizer_dir)
