"""The test harness's rank zygote (tests/helpers/rank_zygote.py): a forked script sees what ``python -u SCRIPT ARGS``
would give it, and ends as that interpreter would. That forked ranks compute what started ones do is checked wherever
a run through a real launcher is compared bit for bit with one spawned by ``spawn_ranks`` (the fault tables, the
launcher pre-emption tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import HANG_GUARD_S, child_env
from tests.helpers.rank_zygote import _ZYGOTE, fork_rank
from tests.helpers.ranks import REPO

pytestmark = pytest.mark.e2e  # processes given a rank's variables (tests/helpers/tiers.py)

PROBE = """
import json, os, sys
print(json.dumps({"name": __name__, "file": __file__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "rank": os.environ.get("RANK"), "stdin": sys.stdin.read(), "main": sys.modules["__main__"].__name__}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def test_a_forked_script_sees_what_its_interpreter_would_and_exits_with_its_code(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = child_env(RANK="1")
    out, err = tmp_path / "out", tmp_path / "err"
    out.touch()
    err.touch()
    argv = [str(script), "--local_rank=1", "x y"]
    rank = fork_rank(argv, env, REPO, str(out), str(err), ready_timeout=HANG_GUARD_S)
    assert rank is not None and rank.wait(HANG_GUARD_S) == 3
    assert _ZYGOTE[0].proc.pid != rank.pid  # forked by the zygote
    started = subprocess.run([sys.executable, "-u", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=HANG_GUARD_S)
    assert started.returncode == 3
    assert json.loads(out.read_text()) == json.loads(started.stdout)
    assert err.read_text() == started.stderr == "to stderr\n"


def test_a_rank_with_another_environment_gets_a_zygote_started_with_it(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("import os, sys\nprint(os.environ['BERT_DS_PROBE'], file=sys.stderr)\n")
    zygotes = []
    for value in ("one", "two", "two"):
        err = tmp_path / f"err-{len(zygotes)}"
        err.touch()
        rank = fork_rank([str(script)], child_env(RANK="0", BERT_DS_PROBE=value), REPO, os.devnull, str(err),
                         ready_timeout=HANG_GUARD_S)
        assert rank.wait(HANG_GUARD_S) == 0 and err.read_text() == f"{value}\n"
        zygotes.append(_ZYGOTE[0].proc)
    assert zygotes[0] is not zygotes[1] and zygotes[0].returncode == 0  # ended and reaped
    assert zygotes[1] is zygotes[2]  # the same environment: the same zygote
