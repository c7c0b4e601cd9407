"""Import-time costs that are libraries' bugs, mended as the library's module is first executed.

Each fix is a function of the freshly executed module that changes nothing the library computes,
only how often it computes it, and does nothing when the library has changed shape (a newer
release that fixed the bug or renamed what is mended). :func:`install` registers them before the
libraries are imported; the module is executed by its usual loader, the fix runs right after.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
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


FIXES: dict[str, Callable[[ModuleType], None]] = {
    "transformers.utils.import_utils": unbounded_import_structure_cache,
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
