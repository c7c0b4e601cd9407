"""What an encoder request asks of its inputs and results, whatever protocol carried it.

:class:`EncodeParams` holds a request's own choices, unresolved: a prompt (by name or text) and
how to truncate (None: the server's default). The backend resolves them against the model (its
prompts, its maximum length). :class:`Output` says which result each row gets: every protocol
route asks for one (V1/V2 the task's own, TEI's ``/embed`` normalised vectors, ``/rerank`` the
cross-encoder's scores...), and the process that runs the model makes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..errors import BadRequest

TRUNCATION_SIDES = ("right", "left")

Instance = str | tuple[str, str]
"""What a sequence classifier reads: a text, or a text pair (a cross-encoder's query and
document)."""


class Output(str, Enum):
    """The result a row asks for (what travels to the engine process with it)."""

    task = "task"
    """The task's own prediction: the V1 ``predictions`` entry."""
    normalized = "normalized"
    """An embedding, L2-normalised whether or not the model normalises."""
    unnormalized = "unnormalized"
    """An embedding without the model's last normalisation."""
    tokens = "tokens"
    """Each token's final hidden state, unpooled."""
    scores = "scores"
    """A sequence classifier's scores, the cross-encoder activation applied: one number for a
    one-label model (a reranker's relevance), a list per label otherwise."""
    logits = "logits"
    """A sequence classifier's raw logits, a list per label."""


@dataclass(frozen=True)
class EncodeParams:
    """A request's choices about its inputs; None everywhere: the server's defaults."""

    prompt_name: str | None = None
    """One of the model's prompts (``config_sentence_transformers.json``), put before each text."""
    prompt: str | None = None
    """A prompt's text, given whole."""
    truncate: bool | None = None
    """False: an input over the limit is a 400; None: the server's default (``--no_truncation``)."""
    truncation_side: str | None = None
    """``right`` (keep the start) or ``left`` (keep the end); None: the tokenizer's."""
    max_tokens: int | None = None
    """Truncate to this many tokens (vLLM's ``truncate_prompt_tokens``; -1: the maximum)."""

    def __post_init__(self) -> None:
        if self.prompt is not None and self.prompt_name is not None:
            raise BadRequest("give prompt or prompt_name, not both")
        if self.truncation_side is not None and self.truncation_side not in TRUNCATION_SIDES:
            raise BadRequest(
                f"truncation direction {self.truncation_side!r} is not one of "
                f"{', '.join(TRUNCATION_SIDES)}"
            )
        if self.max_tokens is not None and (self.max_tokens == 0 or self.max_tokens < -1):
            raise BadRequest(
                f"truncate_prompt_tokens must be -1 (the maximum) or a positive number of "
                f"tokens, not {self.max_tokens}"
            )
        if self.max_tokens is not None and self.truncate is False:
            raise BadRequest("truncate_prompt_tokens asks for truncation; truncate is false")

    @property
    def asks_prompt(self) -> bool:
        return self.prompt is not None or self.prompt_name is not None


DEFAULT_PARAMS = EncodeParams()


def side_named(value: str | None) -> str | None:
    """A truncation direction as TEI and vLLM spell it (``Left``, ``right``) -> ``left``."""
    return value.lower() if isinstance(value, str) else value
