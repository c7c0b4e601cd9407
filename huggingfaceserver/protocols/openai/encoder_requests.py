"""Embedding and rerank requests: what encoder models answer on the OpenAI routes.

As for generation requests, fields these models do not know are accepted and ignored
(``extra="allow"``), so clients that send newer OpenAI, Cohere or Jina fields keep working.
The extensions vLLM's and text-embeddings-inference's clients send are read: a prompt
(``prompt_name``, ``prompt``), truncation (``truncate``, ``truncation_direction`` or
``truncation_side``, ``truncate_prompt_tokens``) and ``normalize``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

from ...encoder_tasks.params import Output
from ..encode_fields import TruncatedEncodeFields, TruncationFields
from .fields import TextOrTokens, split_text_or_tokens


class EmbeddingRequest(TruncatedEncodeFields):
    """``POST /v1/embeddings`` (OpenAI)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: TextOrTokens
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = Field(None, ge=1)
    """Matryoshka truncation: keep the first ``dimensions`` values (then renormalize)."""
    user: str | None = None
    normalize: Annotated[bool, Strict()] | None = None
    """vLLM's: True L2-normalises, False leaves out the model's normalisation; None: as the
    model (sentence-transformers) gives its vectors."""

    def inputs(self) -> list[str] | list[list[int]]:
        """One entry per input: its text, or its token ids."""
        return split_text_or_tokens(self.input)

    @property
    def base64(self) -> bool:
        """Whether vectors are sent as base64 little-endian float32 (the SDK's own default)."""
        return self.encoding_format == "base64"

    @property
    def output(self) -> Output:
        return NORMALIZE_OUTPUTS[self.normalize]


NORMALIZE_OUTPUTS = {None: Output.task, True: Output.normalized, False: Output.unnormalized}
"""``normalize`` -> the embedding asked for."""


class RerankDocument(BaseModel):
    """A document given as an object (Cohere and Jina accept both forms)."""

    model_config = ConfigDict(extra="allow")

    text: str


class RerankRequest(TruncationFields):
    """``POST /v1/rerank`` in the Cohere / Jina shape."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True

    @field_validator("documents", mode="before")
    @classmethod
    def _check_documents(cls, documents: Any) -> Any:
        # Checked here so that a bad entry gets one message, not one per union member.
        if not isinstance(documents, list):
            raise ValueError("expected a list of strings or of {'text': string} objects")
        for index, document in enumerate(documents):
            is_text = isinstance(document, str)
            is_object = isinstance(document, dict) and isinstance(document.get("text"), str)
            if not (is_text or is_object or isinstance(document, RerankDocument)):
                raise ValueError(
                    f"document {index} is neither a string nor a {{'text': string}} object"
                )
        return documents

    def texts(self) -> list[str]:
        """The documents' texts, in request order."""
        return [d if isinstance(d, str) else d.text for d in self.documents]
