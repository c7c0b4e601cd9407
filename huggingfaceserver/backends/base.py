"""The backend interface the protocol layer talks to."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from ..encoders import EncoderTask


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
