"""Where the model is, what it is: location (folder or Hub id), config read once, dtype."""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoTokenizer

from .cli import ServerConfig
from .errors import StartupError
from .startup import STARTUP, importing, imports_done
from .tasks import Task, infer_task

if TYPE_CHECKING:  # transformers' modeling code takes seconds to import: only when it loads
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "*.model",
    "*.tiktoken",
    "chat_template.*",
]

DTYPE_NAMES = {
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ModelSource:
    """A model on local disk, with its config read once."""

    path: Path
    tokenizer_path: Path
    config: PretrainedConfig
    task: Task
    sentence_transformers_modules: list[dict[str, Any]] | None


def _check_folder(path: Path) -> Path:
    if not path.exists():
        raise StartupError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise StartupError(f"model path {path} is not a folder")
    if not os.access(path, os.R_OK | os.X_OK):
        raise StartupError(f"model folder {path} is not readable")
    if not (path / "config.json").is_file():
        raise StartupError(f"model folder {path} has no config.json")
    return path


def _download(model_id: str, revision: str | None, allow_patterns: list[str] | None) -> Path:
    """Fetch (or find in the cache) a Hub snapshot; a progress bar shows while downloading."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        with STARTUP.phase("download"):
            path = snapshot_download(model_id, revision=revision, allow_patterns=allow_patterns)
        return Path(path)
    except LocalEntryNotFoundError as exc:
        raise StartupError(
            f"model {model_id!r} (revision {revision or 'main'}) is not in the local cache "
            f"and cannot be downloaded: {exc}".splitlines()[0]
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StartupError(f"cannot fetch model {model_id!r}: {first_line}") from None


def locate_model(config: ServerConfig) -> tuple[Path, Path]:
    """The local folders of the model and of its tokenizer.

    ``--model_id`` wins over ``--model_dir``; a model id that is an existing folder is used
    as it is. A Hub id is downloaded at ``--model_revision``, and its tokenizer files at
    ``--tokenizer_revision`` when that differs.
    """
    if config.model_id is None:
        path = _check_folder(Path(config.model_dir))
        return path, path
    local = Path(config.model_id)
    if local.is_dir():
        path = _check_folder(local)
        return path, path
    path = _check_folder(_download(config.model_id, config.model_revision, None))
    tokenizer_path = path
    if config.tokenizer_revision not in (None, config.model_revision):
        tokenizer_path = _download(config.model_id, config.tokenizer_revision, TOKENIZER_FILES)
    return path, tokenizer_path


def read_sentence_transformers_modules(path: Path) -> list[dict[str, Any]] | None:
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StartupError(f"cannot read {modules_file}: {exc}") from None
    if not isinstance(modules, list):
        raise StartupError(f"{modules_file} is not a list of modules")
    return modules


def load_source(config: ServerConfig) -> ModelSource:
    """Locate the model, read its config once and settle its task."""
    imports_done()
    path, tokenizer_path = locate_model(config)
    try:
        with STARTUP.phase("config"):
            model_config = AutoConfig.from_pretrained(
                path, trust_remote_code=config.trust_remote_code
            )
    except (OSError, ValueError, KeyError) as exc:
        raise StartupError(f"cannot read the model config in {path}: {exc}") from None
    modules = read_sentence_transformers_modules(path)
    task = config.task or infer_task(model_config.architectures, modules is not None)
    logger.info(
        "model %s: architectures %s, task %s%s",
        path,
        model_config.architectures,
        task.value,
        "" if config.task is None else " (from --task)",
    )
    return ModelSource(path, tokenizer_path, model_config, task, modules)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(flag: str, task: Task, on_gpu: bool) -> torch.dtype:
    """``--dtype``: ``auto`` is float16 on GPU and float32 on CPU; encoders default to float32."""
    if flag != "auto":
        return DTYPE_NAMES[flag]
    if task.is_generative and on_gpu:
        return torch.float16
    return torch.float32


def load_pretrained(
    model_class: Any, source: ModelSource, config: ServerConfig, dtype: torch.dtype
) -> PreTrainedModel:
    """``model_class.from_pretrained`` on the model's folder, on this device, in eval mode."""
    with STARTUP.phase("imports"), importing(freeze=True):
        import transformers.modeling_utils  # noqa: F401 - the bulk of the model's code
    try:
        with STARTUP.phase("weights"):
            model = model_class.from_pretrained(
                source.path,
                config=source.config,
                dtype=dtype,
                trust_remote_code=config.trust_remote_code,
            )
            return model.to(device()).eval()
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot load the model in {source.path}: {exc}") from None


def read_chat_template(value: str | None) -> str | None:
    """``--chat_template``: the Jinja text itself, or the path of a file that holds it."""
    if value is None:
        return None
    path = Path(value)
    if "{" not in value and (path.suffix in (".jinja", ".j2", ".txt") or os.sep in value):
        try:
            return path.read_text()
        except OSError as exc:
            raise StartupError(f"cannot read the chat template file {path}: {exc}") from None
    return value


def load_tokenizer(source: ModelSource, config: ServerConfig) -> PreTrainedTokenizerBase:
    kwargs: dict[str, Any] = {"trust_remote_code": config.trust_remote_code}
    if config.encode_lower_case is not None:
        kwargs["do_lower_case"] = config.encode_lower_case
    try:
        with STARTUP.phase("tokenizer"):
            return AutoTokenizer.from_pretrained(source.tokenizer_path, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise StartupError(f"cannot load the tokenizer in {source.tokenizer_path}: {exc}") from None


def freeze_loaded_heap() -> None:
    """Move what was loaded (it lives as long as the server) out of the collector's way, so
    that a full collection under load no longer scans it (the event loop stalled 100s of ms)."""
    with STARTUP.phase("gc"):
        gc.collect()
        gc.freeze()
    atexit.register(gc.unfreeze)  # collected at exit as before (no leak reports at exit)
