"""transformers' import table from the store equals the one transformers builds, and any change
to what it was built from builds it again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from transformers.utils import import_utils

from huggingfaceserver.import_table import (
    CACHE_ENV,
    StoredImportTable,
    cache_dir,
    decode,
    encode,
    fingerprint,
)

_BUILDER = import_utils.create_import_structure_from_path  # mended here: this package is imported
BUILD = getattr(_BUILDER, "build", _BUILDER).__wrapped__
"""transformers' own builder, without its in-process memo (its subfolders' are memoised)."""


def ordered(table: dict) -> list:
    """The table with every key in its order (dict equality ignores order)."""
    return [
        (key, ordered(value) if not isinstance(key, frozenset) else value)
        for key, value in table.items()
    ]


@pytest.fixture
def models(tmp_path) -> Path:
    """A models folder as transformers lays one out: a folder per model, ``__all__`` lists and
    ``@requires`` backends."""
    root = tmp_path / "transformers"
    (root / "utils").mkdir(parents=True)
    (root / "utils" / "import_utils.py").write_text("# the parser\n")
    for name in ("alpha", "beta"):
        folder = root / "models" / name
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / f"configuration_{name}.py").write_text(
            f'class {name.title()}Config:\n    pass\n\n__all__ = ["{name.title()}Config"]\n'
        )
        (folder / f"modeling_{name}.py").write_text(
            f"class {name.title()}Model:\n    pass\n\n"
            f'__all__ = [\n    "{name.title()}Model",\n    "{name.title()}PreTrainedModel",\n]\n'
        )
    (root / "models" / "__init__.py").write_text("")
    return root / "models"


class Builds:
    """transformers' builder, counting the builds of each folder asked for."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, path) -> dict:
        self.calls.append(os.fspath(path))
        return BUILD(path)


def stored_table(models: Path, store: Path, builds: Builds) -> StoredImportTable:
    parser = str(models.parent / "utils" / "import_utils.py")
    return StoredImportTable(builds, str(models), parser, store)


def test_the_real_table_survives_the_store_whole_and_in_order():
    folder = Path(import_utils.__file__).parent.parent / "models"
    table = BUILD(str(folder))
    again = decode(json.loads(json.dumps(encode(table))))
    assert again == table
    assert ordered(again) == ordered(table)
    assert len(table) > 500  # the model folders


def test_the_next_start_reads_the_table_instead_of_building_it(models, tmp_path):
    first_builds, next_builds = Builds(), Builds()
    first = stored_table(models, tmp_path / "store", first_builds)(models)
    assert first_builds.calls[0] == str(models)
    later = stored_table(models, tmp_path / "store", next_builds)
    table = later(models / "__init__.py")  # as transformers.models asks for it
    assert next_builds.calls == []
    assert later.origin == "store"
    assert table == first == BUILD(str(models))
    assert later(models) is table  # and once per process


@pytest.mark.parametrize(
    "change",
    [
        lambda models: (models / "alpha" / "modeling_alpha.py").write_text("__all__ = []\n"),
        lambda models: (models / "beta" / "tokenization_beta.py").write_text(
            '__all__ = ["BetaTokenizer"]\n'
        ),
        lambda models: (models / "alpha" / "configuration_alpha.py").unlink(),
        lambda models: (models / "gamma").mkdir(),
        lambda models: (models.parent / "utils" / "import_utils.py").write_text("# parser 2\n"),
    ],
    ids=["file-changed", "file-added", "file-removed", "folder-added", "parser-changed"],
)
def test_any_change_builds_the_table_again(models, tmp_path, change):
    stored_table(models, tmp_path / "store", Builds())(models)
    change(models)
    builds = Builds()
    later = stored_table(models, tmp_path / "store", builds)
    assert later(models) == BUILD(str(models))
    assert later.origin == "built"
    assert builds.calls[0] == str(models)


def test_a_damaged_store_is_built_again_and_mended(models, tmp_path):
    store = tmp_path / "store"
    stored_table(models, store, Builds())(models)
    (stored,) = store.iterdir()
    stored.write_text('[["backends", ')
    assert stored_table(models, store, Builds())(models) == BUILD(str(models))
    healed = stored_table(models, store, Builds())
    healed(models)
    assert healed.origin == "store"


def test_a_store_that_cannot_be_written_only_costs_the_build(models, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    table = stored_table(models, blocked / "store", Builds())
    assert table(models) == BUILD(str(models))
    assert table.origin == "built"


def test_other_folders_are_built_as_before(models, tmp_path):
    builds = Builds()
    table = stored_table(models, tmp_path / "store", builds)
    assert table(models / "alpha") == BUILD(str(models / "alpha"))
    assert builds.calls == [str(models / "alpha")]
    assert not (tmp_path / "store").exists()


def test_the_fingerprint_is_the_same_for_the_same_files(models):
    parser = str(models.parent / "utils" / "import_utils.py")
    (models / "alpha" / "__pycache__").mkdir()
    assert fingerprint(str(models), parser) == fingerprint(str(models), parser)
    (models / "alpha" / "__pycache__" / "x.pyc").write_bytes(b"compiled")  # not a source
    before = fingerprint(str(models), parser)
    (models / "alpha" / "__pycache__" / "y.pyc").write_bytes(b"compiled")
    assert fingerprint(str(models), parser) == before


def test_where_the_store_is(monkeypatch):
    assert cache_dir({CACHE_ENV: "/volume/cache"}) == Path("/volume/cache")
    assert cache_dir({"XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/huggingfaceserver")
    assert cache_dir({}) == Path.home() / ".cache" / "huggingfaceserver"
    monkeypatch.setattr(os.path, "expanduser", lambda path: path)  # no HOME, no passwd entry
    assert cache_dir({}) is None
