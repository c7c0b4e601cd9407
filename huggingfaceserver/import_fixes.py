"""Import-time costs that are libraries' bugs, mended as the library's module is first executed.

Each fix is a function of the freshly executed module that changes nothing the library computes,
only how often it computes it or how much it computes to throw away, and does nothing when the
library has changed shape (a newer release that fixed the bug or renamed what is mended).
:func:`install` registers them before the libraries are imported; the module is executed by its
usual loader, the fix runs right after.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

logger = logging.getLogger(__name__)


def unbounded_import_structure_cache(module: ModuleType) -> None:
    """transformers builds its lazy import table by reading every file of its ~550 model folders,
    memoised per folder with ``lru_cache(maxsize=128)``. The table is built twice (by
    ``transformers`` and by ``transformers.models``), and with more folders than the cache holds
    the second build finds nothing cached and reads all ~3,300 files again: 0.4-0.7 s of every
    start. The folders' contents do not change while the process runs: remember them all."""
    build = getattr(module, "create_import_structure_from_path", None)
    cache_info = getattr(build, "cache_info", None)
    unwrapped = getattr(build, "__wrapped__", None)
    if cache_info is None or unwrapped is None or cache_info().maxsize is None:
        return
    module.create_import_structure_from_path = functools.lru_cache(maxsize=None)(unwrapped)  # type: ignore[attr-defined]


def stored_import_table(module: ModuleType) -> None:
    """The one build left of the models folder's table (0.3-0.4 s), from the previous start's
    (:mod:`.import_table`: invalidated by any change to the folder or to the parser)."""
    build = getattr(module, "create_import_structure_from_path", None)
    code = getattr(getattr(build, "__wrapped__", None), "__code__", None)
    parser = getattr(module, "__file__", None)
    if build is None or code is None or code.co_argcount != 1 or parser is None:
        return
    folder = os.path.join(os.path.dirname(os.path.dirname(parser)), "models")
    if not os.path.isdir(folder):
        return
    from .import_table import StoredImportTable, cache_dir

    store_in = cache_dir()
    if store_in is None:
        return
    stored = StoredImportTable(build, folder, parser, store_in)
    module.create_import_structure_from_path = stored  # type: ignore[attr-defined]


def transformers_import_table(module: ModuleType) -> None:
    unbounded_import_structure_cache(module)
    stored_import_table(module)


GET_SOURCE_NAMES = ("inspect", "getframeinfo", "sys", "_getframe", "filename", "lineno")
"""What torch's ``get_source`` refers to (2.x): a function that refers to anything else has
changed and is left alone."""


def get_source(stacklevel: int) -> str:
    """``torch._library.utils.get_source`` without the source text: the caller's
    ``"file:line"``, as ``inspect.getframeinfo`` gives it, with ``context=0``."""
    frame = inspect.getframeinfo(sys._getframe(stacklevel), context=0)
    return f"{frame.filename}:{frame.lineno}"


def source_position_without_source_text(module: ModuleType) -> None:
    """torch records where each fake (meta) kernel is registered as ``"file:line"``, with
    ``inspect.getframeinfo``, which also reads the caller's source lines, only for them to be
    dropped. Finding them maps every loaded module to its file first (``inspect.getmodule``):
    135 registrations while torch and transformers import, 0.21 s of every start. The same
    ``"file:line"``, from the frame alone (``context=0``: 0.007 s)."""
    original = getattr(module, "get_source", None)
    code = getattr(original, "__code__", None)
    if code is None or code.co_names != GET_SOURCE_NAMES or code.co_argcount != 1:
        return
    module.get_source = get_source  # type: ignore[attr-defined]


FIXES: dict[str, Callable[[ModuleType], None]] = {
    "transformers.utils.import_utils": transformers_import_table,
    "torch._library.utils": source_position_without_source_text,
}
"""Module name -> its fix, run once right after the module is executed."""


class FixAfterImport(importlib.abc.MetaPathFinder):
    """Finds a module in :data:`FIXES` the usual way (``PathFinder``) and runs its fix after
    its loader executes it; every other module is left to the finders after this one."""

    def __init__(self, fixes: dict[str, Callable[[ModuleType], None]]):
        self.fixes = dict(fixes)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        fix = self.fixes.pop(fullname, None)
        if fix is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = spec.loader if spec is not None else None
        execute = getattr(loader, "exec_module", None)
        if spec is None or execute is None:
            return spec  # not a plain module file: imported as it is, unmended

        def exec_module(module: ModuleType) -> None:
            execute(module)
            try:
                fix(module)
            except Exception:  # a fix only saves time: never fail the import for it
                logger.debug("import fix for %s failed", fullname, exc_info=True)

        setattr(loader, "exec_module", exec_module)  # noqa: B010 - this loader, this module only
        return spec


def install() -> None:
    """Register the fixes for the modules not imported yet (once per process)."""
    if any(isinstance(finder, FixAfterImport) for finder in sys.meta_path):
        return
    pending = {name: fix for name, fix in FIXES.items() if name not in sys.modules}
    if pending:
        sys.meta_path.insert(0, FixAfterImport(pending))
