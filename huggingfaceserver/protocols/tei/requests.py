"""text-embeddings-inference's request bodies, as its clients send them (TEI 1.x's OpenAPI:
``EmbedRequest``, ``EmbedSparseRequest``, ``EmbedAllRequest``, ``PredictRequest``,
``RerankRequest``, ``TokenizeRequest``, ``DecodeRequest``).

Unknown fields are accepted and ignored, as TEI does (``huggingface_hub``'s client sends
``encoding_format`` and others it has no use for).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, RootModel, Strict, field_validator

from ...encoder_tasks.params import Instance
from ..encode_fields import EncodeFields, TruncationFields
from ..openai.fields import TokenId

TextOrIds = str | list[TokenId]
"""One input: a text, or its token ids."""
Inputs = TextOrIds | list[TextOrIds]


def split_inputs(value: Any) -> list[str] | list[list[int]]:
    """TEI's ``inputs``: a text, token ids, or a list of either (not both)."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ValueError("expected a text, token ids, or a non-empty list of them")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return [value]
    if all(isinstance(item, str) for item in value):
        return value
    if all(isinstance(item, list) for item in value):
        return value
    raise ValueError("expected a list of texts or a list of token id lists, not a mix")


class InputsBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    inputs: Inputs

    @field_validator("inputs", mode="before")
    @classmethod
    def _check_inputs(cls, value: Any) -> Any:
        split_inputs(value)
        return value

    def texts(self) -> list[str] | list[list[int]]:
        return split_inputs(self.inputs)


class EmbedRequest(InputsBody, EncodeFields):
    """``POST /embed``."""

    normalize: Annotated[bool, Strict()] = True
    dimensions: int | None = Field(None, ge=1)
    """Keep the first ``dimensions`` values (Matryoshka), normalised after if ``normalize``."""


class EmbedSparseRequest(InputsBody, EncodeFields):
    """``POST /embed_sparse``."""


class EmbedAllRequest(InputsBody, EncodeFields):
    """``POST /embed_all``: each token's state, unpooled."""


def split_predict_inputs(value: Any) -> tuple[list[Instance], bool]:
    """TEI's ``/predict`` inputs: a text, a pair ``[a, b]``, or a batch of ``[text]`` and
    ``[a, b]`` lists; and whether it was a batch (its answer is a list per input)."""
    if isinstance(value, str):
        return [value], False
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        if len(value) == 1:
            return [value[0]], False
        if len(value) == 2:
            return [(value[0], value[1])], False
        raise ValueError("a list of strings is one text or one pair: at most 2 strings")
    if isinstance(value, list) and value and all(isinstance(item, list) for item in value):
        batch: list[Instance] = []
        for index, item in enumerate(value):
            if not all(isinstance(text, str) for text in item) or len(item) not in (1, 2):
                raise ValueError(f"batch item {index} is neither [text] nor [text, text]")
            batch.append(item[0] if len(item) == 1 else (item[0], item[1]))
        return batch, True
    raise ValueError(
        "expected a string, a pair of strings [string, string] or a batch of mixed strings and "
        "pairs [[string], [string, string], ...]"
    )


class PredictRequest(TruncationFields):
    """``POST /predict``: sequence classification of texts and text pairs."""

    model_config = ConfigDict(extra="allow")

    inputs: str | list[str] | list[list[str]]
    raw_scores: Annotated[bool, Strict()] = False

    @field_validator("inputs", mode="before")
    @classmethod
    def _check_inputs(cls, value: Any) -> Any:
        split_predict_inputs(value)
        return value

    def instances(self) -> tuple[list[Instance], bool]:
        return split_predict_inputs(self.inputs)


class RerankRequest(TruncationFields):
    """``POST /rerank``."""

    model_config = ConfigDict(extra="allow")

    query: str
    texts: list[str] = Field(min_length=1)
    raw_scores: Annotated[bool, Strict()] = False
    return_text: Annotated[bool, Strict()] = False


class TokenizeRequest(BaseModel):
    """``POST /tokenize``."""

    model_config = ConfigDict(extra="allow")

    inputs: str | Annotated[list[str], Field(min_length=1)]
    add_special_tokens: Annotated[bool, Strict()] = True
    prompt_name: str | None = None

    def texts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else self.inputs


class DecodeRequest(BaseModel):
    """``POST /decode``."""

    model_config = ConfigDict(extra="allow")

    ids: Annotated[list[TokenId] | list[list[TokenId]], Field(min_length=1)]
    skip_special_tokens: Annotated[bool, Strict()] = True

    def id_lists(self) -> list[list[int]]:
        if self.ids and isinstance(self.ids[0], list):
            return self.ids  # type: ignore[return-value]
        return [self.ids]  # type: ignore[list-item]


class RootRequest(RootModel[EmbedRequest | EmbedSparseRequest | PredictRequest | RerankRequest]):
    """``POST /``: the body of the model's own route (``/embed``, ``/embed_sparse``,
    ``/predict`` or ``/rerank``), as documented; each is parsed as its route's."""


BODIES: dict[str, type[BaseModel]] = {
    "/embed": EmbedRequest,
    "/embed_sparse": EmbedSparseRequest,
    "/embed_all": EmbedAllRequest,
    "/predict": PredictRequest,
    "/rerank": RerankRequest,
    "/tokenize": TokenizeRequest,
    "/decode": DecodeRequest,
}
"""The body each TEI route parses, as /openapi.json documents it."""
