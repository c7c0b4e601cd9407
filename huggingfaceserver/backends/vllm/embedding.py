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
from ...encoder_tasks import EncoderOptions
from ...encoder_tasks.embedding import TextEmbedding
from ...encoder_tasks.params import DEFAULT_PARAMS, EncodeParams, Output
from ...errors import BadRequest, EngineDied, StartupError
from ...loading import ModelSource, load_tokenizer
from ...sentence.config import pooling_modes
from ...sentence.similarity import unit
from ...tasks import Task
from ..base import EncoderBackend, EncoderInputs, ModelInfo
from ..row_tokenizer import RowTokenizer
from ..tokenizing import SentenceSettings, check_rows_have_tokens, token_inputs
from ..truncation import Truncation, asked_truncation
from . import compat
from .engine import ENGINE_DIED, EngineHolder
from .engine_args import build_engine_args

SERVED_OUTPUTS = frozenset({Output.task, Output.normalized})
"""What vLLM's pooling runner gives: the model's embedding (normalised as the model does)."""


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
        sentence = self.source.sentence
        if sentence is not None and sentence.excludes_prompt:
            raise StartupError(
                "the vLLM backend pools prompts with the text; this model leaves them out "
                "(include_prompt: false): use --backend huggingface or onnx"
            )
        settings = SentenceSettings.adopt(
            self.source, self.config, self.tokenizer, self.source.config
        )
        self.max_length, self.prompts, self.similarity = settings
        options = EncoderOptions.from_config(self.config)
        self.task = TextEmbedding(self.tokenizer, self.source, options)
        self.inputs = RowTokenizer(
            self.tokenizer,
            self.max_length,
            add_special_tokens=not self.config.disable_special_tokens,
            truncate=not self.config.no_truncation,
        )
        self.start_engine()

    def token_ids(self, inputs: EncoderInputs, params: EncodeParams) -> list[list[int]]:
        """Texts tokenized as the transformers backend does (the prompt before each, over-long
        texts truncated or refused, never tokenized whole), or token ids checked."""
        if inputs and isinstance(inputs[0], str):
            prompt = self.prompts.text(params)
            texts = [prompt + text for text in inputs]  # type: ignore[operator]
            rows = self.inputs.texts(texts, self.truncation(params))
            check_rows_have_tokens(rows)
            return [[int(i) for i in row["input_ids"]] for row in rows]
        if params.asks_prompt:
            raise BadRequest("a prompt applies to texts; token ids are used as they are")
        truncation = self.truncation(params)
        return token_inputs(inputs, truncation, len(self.tokenizer), self.max_length)

    def info(self) -> ModelInfo:
        return ModelInfo(
            self.config.model_id or self.config.model_dir,
            self.config.dtype,
            self.max_length,
            self.config.max_batch_tokens,
            self.config.max_batch_size or 0,
            self.config.max_concurrent_requests,
            not self.config.no_truncation,
            pooling_modes(self.source.sentence),
        )

    def truncation(self, params: EncodeParams) -> Truncation | None:
        """A request's own truncation, to at most the maximum (vLLM's engine takes the ids)."""
        return asked_truncation(params, self.inputs.default, self.inputs.text_specials)

    async def _embed(self, ids: list[int]) -> list[float]:
        final: Any = None
        stream = self.engine.encode(
            compat.TokensPrompt(prompt_token_ids=ids), compat.embed_params(), uuid.uuid4().hex
        )
        try:
            async for output in stream:
                final = output
        except compat.EngineDeadError:
            raise EngineDied(ENGINE_DIED) from None
        return final.outputs.data.float().tolist()

    async def infer_counted(
        self,
        inputs: EncoderInputs,
        params: EncodeParams = DEFAULT_PARAMS,
        output: Output = Output.task,
    ) -> tuple[list[Any], list[int]]:
        if output not in SERVED_OUTPUTS:
            raise BadRequest(f"{output.value} results are served by the transformers backend")
        ids_lists = await asyncio.to_thread(self.token_ids, inputs, params)
        vectors = list(await asyncio.gather(*(self._embed(ids) for ids in ids_lists)))
        if output is Output.normalized:
            vectors = unit(vectors).tolist()
        return vectors, [len(ids) for ids in ids_lists]

    async def infer_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        params: EncodeParams = DEFAULT_PARAMS,
        output: Output = Output.task,
    ) -> tuple[list[Any], list[int]]:
        raise BadRequest("text pairs are read by sequence classifiers; this is an embedding model")

    async def score_pairs(
        self,
        query: str,
        documents: Sequence[str],
        params: EncodeParams = DEFAULT_PARAMS,
        raw: bool = False,
    ) -> tuple[list[float], int]:
        raise BadRequest("cross-encoder scoring runs on the transformers backend")
