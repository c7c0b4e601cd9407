"""Exports kept between starts, in the server's cache directory (:func:`cache_dir`):
``onnx/<key>/model.onnx`` and its ``record.json``.

The key is a digest of the model's files (their contents: config, weights, a shipped export),
of what the graph is for (:class:`~.export.GraphSpec`) and of the versions of the libraries that
make and run it, so that a changed model or an upgrade is a miss. A folder appears whole or not
at all: it is built under a temporary name and renamed into place. One that does not read back
(no record, a file of another size, a graph ONNX Runtime refuses) is removed and built again.
Where the cache cannot be written the export is built in a temporary folder, used and removed:
the start pays for the export, nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TypeVar

from ...cli import CACHE_ENV as CACHE_ENV
from ...cli import cache_dir as cache_dir  # read once into ServerConfig.cache_dir by parsing
from ...loading import ModelSource
from . import OnnxUnavailable
from .export import SHIPPED_FILES, GraphSpec, build

logger = logging.getLogger(__name__)

FORMAT = 1
"""Bumped whenever the export recipe changes: every stored export is then a miss."""
LIBRARIES = ("torch", "transformers", "onnxruntime", "onnx")
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".json")
"""Files of the model folder that change its graph (weights, config, weight index)."""
GRAPH_FILE = "model.onnx"
RECORD_FILE = "record.json"

S = TypeVar("S")


def library_versions() -> dict[str, str]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "none"
    return versions


def model_files(folder: Path) -> list[Path]:
    """The files whose contents make the graph: config and weights at the top of the folder,
    and a shipped export with its external data."""
    files = [
        path
        for path in sorted(folder.iterdir())
        if path.is_file() and path.suffix in MODEL_FILE_SUFFIXES and "token" not in path.name
    ]
    for relative in SHIPPED_FILES:
        shipped = folder / relative
        files += sorted(p for p in shipped.parent.glob(shipped.name + "*") if p.is_file())
    return files


def export_key(
    source: ModelSource, spec: GraphSpec, libraries: dict[str, str] | None = None
) -> str:
    """A digest of the model's files' contents, the spec, the recipe and the libraries'
    versions (``libraries``: those installed)."""
    digest = hashlib.blake2b(digest_size=16)
    versions = libraries if libraries is not None else library_versions()
    digest.update(json.dumps([FORMAT, asdict(spec), versions]).encode())
    for path in model_files(source.path):
        digest.update(f"\n{path.relative_to(source.path)}\0".encode())
        with open(path, "rb") as handle:
            digest.update(hashlib.file_digest(handle, "blake2b").digest())
    return digest.hexdigest()


@dataclass
class StoredGraph:
    path: Path
    """The graph (``model.onnx``; external weights beside it)."""
    record: dict[str, Any]
    origin: str
    """``cache`` (read back), ``built`` (and stored) or ``built, not stored``."""


class ExportStore:
    """The exports under ``root`` (None: no cache; every start exports)."""

    def __init__(self, root: Path | None):
        self.root = root

    @classmethod
    def in_cache(cls, cache: Path | None) -> ExportStore:
        """The exports in the server's cache directory (``ServerConfig.cache_dir``)."""
        return cls(cache / "onnx" if cache is not None else None)

    @classmethod
    def default(cls) -> ExportStore:
        """The exports in the cache directory the environment names now (callers with a config:
        :meth:`in_cache` with its ``cache_dir``, read once at parsing)."""
        return cls.in_cache(cache_dir())

    def open(
        self,
        source: ModelSource,
        spec: GraphSpec,
        trust_remote_code: bool,
        use: Callable[[StoredGraph], S],
    ) -> S:
        """``use(graph)`` on the stored export for the model, built first when there is none
        (or it is damaged). ``use`` loads the graph: an error there (a graph ONNX Runtime
        refuses) means a damaged entry, removed and built once again."""
        key = export_key(source, spec)
        if self.root is not None:
            stored = self.read(self.root / key)
            if stored is not None:
                try:
                    return use(stored)
                except OnnxUnavailable as exc:
                    logger.warning(
                        "the stored export %s is damaged (%s): building it again",
                        stored.path.parent,
                        exc,
                    )
                    shutil.rmtree(stored.path.parent, ignore_errors=True)
            folder = self.build_into_store(source, spec, trust_remote_code, key)
            if folder is not None:
                built = self.read(folder)
                if built is None:
                    raise OnnxUnavailable(f"the export stored in {folder} does not read back")
                built.origin = "built"
                return use(built)
        with tempfile.TemporaryDirectory(prefix="huggingfaceserver-onnx-") as temporary:
            folder = Path(temporary) / key
            record = self.build_folder(source, spec, trust_remote_code, folder)
            return use(StoredGraph(folder / GRAPH_FILE, record, "built, not stored"))

    def read(self, folder: Path) -> StoredGraph | None:
        """The entry in ``folder``, if it is whole."""
        try:
            record = json.loads((folder / RECORD_FILE).read_text())
            graph = folder / GRAPH_FILE
            sizes = {name: (folder / name).stat().st_size for name in record["files"]}
        except FileNotFoundError:
            if not folder.exists():
                return None
            logger.warning("the stored export %s is incomplete: building it again", folder)
            shutil.rmtree(folder, ignore_errors=True)
            return None
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("the stored export %s is damaged: building it again", folder)
            shutil.rmtree(folder, ignore_errors=True)
            return None
        if sizes != record["files"]:
            logger.warning("the stored export %s is incomplete: building it again", folder)
            shutil.rmtree(folder, ignore_errors=True)
            return None
        return StoredGraph(graph, record, "cache")

    def build_into_store(
        self, source: ModelSource, spec: GraphSpec, trust_remote_code: bool, key: str
    ) -> Path | None:
        """The export built under a temporary name in the store and renamed to ``key``; None
        when the store cannot be written (the caller builds elsewhere)."""
        assert self.root is not None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            building = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.root))
        except OSError as exc:
            logger.info("the export cache %s cannot be written (%s): not stored", self.root, exc)
            return None
        final = self.root / key
        try:
            self.build_folder(source, spec, trust_remote_code, building)
            os.chmod(building, 0o755)
            try:
                os.rename(building, final)
            except OSError:
                # another start stored the same export first: use theirs, unless it is
                # damaged (then read removes it, and ours takes its place)
                if self.read(final) is None:
                    os.rename(building, final)
            return final
        except OSError as exc:
            logger.info("the export could not be stored in %s (%s)", self.root, exc)
            return None
        finally:
            shutil.rmtree(building, ignore_errors=True)

    @staticmethod
    def build_folder(
        source: ModelSource, spec: GraphSpec, trust_remote_code: bool, folder: Path
    ) -> dict[str, Any]:
        """Build the graph into ``folder`` with its record, written last."""
        folder.mkdir(parents=True, exist_ok=True)
        work = folder / "work"
        work.mkdir()
        start = time.monotonic()
        try:
            built = build(source, spec, folder / GRAPH_FILE, work, trust_remote_code)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        files = {
            path.name: path.stat().st_size for path in sorted(folder.iterdir()) if path.is_file()
        }
        record = {
            "format": FORMAT,
            "model": str(source.path),
            "spec": asdict(spec),
            "libraries": library_versions(),
            "built": asdict(built),
            "build_seconds": round(time.monotonic() - start, 2),
            "files": files,
        }
        for path in folder.iterdir():
            with contextlib.suppress(OSError):
                os.chmod(path, 0o644)
        (folder / RECORD_FILE).write_text(json.dumps(record, indent=1))
        os.chmod(folder / RECORD_FILE, 0o644)
        logger.info(
            "exported the model to ONNX in %.1f s: %s",
            record["build_seconds"],
            built.describe(),
        )
        return record
