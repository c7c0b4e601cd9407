"""The backend interface the protocol layer talks to."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..encoders import EncoderTask
from ..errors import NotReady
from ..generation.params import ChoiceDelta, SamplingParams

EncoderInputs = Sequence[str] | Sequence[Sequence[int]]
"""Texts, or already tokenized inputs (token id lists, used as they are)."""


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


class EncoderBackend(ABC):
    """Runs an encoder task; the protocol layers cannot tell backends apart.

    ``load`` blocks (it reads weights) and is called once, off the event loop. Nothing else
    runs tokenization or the model on the event loop.
    """

    name: str
    task: EncoderTask
    warms_up = True
    """Whether one inference before readiness is worth it (not for a remote predictor)."""

    async def connect(self) -> None:
        """On the event loop, before ``load``: backends served by another process connect."""

    @abstractmethod
    def load(self) -> None:
        """Load tokenizer and weights; afterwards ``task`` is set."""

    def tune(self) -> None:
        """After ``load``, once the machine is otherwise quiet: settle what is measured rather
        than configured (the CPU threads a forward pass gets)."""

    @abstractmethod
    async def infer_counted(self, inputs: EncoderInputs) -> tuple[list[Any], list[int]]:
        """One result per input, in order (the V1 predictions of ``task``), and the number of
        tokens each input took."""

    @abstractmethod
    async def score_pairs(self, query: str, documents: Sequence[str]) -> tuple[list[float], int]:
        """Cross-encoder relevance of each document to the query, in [0, 1], and the tokens
        used. Only for single-logit sequence classifiers."""

    async def infer(self, inputs: EncoderInputs) -> list[Any]:
        results, _ = await self.infer_counted(inputs)
        return results

    async def watch(self) -> None:
        """Return when the backend can no longer serve; never, for in-process backends."""
        await asyncio.Event().wait()

    def shutdown(self) -> None:
        """Stop serving for good and release what the backend holds (threads, weights):
        called on an unload and on SIGTERM, maybe more than once. Requests under way that it
        cannot finish fail with :func:`unloaded`."""


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

    async def connect(self) -> None:
        """On the event loop, before ``load``: backends served by another process connect."""

    @abstractmethod
    def load(self) -> None:
        """Load tokenizer and weights; afterwards ``tokenizer`` and ``max_model_len`` are set."""

    def tune(self) -> None:
        """After ``load``, once the machine is otherwise quiet: settle what is measured rather
        than configured."""

    @abstractmethod
    def check_request(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> None:
        """Raise :class:`BadRequest` for what the model cannot do (token ids outside its
        vocabulary, an unknown adapter, ...): called before any response is sent, so a
        stream never starts with an error the request itself carried."""

    @abstractmethod
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, adapter: str | None = None
    ) -> AsyncIterator[list[ChoiceDelta]]:
        """Deltas for the ``params.n`` choices as tokens are produced, until all finished.
        ``adapter`` names a LoRA adapter served under its own model name."""

    async def watch(self) -> None:
        """Return when the backend can no longer serve (a dead engine); the server then
        exits non-zero so that Kubernetes restarts it. Backends that cannot die: never."""
        await asyncio.Event().wait()

    def shutdown(self) -> None:
        """Stop serving for good and release what the backend holds (threads, weights, engine
        processes): called on an unload and on SIGTERM, maybe more than once. Requests under
        way that it cannot finish fail with :func:`unloaded`."""
