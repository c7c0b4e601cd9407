"""transformers' lazy import table, kept on disk between starts like Python's ``__pycache__``.

``import transformers`` reads every file of its ~550 model folders (about 2,500 files) to learn
what each module exports: 0.3-0.4 s of every start, for a table that changes only when
transformers does. The table of the models folder is stored here, under a name made of a
fingerprint of that folder (every file's and folder's name, size and modification time) and of
the parser's own file, so that any change to either is a miss and the table is built again.
Anything that goes wrong reading or writing the store is a miss too: transformers builds the
table as it always does.

The store is ``$HUGGINGFACESERVER_CACHE``, else ``$XDG_CACHE_HOME/huggingfaceserver``, else
``~/.cache/huggingfaceserver``; the container image fills it when it is built.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FORMAT = 1
"""Bumped when the stored form changes."""
CACHE_ENV = "HUGGINGFACESERVER_CACHE"

Table = dict[Any, Any]
"""transformers' ``create_import_structure_from_path`` result: a folder name maps to its own
table, a frozenset of backends to ``{module: {exported names}}``."""


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path | None:
    """Where the table is stored; None where there is nowhere to (no home directory, as for a
    container user without one and without ``HOME``)."""
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV])
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]) / "huggingfaceserver"
    home = os.path.expanduser("~")
    if home.startswith("~"):
        return None
    return Path(home) / ".cache" / "huggingfaceserver"


def fingerprint(folder: str, parser: str) -> str:
    """A digest of the names, sizes and modification times of everything under ``folder``
    (``__pycache__`` aside) and of the ``parser`` file: 20-40 ms for transformers' models."""
    digest = hashlib.blake2b(digest_size=16)
    stat = os.stat(parser)
    digest.update(f"{FORMAT}\0{folder}\0{parser}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    pending = [folder]
    while pending:
        current = pending.pop()
        with os.scandir(current) as scan:
            entries = sorted(scan, key=lambda entry: entry.name)
        digest.update(f"{current}\n".encode())
        for entry in entries:
            if entry.name == "__pycache__":
                continue
            stat = entry.stat(follow_symlinks=False)
            digest.update(f"{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
    return digest.hexdigest()


def encode(table: Table) -> list[Any]:
    """JSON's form of a table, its order kept (transformers' later passes read it in order)."""
    entries: list[Any] = []
    for key, value in table.items():
        if isinstance(key, frozenset):
            modules = {module: sorted(names) for module, names in value.items()}
            entries.append(["backends", sorted(key), modules])
        else:
            entries.append(["folder", key, encode(value)])
    return entries


def decode(entries: list[Any]) -> Table:
    table: Table = {}
    for kind, key, value in entries:
        if kind == "backends":
            table[frozenset(key)] = {module: set(names) for module, names in value.items()}
        else:
            table[key] = decode(value)
    return table


def load(path: Path) -> Table | None:
    try:
        with open(path, encoding="utf-8") as stored:
            return decode(json.load(stored))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        logger.debug("unreadable import table %s: building it", path, exc_info=True)
        return None


def store(path: Path, table: Table) -> None:
    """Write ``table`` whole or not at all (a temporary file renamed over it), for starts that
    run side by side; a store that cannot be written is left alone."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".import-table-")
    except OSError:
        logger.debug("could not store the import table in %s", path.parent, exc_info=True)
        return
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(encode(table), out, separators=(",", ":"))
        os.chmod(temporary, 0o644)  # not secret: readable by the server's user, whoever stored it
        os.replace(temporary, path)
    except OSError:
        logger.debug("could not store the import table in %s", path, exc_info=True)
        with contextlib.suppress(OSError):
            os.unlink(temporary)


class StoredImportTable:
    """Stands in for transformers' ``create_import_structure_from_path``: the models folder's
    table from the store (or built once and stored), any other folder's from ``build``."""

    def __init__(self, build: Callable[[Any], Table], folder: str, parser: str, store_in: Path):
        self.build = build
        self.folder = folder
        self.parser = parser
        self.store_in = store_in
        self.table: Table | None = None
        self.origin: str | None = None
        """Where the table came from: ``"store"``, or ``"built"`` (then stored if it could be)."""

    def __call__(self, module_path: Any) -> Table:
        path = os.fspath(module_path)
        if os.path.isfile(path):
            path = os.path.dirname(path)
        if path != self.folder:
            return self.build(module_path)
        if self.table is None:
            self.table = self.stored()
        return self.table

    def stored(self) -> Table:
        try:
            name = f"transformers-import-table-{fingerprint(self.folder, self.parser)}.json"
        except OSError:
            self.origin = "built"
            return self.build(self.folder)
        path = self.store_in / name
        table = load(path)
        if table is not None:
            self.origin = "store"
            return table
        self.origin = "built"
        table = self.build(self.folder)
        store(path, table)
        return table
