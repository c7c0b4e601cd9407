"""The backend interface the protocol layer talks to."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from ..encoder_tasks import EncoderTask
from ..encoder_tasks.params import DEFAULT_PARAMS, EncodeParams, Instance, Output
from ..errors import NotFound, NotReady
from ..generation.checks import check_generation_request
from ..generation.params import ChoiceDelta, SamplingParams
from ..sentence.prompts import Prompts
from .long_inputs import InputTooLong

if TYPE_CHECKING:
    from ..generation.constraints import LazyGrammars

EncoderInputs = Sequence[str] | Sequence[Sequence[int]]
"""Texts, or already tokenized inputs (token id lists, used as they are)."""


async def renamed(
    call: Awaitable[tuple[list[Any], list[int]]], where: list[int]
) -> tuple[list[Any], list[int]]:
    """``call``'s results; an input it refuses as too long named by its index in the whole
    request (``where``: the request index of each input of the call)."""
    try:
        return await call
    except InputTooLong as exc:
        raise exc.named(f"instance {where[exc.index]}") from None


def unloaded(model_name: str) -> NotReady:
    """What a request fails with (503) once its backend is shut down: the model was unloaded
    (``/v2/repository/models/<name>/unload``), or the server is stopping."""
    return NotReady(f"model {model_name} is not ready: it has been unloaded")


def release_weights(backend: EncoderBackend | GenerationBackend) -> None:
    """Let go of a shut-down backend's weights (its ``model``), once no thread runs them: the
    model object that KServe or a request in flight still holds then keeps only the light
    parts (the tokenizer, the task), which a request under way may still read."""
    if hasattr(backend, "model"):
        delattr(backend, "model")


@dataclass(frozen=True)
class ModelInfo:
    """What a backend tells clients of the model it serves (TEI's ``/info``)."""

    model: str
    """The model's Hub id or folder."""
    dtype: str
    max_input_length: int
    max_batch_tokens: int
    max_batch_size: int
    max_concurrent_requests: int
    truncates: bool
    """Whether inputs over the maximum are truncated by default (``--no_truncation``: no)."""
    pooling: tuple[str, ...] = ()
    """An embedding model's pooling modes (sentence-transformers' names)."""


class EncoderBackend(ABC):
    """Runs an encoder task; the protocol layers cannot tell backends apart.

    ``load`` blocks (it reads weights) and is called once, off the event loop. Nothing else
    runs tokenization or the model on the event loop.
    """

    name: str
    task: EncoderTask
    tokenizer: PreTrainedTokenizerBase
    warms_up = True
    """Whether one inference before readiness is worth it (not for a remote predictor)."""
    prompts: Prompts = Prompts()
    """The model's sentence-transformers prompts and the default one (set by ``load``)."""
    similarity: str = "cosine"
    """How the model's embeddings are compared (its ``similarity_fn_name``)."""

    async def connect(self) -> None:
        """On the event loop, before ``load``: backends served by another process connect."""

    @abstractmethod
    def load(self) -> None:
        """Load tokenizer and weights; afterwards ``task`` is set."""

    def tune(self) -> None:
        """After ``load``, once the machine is otherwise quiet: settle what is measured rather
        than configured (the CPU threads a forward pass gets)."""

    @abstractmethod
    def info(self) -> ModelInfo:
        """What clients are told of the model (once loaded)."""

    @abstractmethod
    async def infer_counted(
        self,
        inputs: EncoderInputs,
        params: EncodeParams = DEFAULT_PARAMS,
        output: Output = Output.task,
    ) -> tuple[list[Any], list[int]]:
        """One result per input, in order (``output`` of ``task``: by default its V1
        predictions), and the number of tokens each input took (a prompt's included)."""

    @abstractmethod
    async def infer_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        params: EncodeParams = DEFAULT_PARAMS,
        output: Output = Output.task,
    ) -> tuple[list[Any], list[int]]:
        """:meth:`infer_counted` for text pairs: sequence classifiers (cross-encoders) only."""

    @abstractmethod
    async def score_pairs(
        self,
        query: str,
        documents: Sequence[str],
        params: EncodeParams = DEFAULT_PARAMS,
        raw: bool = False,
    ) -> tuple[list[float], int]:
        """Cross-encoder relevance of each document to the query (its activation applied;
        ``raw``: its logit), and the tokens used. Only for single-logit sequence classifiers."""

    async def infer(
        self,
        inputs: EncoderInputs,
        params: EncodeParams = DEFAULT_PARAMS,
        output: Output = Output.task,
    ) -> list[Any]:
        results, _ = await self.infer_counted(inputs, params, output)
        return results

    async def infer_instances(
        self,
        items: Sequence[Instance],
        params: EncodeParams = DEFAULT_PARAMS,
        output: Output = Output.task,
    ) -> tuple[list[Any], list[int]]:
        """Texts and text pairs together (a sequence classifier reads both): each answered
        as :meth:`infer_counted` or :meth:`infer_pairs` answers it, in order; a refusal names
        the instance by its index in ``items``."""
        pairs = [i for i, item in enumerate(items) if isinstance(item, tuple)]
        if not pairs:
            return await self.infer_counted(items, params, output)  # type: ignore[arg-type]
        if len(pairs) == len(items):
            return await self.infer_pairs(items, params, output)  # type: ignore[arg-type]
        singles = [i for i, item in enumerate(items) if not isinstance(item, tuple)]
        texts = [item for item in items if isinstance(item, str)]
        text_pairs = [item for item in items if isinstance(item, tuple)]
        parts = await asyncio.gather(
            renamed(self.infer_counted(texts, params, output), singles),
            renamed(self.infer_pairs(text_pairs, params, output), pairs),
        )
        results: list[Any] = [None] * len(items)
        counts = [0] * len(items)
        for where, (part, part_counts) in zip((singles, pairs), parts, strict=True):
            for i, result, count in zip(where, part, part_counts, strict=True):
                results[i], counts[i] = result, count
        return results, counts

    async def watch(self) -> None:
        """Return when the backend can no longer serve; never, for in-process backends."""
        await asyncio.Event().wait()

    def shutdown(self) -> None:
        """Stop serving for good and release what the backend holds (threads, weights):
        called on an unload and on SIGTERM, maybe more than once. Requests under way that it
        cannot finish fail with :func:`unloaded`."""


RUNTIME_LORA_UNSUPPORTED = (
    "LoRA adapters are not loaded or unloaded at run time here: that takes "
    "--enable_runtime_lora, with one process (--api_workers 1) on the transformers backend"
)


class GenerationBackend(ABC):
    """Generates text for token-id prompts; the OpenAI layer cannot tell backends apart.

    ``load`` blocks (weights) and is called once, off the event loop. ``generate`` is an
    async generator of delta lists (one entry per choice that produced something); closing
    it early (a client that went away) stops the generation within a few tokens.
    """

    name: str
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    """Context length: prompt plus generated tokens may not exceed it."""
    is_encoder_decoder: bool = False
    vocab_size: int
    """Token ids a request may name: 0 up to this."""
    adapters: Collection[str]
    """The LoRA adapters served, each under its own model name."""
    grammars: LazyGrammars
    """Structured-output constraints compiled (and so checked) with the model's tokenizer."""
    kv_cache_tokens: int | None = None
    """The KV cache budget of the rows decoded together, in tokens, that a request's ``n``
    choices must fit in together; None: no bound the request is checked against."""

    async def connect(self) -> None:
        """On the event loop, before ``load``: backends served by another process connect."""

    @abstractmethod
    def load(self) -> None:
        """Load tokenizer and weights; afterwards ``tokenizer`` and ``max_model_len`` are set."""

    def tune(self) -> None:
        """After ``load``, once the machine is otherwise quiet: settle what is measured rather
        than configured."""

    def check_request(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> None:
        """Raise :class:`BadRequest` for what the model cannot do (token ids outside its
        vocabulary, an unknown adapter, ...: :func:`.generation.checks.check_generation_request`,
        the same on every backend): called before any response is sent, so a stream never
        starts with an error the request itself carried, and again where the request runs."""
        check_generation_request(
            prompt_ids,
            params,
            adapter,
            self.adapters,
            self.max_model_len,
            self.vocab_size,
            self.is_encoder_decoder,
            self.grammars,
            self.kv_cache_tokens,
        )

    @abstractmethod
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[list[ChoiceDelta]]:
        """Deltas for the ``params.n`` choices as tokens are produced, until all finished.
        ``adapter`` names a LoRA adapter served under its own model name."""

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter at run time, served under ``name`` from then on (where
        ``--enable_runtime_lora`` allows it; else a 404)."""
        raise NotFound(RUNTIME_LORA_UNSUPPORTED)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving a LoRA adapter (409 while requests use it)."""
        raise NotFound(RUNTIME_LORA_UNSUPPORTED)

    async def watch(self) -> None:
        """Return when the backend can no longer serve (a dead engine); the server then
        exits non-zero so that Kubernetes restarts it. Backends that cannot die: never."""
        await asyncio.Event().wait()

    def shutdown(self) -> None:
        """Stop serving for good and release what the backend holds (threads, weights, engine
        processes): called on an unload and on SIGTERM, maybe more than once. Requests under
        way that it cannot finish fail with :func:`unloaded`."""
