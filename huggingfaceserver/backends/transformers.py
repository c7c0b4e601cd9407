"""The transformers (PyTorch) backend for encoder tasks."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch
import transformers
from transformers import BatchEncoding, PretrainedConfig, PreTrainedTokenizerBase

from ..cli import ServerConfig
from ..encoders import EncoderOptions, EncoderTask, encoder_task_class
from ..errors import StartupError
from ..loading import ModelSource, device, load_tokenizer, resolve_dtype
from .base import EncoderBackend

logger = logging.getLogger(__name__)

# tokenizer.model_max_length is this large when the tokenizer sets no limit
UNSET_MAX_LENGTH = 1_000_000


def resolve_max_length(
    requested: int | None, tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig
) -> int:
    """``--max_length`` checked against what the model can take, or that limit by default."""
    limits = [getattr(config, "max_position_embeddings", None)]
    if tokenizer.model_max_length < UNSET_MAX_LENGTH:
        limits.append(tokenizer.model_max_length)
    known = [int(limit) for limit in limits if limit]
    model_limit = min(known) if known else None
    if requested is None:
        if model_limit is None:
            raise StartupError("the model declares no maximum length; pass --max_length")
        return model_limit
    if model_limit is not None and requested > model_limit:
        raise StartupError(
            f"--max_length {requested} exceeds the model's maximum of {model_limit} tokens"
        )
    return requested


class TransformersEncoder(EncoderBackend):
    """Tokenize and run an ``AutoModelFor...`` in a worker thread."""

    name = "huggingface"

    def __init__(self, source: ModelSource, config: ServerConfig):
        self.source = source
        self.config = config
        self.device = device()
        self.dtype = resolve_dtype(config.dtype, source.task, self.device.type == "cuda")
        self.task_class = encoder_task_class(source.task)

    def load(self) -> None:
        tokenizer = load_tokenizer(self.source, self.config)
        tokenizer.padding_side = "right"  # pooling and per-token trimming assume it
        if tokenizer.pad_token is None:
            raise StartupError(
                "the tokenizer has no padding token, needed to encode several texts at once"
            )
        self.tokenizer = tokenizer
        self.task: EncoderTask = self.task_class(
            tokenizer, self.source, EncoderOptions.from_config(self.config)
        )
        if self.task.needs_offsets and not tokenizer.is_fast:
            raise StartupError("--return_offsets_mapping needs a fast (Rust) tokenizer")
        self.max_length = resolve_max_length(self.config.max_length, tokenizer, self.source.config)
        auto_class = getattr(transformers, self.task.auto_model)
        try:
            model = auto_class.from_pretrained(
                self.source.path,
                config=self.source.config,
                dtype=self.dtype,
                trust_remote_code=self.config.trust_remote_code,
            )
        except (OSError, ValueError) as exc:
            raise StartupError(f"cannot load the model in {self.source.path}: {exc}") from None
        self.model = model.to(self.device).eval()
        self.model_inputs = set(inspect.signature(self.model.forward).parameters)
        logger.info(
            "loaded %s (%s, %s on %s, max length %d)",
            type(self.model).__name__,
            self.task.task.value,
            self.dtype,
            self.device,
            self.max_length,
        )

    def tokenize(self, texts: Sequence[str]) -> BatchEncoding:
        return self.tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self.max_length,
            add_special_tokens=not self.config.disable_special_tokens,
            return_token_type_ids=True if self.config.return_token_type_ids else None,
            return_offsets_mapping=self.task.needs_offsets,
            return_tensors="pt",
        )

    def forward(self, batch: BatchEncoding) -> torch.Tensor:
        """The model's raw output for the task: logits, or the last hidden state."""
        inputs = {k: v.to(self.device) for k, v in batch.items() if k in self.model_inputs}
        with torch.inference_mode():
            output = self.model(**inputs, return_dict=True)
        return getattr(output, self.task.output_field).cpu()

    def infer_sync(self, texts: Sequence[str]) -> list[Any]:
        for index, text in enumerate(texts):
            self.task.check_text(index, text)
        batch = self.tokenize(texts)
        self.task.check_encoding(batch)
        return self.task.results(self.forward(batch), batch)

    async def infer(self, texts: Sequence[str]) -> list[Any]:
        return await asyncio.to_thread(self.infer_sync, texts)
