"""Re-recording a tampered checkpoint file's checksum in its tag's ``run_state.json``: what an attacker who can write
the run directory would do, so tests of the unpickling defences (``bert_ds.safe_load``) get past the checksums
(``bert_ds.checkpoint.integrity``) and reach them."""

from __future__ import annotations

import json
from pathlib import Path

from bert_ds.checkpoint.integrity import STATE_DIGEST_KEY, file_digest, seal_run_state

__all__ = ["rerecord_checksum"]


def rerecord_checksum(path: Path) -> None:
    """Write ``path``'s current size and sha256 into ``run_state.json`` beside it (when that records checksums), and
    seal the file again (its own digest)."""
    state_path = path.parent / "run_state.json"
    state = json.loads(state_path.read_text())
    if "files" in state:
        state["files"][path.name] = file_digest(path)
        state.pop(STATE_DIGEST_KEY, None)
        state_path.write_text(seal_run_state(state))
