"""The order ``make test`` hands files to its workers (``tests.helpers.schedule``): heaviest first, the waiting files
spread through the other heavy ones, each file whole."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import pytest

from tests.helpers.runs import REPO
from tests.helpers.schedule import HEAVY_S, LIGHT_S, file_weights, heaviest_files_first, spread, waiting_files


@dataclass
class _Item:
    nodeid: str
    marks: tuple[str, ...] = field(default=())

    def get_closest_marker(self, name):
        return getattr(pytest.mark, name).mark if name in self.marks else None


def test_files_go_heaviest_first_and_whole():
    items = [_Item(f"tests/test_many.py::test_{i}") for i in range(50)]  # 50 light: 15 s
    items += [_Item("tests/launch/test_two.py::test_a", ("e2e",)), _Item("tests/launch/test_two.py::test_b"),
              _Item("tests/launch/test_two.py::test_c", ("slurm",))]
    items += [_Item("tests/test_one.py::test_x", ("slow",)), _Item("tests/test_few.py::test_y")]
    heaviest_files_first(items)
    assert [i.nodeid for i in items[:4]] == ["tests/launch/test_two.py::test_a", "tests/launch/test_two.py::test_b",
                                             "tests/launch/test_two.py::test_c", "tests/test_one.py::test_x"]
    assert [i.nodeid for i in items[4:54]] == [f"tests/test_many.py::test_{i}" for i in range(50)]
    assert items[-1].nodeid == "tests/test_few.py::test_y"
    assert file_weights(items)["tests/launch/test_two.py"] == 2 * HEAVY_S + LIGHT_S


def test_waiting_files_are_spread_through_the_other_heavy_files():
    items = [_Item(f"tests/test_c{n}.py::test_{i}", ("e2e",)) for n in range(6) for i in range(6 - n)]  # 6..1 heavy
    items += [_Item(f"tests/test_w{n}.py::test_{i}", ("e2e", "waits")) for n in range(2) for i in range(3)]
    items += [_Item("tests/test_half.py::test_a", ("e2e", "waits")), _Item("tests/test_half.py::test_b", ("e2e",)),
              _Item("tests/test_half.py::test_c", ("e2e",))]  # a third of it waits: not a waiting file
    items += [_Item(f"tests/test_light.py::test_{i}") for i in range(3)]
    assert waiting_files(items) == {"tests/test_w0.py", "tests/test_w1.py"}
    heaviest_files_first(items)
    order = list(file_weights(items))
    assert order == ["tests/test_w0.py", "tests/test_c0.py", "tests/test_c1.py", "tests/test_c2.py",
                     "tests/test_w1.py", "tests/test_c3.py", "tests/test_half.py", "tests/test_c4.py",
                     "tests/test_c5.py", "tests/test_light.py"], order
    # each group keeps its own order, and one group alone is left as it is
    weights = {"a": 3.0, "b": 2.0, "c": 1.0}
    abc = ["a", "b", "c"]
    assert spread(abc, set(), weights) == spread(abc, {"a", "b", "c"}, weights) == abc


def test_this_session_runs_heaviest_files_first(request):
    items = request.session.items
    weights, waiting = file_weights(items), waiting_files(items)
    paths = list(weights)
    heavy = [p for p in paths if weights[p] >= HEAVY_S]
    assert paths[:len(heavy)] == heavy, paths[:10]  # the heavy files first
    for group in ([p for p in heavy if p not in waiting], [p for p in heavy if p in waiting], paths[len(heavy):]):
        assert [weights[p] for p in group] == sorted((weights[p] for p in group), reverse=True), group[:10]
    assert len(paths) == len({item.nodeid.split("::")[0] for item in items})  # each file whole


def test_make_passes_the_order_to_xdist():
    # Without --no-loadscope-reorder xdist re-sorts the files by how many tests each holds, cheapest-heavy first.
    commands = re.findall(r"^\t(?:\$\(TEST_ENV\) )?\$\(PY\) -m pytest (.*)$", (REPO / "Makefile").read_text(),
                          flags=re.M)
    assert len(commands) == 2 and all("--dist loadfile --no-loadscope-reorder" in c for c in commands), commands


def test_make_lets_the_suite_write_bytecode():
    # Each of the suite's processes then reads the project's modules compiled, also where the machine sets
    # PYTHONDONTWRITEBYTECODE (an empty value turns it off).
    text = (REPO / "Makefile").read_text()
    assert re.search(r"^TEST_ENV := PYTHONDONTWRITEBYTECODE=$", text, flags=re.M), "TEST_ENV"
    assert len(re.findall(r"^\t\$\(TEST_ENV\) \$\(PY\) -m pytest ", text, flags=re.M)) == 2


def test_a_worker_takes_its_share_of_the_cores_for_torch_threads():
    # tests/conftest.py: 2 workers on 2 cores -> 1 intra-op thread each (in-process fine-tunes otherwise spin in OpenMP
    # barriers against the other worker's ranks)
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers == 0 or "OMP_NUM_THREADS" in os.environ:
        pytest.skip("not a pytest-xdist worker, or OMP_NUM_THREADS chosen by the caller")
    assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // workers)
