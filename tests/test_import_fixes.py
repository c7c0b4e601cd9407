"""Libraries' import-time bugs are mended without changing what the libraries compute."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from huggingfaceserver.import_fixes import FixAfterImport


@pytest.fixture
def package(tmp_path, monkeypatch) -> Path:
    """A package ``toypkg`` with two modules, importable from ``tmp_path``."""
    root = tmp_path / "toypkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "mended.py").write_text("VALUE = 1\n")
    (root / "other.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [name for name in sys.modules if name.startswith("toypkg")]:
        del sys.modules[name]


def install(fixes) -> FixAfterImport:
    finder = FixAfterImport(fixes)
    sys.meta_path.insert(0, finder)
    return finder


def test_the_fix_runs_once_right_after_its_module_executes(package):
    seen = []

    def fix(module):
        seen.append(module.VALUE)
        module.VALUE = 2

    finder = install({"toypkg.mended": fix})
    try:
        import toypkg.mended
        import toypkg.other

        assert toypkg.mended.VALUE == 2
        assert toypkg.other.VALUE == 1
        assert seen == [1]
        assert finder.fixes == {}  # nothing left to look for
    finally:
        sys.meta_path.remove(finder)


def test_a_failing_fix_leaves_the_module_imported_as_it_is(package):
    def fix(module):
        raise AttributeError("the library changed shape")

    finder = install({"toypkg.mended": fix})
    try:
        import toypkg.mended

        assert toypkg.mended.VALUE == 1
    finally:
        sys.meta_path.remove(finder)


PROBE = textwrap.dedent(
    """
    import json, sys
    if sys.argv[1] == "fixed":
        from huggingfaceserver.import_fixes import install
        install()
    import transformers
    import transformers.models
    from transformers.utils import import_utils
    info = import_utils.create_import_structure_from_path.cache_info()
    print(json.dumps({
        "top": sorted(dir(transformers)),
        "models": sorted(dir(transformers.models)),
        "hits": info.hits,
        "maxsize": info.maxsize,
        "bert": transformers.BertModel.__module__,
    }))
    """
)


def probe(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_transformers_builds_its_import_table_once_and_the_same():
    """Unmended, the second build finds nothing in the too-small cache (transformers 5.x);
    mended, it finds every model folder, and the lazy modules list the same names."""
    plain, fixed = probe("plain"), probe("fixed")
    assert fixed["maxsize"] is None
    assert fixed["hits"] >= 500  # the ~550 model folders, read once
    if plain["maxsize"] is not None:
        assert plain["hits"] < fixed["hits"]
    assert fixed["top"] == plain["top"]
    assert fixed["models"] == plain["models"]
    assert fixed["bert"] == plain["bert"] == "transformers.models.bert.modeling_bert"
