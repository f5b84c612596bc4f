"""tests/helpers/cpu_per_test.py charges each test the CPU of every process it ran: its own, the processes it reaped,
and the ranks its rank zygote forked; a zygote reaped during a later test is not charged to that test again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import HANG_GUARD_S, child_env
from tests.helpers.cpu_per_test import ENV
from tests.helpers.ranks import REPO

pytestmark = pytest.mark.e2e  # forks processes from a rank zygote (tests/helpers/tiers.py)

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"

INNER = f'''
import os, subprocess, sys, time
from tests.helpers import child_env
from tests.helpers.rank_zygote import fork_rank
from tests.helpers.ranks import REPO

BURN = {BURN!r}


def _forked(tmp_path, **env):
    script = tmp_path / "burn.py"
    script.write_text(BURN)
    rank = fork_rank([str(script)], child_env(RANK="0", **env), REPO, os.devnull, os.devnull, ready_timeout=600,
                     preload=())
    assert rank.wait(600) == 0


def test_in_process():
    exec(BURN)


def test_a_child():
    subprocess.run([sys.executable, "-c", BURN], check=True)


def test_a_forked_rank(tmp_path):
    _forked(tmp_path)


def test_a_forked_rank_from_a_new_zygote(tmp_path):
    _forked(tmp_path, BERT_DS_PROBE="another environment: the first zygote is ended and reaped here")
'''


def test_each_process_is_charged_to_the_test_that_ran_it(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    log = tmp_path / "cpu.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.helpers.cpu_per_test", "-p",
                           "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                          cwd=REPO, env=child_env(**{ENV: str(log)}), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line[0].split("::")[1]: line[4:] for line in map(json.loads, log.read_text().splitlines())}
    assert set(rows) == {"test_in_process", "test_a_child", "test_a_forked_rank",
                         "test_a_forked_rank_from_a_new_zygote"}
    own, reaped, forked = rows["test_in_process"]
    assert own >= 0.45 and reaped < 0.1 and forked == 0, rows
    own, reaped, forked = rows["test_a_child"]
    assert reaped >= 0.45 and own < 0.4 and forked == 0, rows
    # The zygote's own start (torch and DeepSpeed imported) is charged too: more than the rank's 0.5 s.
    for name in ("test_a_forked_rank", "test_a_forked_rank_from_a_new_zygote"):
        own, reaped, forked = rows[name]
        assert forked >= 0.45 and reaped < 0.4, (name, rows)
    table = subprocess.run([sys.executable, "-m", "tests.helpers.cpu_per_test", str(log), "--by", "test"], cwd=REPO,
                           env=child_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert table.returncode == 0 and table.stdout.startswith("4 tests, "), table.stdout + table.stderr
    assert all(name in table.stdout for name in rows), table.stdout
