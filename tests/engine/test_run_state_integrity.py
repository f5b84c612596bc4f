"""``run_state.json`` is verified like every other file of a tag, and a damaged tag is set aside instead of counting
toward retention (issue 21 items 1-2), on run directories laid out by hand; the same on real ranks is in
``tests/faults/test_fault_table_integrity.py``."""

from __future__ import annotations

import json

import torch


def _fake_tag(ckpt_dir, tag, files: dict[str, bytes]):
    from bert_ds.checkpoint.integrity import file_digest, seal_run_state

    tag_dir = ckpt_dir / tag
    tag_dir.mkdir(parents=True)
    for name, data in files.items():
        (tag_dir / name).write_bytes(data)
    state = {"phase": 0, "step": int(tag[-6:]), "phase_done": False,
             "files": {name: file_digest(tag_dir / name) for name in files}}
    (tag_dir / "run_state.json").write_text(seal_run_state(state))
    return tag_dir


def test_run_state_is_sealed_and_cross_checked_with_the_client_state(tmp_path):
    """run_state.json's own digest catches an edited byte; the client state inside the model-states file catches an
    edit whose digest was recomputed; a tag without the seal is still cross-checked."""
    from bert_ds.checkpoint import verify_tag
    from bert_ds.checkpoint.integrity import STATE_DIGEST_KEY, file_digest, seal_run_state

    tag_dir = tmp_path / "phase1-step000004"
    tag_dir.mkdir()
    state = {"phase": 0, "step": 4, "phase_done": False, "loader": {"consumed_global_batches": 4}, "lr": 1e-3}
    torch.save({"module": {"w": torch.ones(3)}, "bert_ds": state}, tag_dir / "mp_rank_00_model_states.pt")
    files = {"mp_rank_00_model_states.pt": file_digest(tag_dir / "mp_rank_00_model_states.pt")}
    sealed = seal_run_state({**state, "files": files})
    (tag_dir / "run_state.json").write_text(sealed)
    assert verify_tag(tag_dir) == []

    edited = sealed.replace('"consumed_global_batches": 4', '"consumed_global_batches": 9')
    (tag_dir / "run_state.json").write_text(edited)
    [line] = verify_tag(tag_dir)
    assert "run_state.json: sha256" in line and "differs from the run_state_sha256" in line, line

    forged = json.loads(sealed)
    forged["loader"]["consumed_global_batches"] = 9
    del forged[STATE_DIGEST_KEY]
    (tag_dir / "run_state.json").write_text(seal_run_state(forged))
    [line] = verify_tag(tag_dir)
    assert "field 'loader.consumed_global_batches' is 9 but the run state saved inside mp_rank_00_model_states.pt " \
           "holds 4" in line, line

    (tag_dir / "run_state.json").write_text(json.dumps(forged))  # the seal removed: the cross-check still runs
    [line] = verify_tag(tag_dir)
    assert "field 'loader.consumed_global_batches' is 9" in line, line


def test_damaged_tags_are_set_aside_and_never_counted_by_retention(tmp_path):
    from bert_ds.checkpoint import list_tags, prune_checkpoints, read_latest, set_aside_damaged

    for step in (2, 3):
        _fake_tag(tmp_path, f"phase1-step{step:06d}", {"f.pt": b"x"})
    (tmp_path / "latest").write_text("phase1-step000003")
    (tmp_path / "phase1-step000003.damaged").mkdir()  # set aside by an earlier resume: the next name is taken
    assert set_aside_damaged(tmp_path, ("phase1-step000003",), "phase1-step000002") == ["phase1-step000003.damaged-2"]
    assert read_latest(tmp_path) == "phase1-step000002" and list_tags(tmp_path) == ["phase1-step000002"]
    _fake_tag(tmp_path, "phase1-step000004", {"f.pt": b"x"})
    (tmp_path / "latest").write_text("phase1-step000004")
    assert prune_checkpoints(tmp_path, keep_last_k=2) == []
    assert list_tags(tmp_path) == ["phase1-step000002", "phase1-step000004"]
    assert (tmp_path / "phase1-step000003.damaged-2" / "f.pt").read_bytes() == b"x"


def test_a_rewritten_tokenizer_is_named_by_its_first_differing_id(tmp_path):
    """The tag keeps the vocabulary it was trained with (checksummed with it): a refusal names the first id at which
    another tokenizer differs, even after the copy beside the tags was rewritten."""
    from bert_ds.checkpoint import first_id_differing
    from bert_ds.data.tokenizer import load_tokenizer, vocab_sha256

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "of", "and"]
    tag = _fake_tag(tmp_path, "phase1-step000002", {"vocab.txt": ("\n".join(tokens) + "\n").encode()})
    trained_sha = vocab_sha256(tag / "vocab.txt")
    other = tmp_path / "tok"
    other.mkdir()
    tokens[5], tokens[6] = tokens[6], tokens[5]
    (other / "vocab.txt").write_text("\n".join(tokens) + "\n")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "vocab.txt").write_text("\n".join(tokens) + "\n")  # the copy beside the tags, rewritten
    found = first_id_differing(tmp_path, "phase1-step000002", trained_sha, load_tokenizer(other))
    assert found == f" (id 5: 'the' in {tag / 'vocab.txt'} but 'of' in {other / 'vocab.txt'})"
    (tag / "vocab.txt").unlink()  # a tag saved before tags kept it, and the copy beside them rewritten: nothing to name
    assert first_id_differing(tmp_path, "phase1-step000002", trained_sha, load_tokenizer(other)) == ""
