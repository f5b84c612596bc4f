"""One extension build directory per environment, built with the interpreter's own ninja
(``bert_ds.runtime.caches.extensions_root``, ``build_tools_path``): the build ``make venv`` makes is the one every
later start loads, with the venv activated or not, and two environments never rebuild over each other."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bert_ds.runtime import caches
from tests.helpers import HANG_GUARD_S
from tests.helpers.runs import REPO

VENV_BIN = str(Path(sys.executable).parent)
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def _in_child(code: str, path: str, **env: str) -> str:
    child = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    child.update(PATH=path, PYTHONPATH=str(REPO), **env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=child,
                          cwd=REPO, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_the_interpreters_bin_comes_first_once():
    path = caches.build_tools_path(os.pathsep.join(["/usr/bin", VENV_BIN, "/bin", VENV_BIN]))
    assert path.split(os.pathsep) == [VENV_BIN, "/usr/bin", "/bin"]


def test_activated_or_not_the_same_directory_and_ninja():
    code = "from bert_ds.runtime import caches; print(caches.extensions_root(), dict(caches.build_identity())['ninja'])"
    activated = _in_child(code, os.pathsep.join([VENV_BIN, SYSTEM_PATH]))
    plain = _in_child(code, SYSTEM_PATH)
    assert activated == plain


def test_another_environment_gets_another_directory(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    ours = caches.extensions_root()
    assert ours.name.startswith(caches._torch_default_root().name + "-")
    other = (*caches.build_identity()[:-1], ("c++", "another compiler 1.0"))
    monkeypatch.setattr(caches, "build_identity", lambda: other)
    theirs = caches.extensions_root()
    assert theirs != ours and theirs.parent == ours.parent


def test_the_users_directory_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert caches.extensions_root() == tmp_path
    monkeypatch.setenv("PATH", SYSTEM_PATH)
    assert caches.pin_build_environment() == tmp_path
    assert os.environ["PATH"].split(os.pathsep)[0] == VENV_BIN


@pytest.mark.slow
def test_the_prebuild_is_loaded_activated_or_not():
    """What ``make venv`` runs, then a start from the other kind of shell: the second finds the build done (the
    shared object is not rewritten). The first call builds only on a machine where ``make venv`` did not."""
    code = """
        from bert_ds.runtime import caches
        caches.load_extensions()
        so = next(caches.extensions_root().glob("deepspeed_shm_comm/*.so"))
        print(so, so.stat().st_mtime_ns)
    """
    first = _in_child(code, os.pathsep.join([VENV_BIN, SYSTEM_PATH]))
    second = _in_child(code, SYSTEM_PATH)
    third = _in_child(code, os.pathsep.join([SYSTEM_PATH, VENV_BIN]))
    assert first == second == third


def test_every_process_group_is_joined_with_the_extensions_loaded_first():
    """Only :mod:`bert_ds.runtime.distributed` starts DeepSpeed's group (``init_distributed``, ``join_gloo_group``,
    both through ``load_extensions``): a program calling ``deepspeed.init_distributed`` itself had DeepSpeed build its
    shared-memory extension in torch's default directory, where the suite's processes rebuilt it over each other."""
    owner = REPO / "bert_ds" / "runtime" / "distributed.py"
    sources = [*REPO.glob("bert_ds/**/*.py"), *REPO.glob("tools/*.py"), *REPO.glob("tests/**/*.py")]
    callers = sorted(p.relative_to(REPO).as_posix() for p in sources
                     if p not in (owner, Path(__file__)) and "deepspeed.init_distributed(" in p.read_text())
    assert callers == [], callers
    assert caches.load_extensions.__name__ in owner.read_text().split("def join_gloo_group", 1)[1].split("\ndef ")[0]
