"""Where the model is, what it is: location (folder or Hub id), config read once, its facts
(context length, weight size, stored dtype), dtype.

Imports neither torch nor transformers' modeling code at module level: a front process and the
supervisor locate the model and settle its task from ``config.json`` alone (the architectures),
and only a process that loads the model reads transformers' config (which imports torch)."""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cli import ServerConfig
from .errors import StartupError
from .model_facts import ModelFacts
from .observability.startup import STARTUP, importing, imports_done
from .sentence.config import SentenceConfig, read_sentence_config
from .tasks import Task, infer_task

if TYPE_CHECKING:  # torch and transformers' modeling code: only where the model loads
    import torch
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
    "*.model.v*",
    "*.tiktoken",
    "tekken.json",
    "chat_template.*",
    "config.json",  # transformers 5's AutoTokenizer reads the model's config too
]
"""What a tokenizer at another revision (``--tokenizer_revision``) is downloaded with."""

TOKENIZER_DEFINITIONS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "*.model",
    "*.model.v*",
    "*.tiktoken",
    "tekken.json",
)
"""Files one of which a folder's tokenizer is made from (without any, transformers 5 makes a
placeholder vocabulary of a few special tokens and every word becomes unknown)."""

DTYPE_NAMES = {
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
}
"""``--dtype`` values, as the names of torch's dtypes."""


@dataclass(frozen=True)
class ModelSource:
    """A model on local disk: where, its task, and its config read once when first asked."""

    path: Path
    tokenizer_path: Path
    task: Task
    sentence: SentenceConfig | None
    """How sentence-transformers reads the folder (None: a folder it did not save)."""
    architectures: list[str]
    """``config.json``'s architectures, as transformers' config has them."""
    trust_remote_code: bool = False

    @cached_property
    def config(self) -> PretrainedConfig:
        """transformers' config of the model, read on first use (it imports torch: the
        processes that do not load the model never ask for it). :class:`StartupError` when
        transformers cannot read it."""
        from transformers import AutoConfig

        try:
            with STARTUP.phase("config"):
                return AutoConfig.from_pretrained(
                    self.path, trust_remote_code=self.trust_remote_code
                )
        except (OSError, ValueError, KeyError) as exc:
            raise StartupError(f"cannot read the model config in {self.path}: {exc}") from None

    @cached_property
    def facts(self) -> ModelFacts:
        """The model's context length, weight size and stored dtype, computed once from
        :attr:`config` and the folder's weight files (it reads the config: see there)."""
        return ModelFacts.of(self.config, self.path)

    def read_config(self) -> None:
        """Read transformers' config now, so that a problem with it stops the start."""
        self.config  # noqa: B018 - the property reads it once


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


def read_config_json(path: Path) -> dict[str, Any]:
    """``config.json`` as JSON (transformers' config imports torch)."""
    try:
        data = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StartupError(f"cannot read the model config in {path}: {exc}") from None
    if not isinstance(data, dict):
        raise StartupError(f"cannot read the model config in {path}: not a JSON object")
    return data


def read_architectures(path: Path, data: dict[str, Any] | None = None) -> list[str]:
    """The architectures ``config.json`` declares (what settles the task)."""
    config_file = path / "config.json"
    if data is None:
        data = read_config_json(path)
    architectures = data.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise StartupError(f"{config_file}: architectures is not a list of names")
    return architectures


def load_source(config: ServerConfig, read_config: bool = True) -> ModelSource:
    """Locate the model and settle its task; ``read_config``: read transformers' config now
    (a problem with it is then a :class:`StartupError` before serving starts); False: when
    first asked (the processes that do not load the model never do)."""
    imports_done()
    path, tokenizer_path = locate_model(config)
    data = read_config_json(path)
    architectures = read_architectures(path, data)
    sentence = read_sentence_config(path, data)
    task = config.task or infer_task(
        architectures, sentence.model_type if sentence is not None else None
    )
    logger.info(
        "model %s: architectures %s, task %s%s",
        path,
        architectures,
        task.value,
        "" if config.task is None else " (from --task)",
    )
    source = ModelSource(
        path, tokenizer_path, task, sentence, architectures, config.trust_remote_code
    )
    if read_config:
        source.read_config()
    return source


def device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(
    flag: str, task: Task, on_gpu: bool, stored: str | None = None, bf16: bool = False
) -> torch.dtype:
    """``--dtype``: ``auto`` is float32 on a CPU and for encoders; a generative model on a GPU
    runs in half precision: bfloat16 where its weights are stored in it (``stored``, torch's
    name) and the GPU computes in it (``bf16``: :func:`gpu_bf16`), as vLLM's ``auto`` does (a
    bf16 model's activations may overflow float16), else float16."""
    import torch

    if flag != "auto":
        return getattr(torch, DTYPE_NAMES[flag])
    if task.is_generative and on_gpu:
        return torch.bfloat16 if stored == "bfloat16" and bf16 else torch.float16
    return torch.float32


def served_dtype(config: ServerConfig, source: ModelSource, on_gpu: bool) -> torch.dtype:
    """The dtype the model is served in (:func:`resolve_dtype`), given what its weights are
    stored in and whether the GPU computes in bfloat16 (both asked on a GPU only)."""
    stored = source.facts.dtype if on_gpu else None
    return resolve_dtype(config.dtype, source.task, on_gpu, stored, on_gpu and gpu_bf16())


def gpu_bf16() -> bool:
    """Whether this machine's GPU computes in bfloat16 (compute capability 8.0 and later)."""
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


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
    except Exception as exc:  # a load failure of any kind is the start's one-line error
        raise StartupError(f"cannot load the model in {source.path}: {described(exc)}") from None


def described(exc: Exception) -> str:
    """A load failure in a line: its message, named by its type where that is not an
    ``OSError`` or ``ValueError`` (an ImportError of a quantizer's package, a truncated
    weights file's SafetensorError)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, (OSError, ValueError)) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def read_chat_template(value: str | None) -> str | None:
    """``--chat_template``: the Jinja text itself, or the path of a file that holds it."""
    if value is None:
        return None
    if any(char in value for char in "{}\n"):  # Jinja: the template itself, as vLLM reads it
        return value
    path = Path(value)
    try:
        return path.read_text()
    except OSError as exc:
        raise StartupError(f"cannot read the chat template file {path}: {exc}") from None


def load_tokenizer(
    source: ModelSource, config: ServerConfig, class_name: str | None = None
) -> PreTrainedTokenizerBase:
    """The model's tokenizer, as ``AutoTokenizer`` picks it; ``class_name``: the class it
    picked in another process (the engine), loaded here without ``AutoTokenizer`` (which reads
    transformers' config, and so imports torch) when transformers exports it."""
    kwargs: dict[str, Any] = {}
    if config.encode_lower_case is not None:
        kwargs["do_lower_case"] = config.encode_lower_case
    tokenizer_class = tokenizer_class_named(class_name)
    folder = source.tokenizer_path
    if not any(any(folder.glob(pattern)) for pattern in TOKENIZER_DEFINITIONS):
        raise StartupError(
            f"no tokenizer in {folder} (none of {', '.join(TOKENIZER_DEFINITIONS)}): save it "
            "beside the model (tokenizer.save_pretrained)"
        )
    try:
        with STARTUP.phase("tokenizer"):
            if tokenizer_class is not None:
                return tokenizer_class.from_pretrained(source.tokenizer_path, **kwargs)
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(
                source.tokenizer_path, trust_remote_code=config.trust_remote_code, **kwargs
            )
    except Exception as exc:  # sentencepiece's conversion, a tokenizer.json of a newer format
        raise StartupError(
            f"cannot load the tokenizer in {source.tokenizer_path}: {described(exc)}"
        ) from None


def tokenizer_class_name(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The name under which transformers exports ``tokenizer``'s class (None: a class of the
    model's own code, or one transformers does not export)."""
    import transformers

    name = type(tokenizer).__name__
    return name if getattr(transformers, name, None) is type(tokenizer) else None


def tokenizer_class_named(name: str | None) -> Any:
    """transformers' tokenizer class ``name`` (None for None or a name it does not export)."""
    if name is None:
        return None
    import transformers

    from_transformers = getattr(transformers, name, None)
    return from_transformers if isinstance(from_transformers, type) else None


def freeze_loaded_heap() -> None:
    """Move what was loaded (it lives as long as the server) out of the collector's way, so
    that a full collection under load no longer scans it (the event loop stalled 100s of ms)."""
    with STARTUP.phase("gc"):
        gc.collect()
        gc.freeze()
    atexit.register(gc.unfreeze)  # collected at exit as before (no leak reports at exit)
