"""LoRA adapters named at startup (``--enable-lora --lora-modules name=path ...``, vLLM's flags),
read the same way for both generation backends: vLLM serves them itself, the transformers
backend loads them with PEFT (:mod:`.pytorch.adapters`). Each adapter is served under its own
model name. With ``--enable_runtime_lora`` adapters are also loaded and unloaded at run time
(:class:`ServedAdapters`), from inside ``--lora_adapter_dir`` only."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..cli import ServerConfig
from ..errors import BadRequest, Conflict, NotFound, StartupError


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str


def parse_lora_modules(values: list[str]) -> list[LoraModule]:
    """``--lora-modules name=path ...`` (or vLLM's JSON form ``{"name": ..., "path": ...}``)."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                modules.append(LoraModule(spec["name"], spec["path"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise StartupError(f"--lora-modules {value!r}: {exc}") from None
            continue
        name, sep, path = value.partition("=")
        if not (sep and name and path):
            raise StartupError(f"--lora-modules takes name=path, not {value!r}")
        modules.append(LoraModule(name, path))
    return modules


def lora_modules(config: ServerConfig) -> list[LoraModule]:
    """The adapters to serve, checked before anything loads: ``--enable-lora`` given, names
    unique and not the model's own, every path there."""
    modules = parse_lora_modules(config.engine_flags.get("lora-modules", []))
    if modules and "enable-lora" not in config.engine_flags:
        raise StartupError("--lora-modules needs --enable-lora")
    names = [module.name for module in modules]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise StartupError(f"--lora-modules names an adapter twice: {', '.join(repeated)}")
    if config.model_name in names:
        raise StartupError(
            f"LoRA adapter {config.model_name}: the served model's own name (--model_name)"
        )
    for module in modules:
        if not Path(module.path).exists():
            raise StartupError(f"LoRA adapter {module.name}: {module.path} does not exist")
    return modules


def runtime_lora_dir(config: ServerConfig) -> Path | None:
    """The folder that adapters loaded at run time must be in (symlinks resolved), checked at
    startup; None when ``--enable_runtime_lora`` is off."""
    if not config.enable_runtime_lora:
        return None
    if "enable-lora" not in config.engine_flags:
        raise StartupError("--enable_runtime_lora needs --enable-lora")
    if not config.lora_adapter_dir:
        raise StartupError(
            "--enable_runtime_lora needs --lora_adapter_dir: the folder adapters are loaded from"
        )
    folder = Path(config.lora_adapter_dir).resolve()
    if not folder.is_dir():
        raise StartupError(f"--lora_adapter_dir {config.lora_adapter_dir} is not a folder")
    return folder


def served_adapters(config: ServerConfig) -> ServedAdapters:
    """The adapters named at startup, and whether more are loaded at run time."""
    return ServedAdapters(lora_modules(config), runtime_lora_dir(config), config.model_name)


class ServedAdapters:
    """The adapters a backend serves, by name (iterating gives the names), and the bookkeeping
    of run-time loads: names being loaded, and the requests under way per adapter (an adapter
    in use is not unloaded). Used on the event loop only."""

    def __init__(self, modules: list[LoraModule], folder: Path | None, model_name: str):
        self.modules = {module.name: module for module in modules}
        self.folder = folder
        """``--lora_adapter_dir``, resolved; None: no loading at run time."""
        self.model_name = model_name
        self.loading: set[str] = set()
        self.users: Counter[str] = Counter()

    def __iter__(self) -> Iterator[str]:
        return iter(self.modules)

    def __contains__(self, name: object) -> bool:
        return name in self.modules

    def __len__(self) -> int:
        return len(self.modules)

    @property
    def runtime(self) -> bool:
        return self.folder is not None

    def check_runtime(self) -> Path:
        if self.folder is None:
            raise NotFound(
                "LoRA adapters are not loaded or unloaded at run time: start the server with "
                "--enable_runtime_lora --lora_adapter_dir DIR"
            )
        return self.folder

    def begin_load(self, name: str, path: str) -> LoraModule:
        """The adapter a load request names, its path inside ``--lora_adapter_dir``; the
        name is held until :meth:`end_load`. 404 when loading at run time is off; 400 for a
        name in use or a path outside the folder (a relative path is read inside it)."""
        folder = self.check_runtime()
        if not name or name == self.model_name or name in self.modules or name in self.loading:
            raise BadRequest(f"The lora adapter '{name}' has already been loaded.")
        resolved = (folder / path).resolve()
        if not resolved.is_relative_to(folder):
            raise BadRequest(f"LoRA adapter {name}: {path} is outside --lora_adapter_dir")
        if not resolved.is_dir():
            raise BadRequest(f"LoRA adapter {name}: no adapter folder at {path}")
        self.loading.add(name)
        return LoraModule(name, str(resolved))

    def end_load(self, module: LoraModule, loaded: bool) -> None:
        self.loading.discard(module.name)
        if loaded:
            self.modules[module.name] = module

    def begin_unload(self, name: str) -> LoraModule:
        """Stop serving the adapter (new requests naming it are refused): 404 for an unknown
        name, 409 while requests use it."""
        self.check_runtime()
        if name not in self.modules:
            raise NotFound(f"The lora adapter '{name}' cannot be found.")
        if self.users[name]:
            raise Conflict(
                f"LoRA adapter {name} is in use by {self.users[name]} requests: unload it once "
                "they are done"
            )
        return self.modules.pop(name)

    def acquire(self, adapter: str | None) -> None:
        """A request starts decoding with ``adapter`` (None: the base model); 400 for one
        unloaded since the request was checked. :meth:`release` once it is done."""
        if adapter is None:
            return
        if adapter not in self.modules:
            raise BadRequest(f"unknown LoRA adapter {adapter!r}")
        self.users[adapter] += 1

    def release(self, adapter: str | None) -> None:
        if adapter is not None:
            self.users[adapter] -= 1

    @contextmanager
    def use(self, adapter: str | None) -> Iterator[None]:
        """While a request decodes with ``adapter`` (:meth:`acquire`, :meth:`release`)."""
        self.acquire(adapter)
        try:
            yield
        finally:
            self.release(adapter)
