"""Sentence embeddings on vLLM's pooling runner (only with an explicit ``--backend vllm``).

The protocol layers cannot tell it from the transformers backend: same V1/V2 shapes (the
text_embedding task formats the results), same ``/v1/embeddings`` and ``/v1/rerank``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from ...cli import ServerConfig
from ...encoders import EncoderOptions
from ...encoders.embedding import TextEmbedding
from ...errors import BadRequest, StartupError
from ...loading import ModelSource, load_tokenizer
from ...tasks import Task
from ..base import EncoderBackend, EncoderInputs
from ..encoding import InputEncoder
from ..tokenizing import check_token_inputs, resolve_max_length
from . import compat
from .engine import EngineHolder
from .engine_args import build_engine_args


class VLLMEmbedder(EngineHolder, EncoderBackend):
    name = "vllm"

    def __init__(
        self, source: ModelSource, config: ServerConfig, kv_cache_bytes: int | None = None
    ):
        if source.task is not Task.text_embedding:
            raise StartupError(
                f"the vLLM backend serves text_embedding among encoder tasks, not "
                f"{source.task.value}: use --backend huggingface"
            )
        self.source = source
        self.config = config
        self.engine_args = build_engine_args(source, config, kv_cache_bytes)

    def load(self) -> None:
        self.tokenizer = load_tokenizer(self.source, self.config)
        options = EncoderOptions.from_config(self.config)
        self.task = TextEmbedding(self.tokenizer, self.source, options)
        self.max_length = resolve_max_length(
            self.config.max_length, self.tokenizer, self.source.config
        )
        self.encoder = InputEncoder(
            self.tokenizer,
            self.max_length,
            add_special_tokens=not self.config.disable_special_tokens,
            truncate=not self.config.no_truncation,
        )
        self.start_engine()

    def token_ids(self, inputs: EncoderInputs) -> list[list[int]]:
        """Texts tokenized as the transformers backend does (over-long texts truncated, or
        refused with ``--no_truncation``, never tokenized whole), or token ids checked."""
        if inputs and isinstance(inputs[0], str):
            rows = self.encoder.texts(list(inputs))  # type: ignore[arg-type]
            return [[int(i) for i in row["input_ids"]] for row in rows]
        ids_lists: list[list[int]] = [list(ids) for ids in inputs]  # type: ignore[arg-type]
        check_token_inputs(ids_lists, len(self.tokenizer), self.max_length)
        return ids_lists

    async def _embed(self, ids: list[int]) -> list[float]:
        final: Any = None
        stream = self.engine.encode(
            compat.TokensPrompt(prompt_token_ids=ids), compat.embed_params(), uuid.uuid4().hex
        )
        async for output in stream:
            final = output
        return final.outputs.data.float().tolist()

    async def infer_counted(self, inputs: EncoderInputs) -> tuple[list[Any], list[int]]:
        ids_lists = await asyncio.to_thread(self.token_ids, inputs)
        vectors = await asyncio.gather(*(self._embed(ids) for ids in ids_lists))
        return list(vectors), [len(ids) for ids in ids_lists]

    async def score_pairs(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:
        raise BadRequest("cross-encoder scoring runs on the transformers backend")
