"""A phase's weighted sources in the recipe (``phases[i].data``): read, made absolute against the recipe file's
directory, refused with the file and the field named, free on resume (the loader state decides)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bert_ds.recipe import DataSource, Recipe, load_recipe, resume_blockers
from tests.helpers.runs import SMALL_RECIPE


def _write(path: Path, data: list | None, phase: int = 0) -> Path:
    recipe = json.loads(json.dumps(SMALL_RECIPE))
    recipe["phases"][phase]["data"] = data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recipe))
    return path


def test_relative_paths_are_read_from_the_recipe_files_directory(tmp_path, monkeypatch):
    path = _write(tmp_path / "recipes" / "mix.json",
                  [{"path": "../shards/wiki128/", "weight": 3}, {"path": "/data/books128", "weight": 1.5}])
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    recipe = load_recipe(path)
    assert recipe.phases[0].data == [DataSource(str(tmp_path / "recipes" / "../shards/wiki128"), 3.0),
                                     DataSource("/data/books128", 1.5)]
    assert recipe.phases[1].data is None
    # what a checkpoint saves reads back the same (absolute paths, plain JSON objects)
    assert Recipe.from_dict(json.loads(json.dumps(recipe.to_dict()))).phases[0].data == recipe.phases[0].data


def test_one_source_may_go_without_a_weight(tmp_path):
    recipe = load_recipe(_write(tmp_path / "r.json", [{"path": "wiki128"}]))
    assert recipe.phases[0].data == [DataSource(str(tmp_path / "wiki128"), None)]


@pytest.mark.parametrize("data, message", [
    ([], r"phases\[0\]\.data=\[\] must be a non-empty list"),
    ({"path": "a"}, r"phases\[0\]\.data=\{'path': 'a'\} must be a non-empty list"),
    ([{"path": "a", "weight": 0}], r"phases\[0\]\.data\[0\]\.weight=0 must be a positive number"),
    ([{"path": "a", "weight": -2}], r"phases\[0\]\.data\[0\]\.weight=-2 must be a positive number"),
    ([{"path": "a", "weight": "3"}], r"phases\[0\]\.data\[0\]\.weight='3' must be a positive number"),
    ([{"path": "a", "weight": True}], r"phases\[0\]\.data\[0\]\.weight=True must be a positive number"),
    ([{"path": "a", "weight": 1}, {"path": "b"}], r"phases\[0\]\.data\[1\] \('b'\) has no weight"),
    ([{"path": "x/a", "weight": 1}, {"path": "y/a", "weight": 2}],
     r"phases\[0\]\.data\[1\]\.path='y/a': name 'a' is data\[0\]'s too"),
    ([{"path": "", "weight": 1}], r"phases\[0\]\.data\[0\]\.path='' must name a shard directory"),
    ([{"dir": "a", "weight": 1}], r"phases\[0\]\.data\[0\] must be \{\"path\": DIR, \"weight\": W\}, got keys"),
    (["a:1"], r"phases\[0\]\.data\[0\] must be \{\"path\": DIR, \"weight\": W\}, got 'a:1'"),
])
def test_bad_data_names_the_file_and_the_field(tmp_path, data, message):
    path = _write(tmp_path / "bad.json", data)
    with pytest.raises(ValueError, match=f"^{tmp_path / 'bad.json'}: {message}"):
        load_recipe(path)


def test_the_second_phase_is_named_by_its_index(tmp_path):
    with pytest.raises(ValueError, match=r"phases\[1\]\.data\[0\]\.weight=-1"):
        load_recipe(_write(tmp_path / "bad.json", [{"path": "a", "weight": -1}], phase=1))


def test_data_is_free_on_resume():
    """The loader state, not the recipe, holds what a resume must match (shard-set hashes and weights): a recipe
    whose data moved or changed is no recipe blocker; the loader check refuses a changed mix."""
    saved = Recipe.from_dict(SMALL_RECIPE).to_dict()
    changed = json.loads(json.dumps(SMALL_RECIPE))
    changed["phases"][0]["data"] = [{"path": "/elsewhere/wiki128", "weight": 1}, {"path": "/b", "weight": 2}]
    assert resume_blockers(saved, Recipe.from_dict(changed)) == []
    changed["phases"][0]["lr"], changed["phases"][0]["steps"] = 1e-3, 5
    assert resume_blockers(saved, Recipe.from_dict(changed)) == ["phases[0].steps"]


def test_the_phase_in_docs_data_md_is_a_valid_recipe_phase():
    """The recipe form of the worked mix in docs/data.md ("Mixing sources") reads as written."""
    from tests.test_docs import ROOT, fenced_blocks

    doc = ROOT / "docs" / "data.md"
    [block] = [b for b in fenced_blocks(doc, doc.read_text()) if b.label == "json"]
    phase = Recipe.from_dict({"model": "base", "phases": [json.loads(block.text)]}, source=str(doc)).phases[0]
    assert [(s.path, s.weight) for s in phase.data] == [("shards/wiki128", 2500.0), ("shards/books128", 800.0),
                                                        ("/scratch/domain128", 367.0)]
