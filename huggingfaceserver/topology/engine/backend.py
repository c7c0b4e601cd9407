"""Backends of a front process: the model runs in the engine process, everything else here.

The encoder checks and tokenizes here and sends token ids; the engine batches them with every
other front's and sends the task's results back. The generator tokenizes prompts and makes the
text here (incremental detokenization, stop strings) from the token ids the engine streams,
and tells the engine when a stop string ended a choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from transformers import BatchEncoding, PreTrainedTokenizerBase

from ...backends.base import GenerationBackend
from ...backends.lora import LoraModule, lora_modules
from ...backends.row_tokenizer import Row
from ...backends.tokenizing import EncoderFacts, TokenizingEncoder
from ...cli import ServerConfig
from ...errors import EngineDied, StartupError
from ...generation.constraints import LazyGrammars
from ...generation.params import ChoiceDelta, SamplingParams
from ...generation.text import ChoiceText
from ...loading import ModelSource, load_tokenizer
from .client import ENGINE_STOPPED, EngineClient

if TYPE_CHECKING:
    import torch


class ServedByEngine:
    """What both front backends do with the engine: connect before loading, stop serving when
    it is lost, close the connection at shutdown."""

    client: EngineClient

    async def connect(self) -> None:
        await self.client.start()

    async def watch(self) -> None:
        await self.client.wait_lost()
        raise EngineDied(ENGINE_STOPPED)

    def shutdown(self) -> None:
        self.client.close()


class EngineEncoder(ServedByEngine, TokenizingEncoder):
    """An encoder task tokenized here and run by the engine."""

    name = "huggingface"

    def __init__(self, source: ModelSource, config: ServerConfig, client: EngineClient):
        super().__init__(source, config)
        self.client = client

    def load(self) -> None:
        """Once the engine has loaded the model: its facts and tokenizer class come from
        there (this process reads neither the model's config nor its weights)."""
        self.state = self.client.wait_ready()
        super().load()

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.source, self.config, self.state.tokenizer_class)

    def model_facts(self) -> EncoderFacts:
        if self.state.encoder is None:
            raise StartupError("the engine serves no encoder model")
        return self.state.encoder

    def load_head(self) -> None:
        """Nothing: the engine makes the results."""

    def preparing(self) -> AbstractContextManager[None]:
        return nullcontext()  # the engine batches what arrives; nothing here to wait for

    def submit_rows(self, rows: list[Row], kind: str) -> Awaitable[list[Any]]:
        return self.client.encode(rows, kind)

    def forward_batch(self, batch: BatchEncoding) -> torch.Tensor:
        raise NotImplementedError("the engine process runs the model")


class EngineGenerator(ServedByEngine, GenerationBackend):
    """A generative model decoded by the engine; prompts and text are made here."""

    name = "huggingface"

    def __init__(self, source: ModelSource, config: ServerConfig, client: EngineClient):
        self.source = source
        self.config = config
        self.client = client
        if config.enable_runtime_lora:
            raise StartupError(
                "--enable_runtime_lora needs one process (--api_workers 1): each front process "
                "would serve its own list of adapters"
            )
        self.adapters: dict[str, LoraModule] = {m.name: m for m in lora_modules(config)}
        """The LoRA adapters the engine serves, each under its own model name."""

    def load(self) -> None:
        state = self.client.wait_ready()
        self.tokenizer = load_tokenizer(self.source, self.config, state.tokenizer_class)
        facts = state.facts
        if facts is None:
            raise StartupError("the engine serves no generative model")
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self.is_encoder_decoder = facts.is_encoder_decoder
        self.kv_cache_tokens = facts.kv_cache_tokens
        self.grammars = LazyGrammars.for_tokenizer(self.tokenizer, self.vocab_size)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[list[ChoiceDelta]]:
        """The engine's token deltas with their text; a choice that a stop string ended here
        is stopped there too, and leaving early aborts the whole request."""
        if params.constraint is None:
            self.check_request(prompt_ids, params, adapter)
        else:  # a grammar is compiled and checked: not on the event loop
            await asyncio.to_thread(self.check_request, prompt_ids, params, adapter)
        texts = [ChoiceText.for_params(self.tokenizer, params) for _ in range(params.n)]
        running = set(range(params.n))
        request_id, queue = self.client.generate(prompt_ids, params, adapter)
        try:
            while running and (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                out, stopped = [], []
                for delta in item:
                    if delta.index not in running:
                        continue  # ended here by a stop string; the engine is told
                    [token_id] = delta.token_ids
                    text, reason = texts[delta.index].take(token_id, delta.finish_reason)
                    out.append(replace(delta, text=text, finish_reason=reason))
                    if reason is not None:
                        running.discard(delta.index)
                        if delta.finish_reason is None:
                            stopped.append(delta.index)
                if stopped and running:
                    self.client.abort(request_id, stopped)
                if out:
                    yield out
        finally:
            self.client.abort(request_id)  # a no-op when the engine has finished it


def engine_backend(
    source: ModelSource, config: ServerConfig, client: EngineClient
) -> EngineEncoder | EngineGenerator:
    """A front process's backend for the model at ``source``: it runs in the engine process."""
    if source.task.is_generative:
        return EngineGenerator(source, config, client)
    return EngineEncoder(source, config, client)
