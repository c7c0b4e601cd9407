"""The request fields that choose a prompt and a truncation, as the routes' own clients name
them: text-embeddings-inference's (``prompt_name``, ``truncate``, ``truncation_direction``),
vLLM's (``truncate_prompt_tokens``, ``truncation_side``) and sentence-transformers' (``prompt``),
on the OpenAI and TEI bodies, and as KServe V1/V2 request ``parameters``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError

from ..encoder_tasks.params import EncodeParams, side_named
from ..errors import BadRequest
from .error_routes import describe_validation_error


class TruncationFields(BaseModel):
    """Mixed into request bodies; :meth:`encode_params` gives what they asked for."""

    truncate: Annotated[bool, Strict()] | None = None
    """False: an input over the maximum is a 400 rather than cut (None: the server's way)."""
    truncation_direction: str | None = None
    """``right`` keeps the start, ``left`` the end (TEI's name; either case)."""
    truncation_side: str | None = None
    """vLLM's name for the same."""

    def encode_params(self, max_tokens: int | None = None) -> EncodeParams:
        """The request's choices (a 400 for contradictory or unknown ones)."""
        direction = side_named(self.truncation_direction)
        side = side_named(self.truncation_side)
        if direction is not None and side is not None and direction != side:
            raise BadRequest("truncation_direction and truncation_side disagree")
        name, text = self.asked_prompt()
        return EncodeParams(
            prompt_name=name,
            prompt=text,
            truncate=self.truncate,
            truncation_side=direction or side,
            max_tokens=max_tokens,
        )

    def asked_prompt(self) -> tuple[str | None, str | None]:
        """The prompt the request names, and the one it gives (none here)."""
        return None, None


class EncodeFields(TruncationFields):
    """With a prompt: single texts (the embedding routes)."""

    prompt_name: str | None = None
    """One of the model's prompts (``config_sentence_transformers.json``)."""
    prompt: str | None = None
    """A prompt's text, put before each input."""

    def asked_prompt(self) -> tuple[str | None, str | None]:
        return self.prompt_name, self.prompt


class TruncatedEncodeFields(EncodeFields):
    """With vLLM's ``truncate_prompt_tokens`` too (single texts: the embedding routes)."""

    truncate_prompt_tokens: Annotated[int, Strict(), Field(ge=-1)] | None = None
    """Keep this many tokens of each input (-1: the model's maximum), on
    ``truncation_direction``'s side."""

    def encode_params(self, max_tokens: int | None = None) -> EncodeParams:
        return super().encode_params(self.truncate_prompt_tokens)


class ParameterFields(TruncatedEncodeFields):
    """KServe V1/V2 request ``parameters`` of encoder requests."""

    model_config = ConfigDict(extra="forbid")


def params_from(parameters: Mapping[str, Any] | None, strict: bool) -> EncodeParams:
    """The :class:`EncodeParams` of a KServe request's ``parameters``; ``strict``: an unknown
    parameter is a 400 (V1, whose body is ours to define), else it is left to others (V2, whose
    clients add their own: ``binary_data_output``...)."""
    if not parameters:
        return EncodeParams()
    if not isinstance(parameters, Mapping):
        raise BadRequest('"parameters" must be an object')
    known = (
        parameters
        if strict
        else {
            name: value
            for name, value in parameters.items()
            if name in ParameterFields.model_fields
        }
    )
    try:
        return ParameterFields.model_validate(dict(known)).encode_params()
    except ValidationError as exc:
        message = describe_validation_error(exc).replace("invalid request body", "parameters")
        raise BadRequest(message) from None
