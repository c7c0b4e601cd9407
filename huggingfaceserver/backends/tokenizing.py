"""What every backend that tokenizes with the model's own tokenizer shares."""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import torch
from transformers import BatchEncoding, PretrainedConfig, PreTrainedTokenizerBase

from ..cli import ServerConfig
from ..encoders import EncoderOptions, EncoderTask, encoder_task_class
from ..encoders.base import lengths
from ..errors import BadRequest, StartupError
from ..loading import ModelSource, load_tokenizer
from ..tasks import Task
from .base import EncoderBackend, EncoderInputs
from .batching import BatchLimits, EncoderBatcher, Row, split_rows

T = TypeVar("T")

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


def check_token_inputs(inputs: list[list[int]], vocab: int, max_length: int) -> None:
    """Token id inputs (used as they are) must be non-empty, fit, and be in the vocabulary."""
    for index, ids in enumerate(inputs):
        if not ids:
            raise BadRequest(f"input {index} has no tokens")
        if len(ids) > max_length:
            raise BadRequest(f"input {index} has {len(ids)} tokens; the maximum is {max_length}")
        if not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise BadRequest(f"input {index} has token ids outside the vocabulary (0..{vocab - 1})")


class TokenizingEncoder(EncoderBackend):
    """Loads the tokenizer and the task; turns texts into a checked, padded batch."""

    def __init__(self, source: ModelSource, config: ServerConfig):
        self.source = source
        self.config = config
        self.task_class = encoder_task_class(source.task)
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

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
        self.load_model()
        pad_values = {
            "input_ids": tokenizer.pad_token_id,
            "token_type_ids": tokenizer.pad_token_type_id,
        }
        limits = BatchLimits(
            self.config.max_batch_tokens,
            self.config.max_batch_size,
            self.config.batch_wait_ms / 1000,
        )
        self.batcher = EncoderBatcher(self.run_rows, pad_values, limits)

    def load_model(self) -> None:
        """Whatever the backend needs beyond the tokenizer (weights, a client)."""

    @abstractmethod
    async def run(self, batch: BatchEncoding) -> torch.Tensor:
        """The model's raw output for a batch: logits, or the last hidden state."""

    async def infer_counted(self, inputs: EncoderInputs) -> tuple[list[Any], list[int]]:
        """Checked and tokenized alone, then run in batches shared with other requests."""
        with self.batcher.expect():
            batch, rows = await self.off_loop(self.prepare_rows, inputs)
            results = self.batcher.put(rows)
        return await results, lengths(batch)

    async def off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` on the tokenizing thread. One thread, not a pool: tokenization
        is mostly Python under the GIL, so more threads would add little but contention with
        the event loop and the batcher's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizing, partial(function, *args))

    def prepare_rows(self, inputs: EncoderInputs) -> tuple[BatchEncoding, list[Row]]:
        batch = self.prepare_inputs(inputs)
        return batch, split_rows(batch)

    def run_rows(self, batch: BatchEncoding, loop: asyncio.AbstractEventLoop) -> list[Any]:
        """One merged batch through the model, a result per row (on the batcher's thread:
        ``run`` goes to the event loop)."""
        raw = asyncio.run_coroutine_threadsafe(self.run(batch), loop).result()
        return self.task.results(raw, batch)

    async def score_pairs(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:
        if self.task.task is not Task.sequence_classification or self.source.config.num_labels != 1:
            raise BadRequest("relevance scores need a cross-encoder (one-label classifier)")
        batch = await self.off_loop(self.prepare_pairs, query, documents)
        logits = await self.run(batch)
        return torch.sigmoid(logits[:, 0].float()).tolist(), sum(lengths(batch))

    def prepare_inputs(self, inputs: EncoderInputs) -> BatchEncoding:
        if inputs and not isinstance(inputs[0], str):
            return self.prepare_ids([list(ids) for ids in inputs])  # type: ignore[arg-type]
        return self.prepare(inputs)  # type: ignore[arg-type]

    def prepare_ids(self, inputs: list[list[int]]) -> BatchEncoding:
        """Token id inputs, used as they are (no special tokens added), checked and padded."""
        check_token_inputs(inputs, len(self.tokenizer), self.max_length)
        batch = self.tokenizer.pad({"input_ids": inputs}, padding=True, return_tensors="pt")
        self.task.check_encoding(batch)
        return batch

    def prepare_pairs(self, query: str, documents: Sequence[str]) -> BatchEncoding:
        """(query, document) pairs for a cross-encoder, truncated to the maximum length."""
        return self.tokenizer(
            [query] * len(documents),
            list(documents),
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )

    def prepare(self, texts: Sequence[str]) -> BatchEncoding:
        """Check and tokenize a request's texts (blocking: call it off the event loop)."""
        for index, text in enumerate(texts):
            self.task.check_text(index, text)
        batch = self.tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self.max_length,
            add_special_tokens=not self.config.disable_special_tokens,
            return_token_type_ids=True if self.config.return_token_type_ids else None,
            return_offsets_mapping=self.task.needs_offsets,
            return_tensors="pt",
        )
        self.task.check_encoding(batch)
        return batch
