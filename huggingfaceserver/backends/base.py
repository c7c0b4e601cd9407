"""The backend interface the protocol layer talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..encoders import EncoderTask
from ..generation.params import ChoiceDelta, SamplingParams


class EncoderBackend(ABC):
    """Runs an encoder task on a list of texts; the protocol layer cannot tell backends apart.

    ``load`` blocks (it reads weights) and is called once, off the event loop. ``infer``
    never runs tokenization or the model on the event loop.
    """

    name: str
    task: EncoderTask

    @abstractmethod
    def load(self) -> None:
        """Load tokenizer and weights; afterwards ``task`` is set."""

    @abstractmethod
    async def infer(self, texts: Sequence[str]) -> list[Any]:
        """One result per text, in order (the V1 predictions of ``task``)."""


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

    @abstractmethod
    def load(self) -> None:
        """Load tokenizer and weights; afterwards ``tokenizer`` and ``max_model_len`` are set."""

    @abstractmethod
    def generate(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[ChoiceDelta]]:
        """Deltas for the ``params.n`` choices as tokens are produced, until all finished."""
