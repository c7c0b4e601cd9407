"""Libraries' import-time bugs are mended without changing what the libraries compute."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from huggingfaceserver import import_fixes
from huggingfaceserver.import_fixes import FixAfterImport
from huggingfaceserver.import_table import CACHE_ENV


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
    import json, os, sys
    if sys.argv[1] == "fixed":
        from huggingfaceserver.import_fixes import install
        install()
    import transformers
    import transformers.models
    from transformers.utils import import_utils
    build = import_utils.create_import_structure_from_path
    memo = getattr(build, "build", build)
    info = memo.cache_info()
    print(json.dumps({
        "top": sorted(dir(transformers)),
        "models": sorted(dir(transformers.models)),
        "hits": info.hits,
        "misses": info.misses,
        "maxsize": info.maxsize,
        "folders": sum(
            entry.is_dir() and entry.name != "__pycache__"
            for entry in os.scandir(os.path.dirname(transformers.models.__file__))
        ),
        "origin": getattr(build, "origin", None),
        "bert": transformers.BertModel.__module__,
    }))
    """
)


def probe(mode: str, script: str = PROBE, store: Path | None = None) -> dict:
    """What ``script`` prints last, as JSON, run in a fresh process (``fixed``: with the fixes,
    the import table stored in ``store``)."""
    env = dict(os.environ)
    if store is not None:
        env[CACHE_ENV] = str(store)
    done = subprocess.run(
        [sys.executable, "-c", script, mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_transformers_builds_its_import_table_once_and_the_same(tmp_path):
    """Unmended, transformers 5.x builds the table twice, reading every model folder twice (the
    second build finds nothing in its too-small cache); mended, each folder is read once, and
    the lazy modules list the same names. The next start reads the table from the store, and
    they list the same names again."""
    plain = probe("plain")
    built = probe("fixed", store=tmp_path)
    assert built["origin"] == "built"
    assert built["folders"] > 500
    assert built["folders"] <= built["misses"] + built["hits"] <= built["folders"] * 1.1
    if plain["maxsize"] is not None:
        assert plain["misses"] >= 2 * built["folders"]
    stored = probe("fixed", store=tmp_path)
    assert stored["origin"] == "store"
    for fixed in (built, stored):
        assert fixed["top"] == plain["top"]
        assert fixed["models"] == plain["models"]
        assert fixed["bert"] == plain["bert"] == "transformers.models.bert.modeling_bert"


def stock_get_source(stacklevel: int) -> str:
    """torch 2.x's ``torch._library.utils.get_source``, as written there."""
    frame = inspect.getframeinfo(sys._getframe(stacklevel))
    source = f"{frame.filename}:{frame.lineno}"
    return source


def test_the_registration_position_is_the_callers_file_and_line_as_before():
    def register():  # a caller one frame up, as torch.library calls it
        return import_fixes.get_source(2), stock_get_source(2)

    mended, stock = register()
    called_on = inspect.currentframe().f_lineno - 1
    assert mended == stock == f"{__file__}:{called_on}"


def test_a_changed_get_source_is_left_alone():
    module = type(sys)("changed")
    module.get_source = lambda stacklevel: f"{inspect.stack()[stacklevel]}"
    import_fixes.source_position_without_source_text(module)
    assert module.get_source is not import_fixes.get_source
    module.get_source = stock_get_source
    import_fixes.source_position_without_source_text(module)
    assert module.get_source is import_fixes.get_source


FAKE_KERNELS = textwrap.dedent(
    """
    import json, sys
    if sys.argv[1] == "fixed":
        from huggingfaceserver.import_fixes import install
        install()
    import torch
    import transformers.modeling_utils
    from torch._library import utils
    from torch._library.simple_registry import singleton
    print(json.dumps({
        "mended": utils.get_source.__module__ == "huggingfaceserver.import_fixes",
        "sources": {
            name: entry.fake_impl.kernel.source
            for name, entry in singleton._data.items()
            if entry.fake_impl.kernel is not None
        },
    }))
    """
)


def test_torch_records_the_same_positions_for_its_fake_kernels():
    plain, fixed = probe("plain", FAKE_KERNELS), probe("fixed", FAKE_KERNELS)
    assert fixed["mended"] and not plain["mended"]
    assert len(fixed["sources"]) >= 100  # torch registers ~135 while it and transformers import
    assert fixed["sources"] == plain["sources"]
