"""``POST /v1/tokenize`` and ``/v1/detokenize``: the served tokenizer, in vLLM's shapes.

A tokenize request carries either a ``prompt`` (a completion's text: special tokens added by
default) or chat ``messages`` (rendered by the chat template as a chat completion renders them:
no special tokens added again by default). Both are rendered and tokenized in a worker thread,
with the same bound as a completion's prompt: a text far longer than the context is a 400 after
tokenizing only a cut of it (see :mod:`.prompts`). A detokenize request's ids must be in the
vocabulary.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag
from transformers import PreTrainedTokenizerBase

from .errors import InvalidParameter
from .fields import TokenId
from .models import ServedModels, resolve_generation
from .prompts import prepare_chat, tokenize_prompt
from .requests import ChatConversation


class TokenizeCompletionRequest(BaseModel):
    """A text, tokenized as a completion's prompt is."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatConversation):
    """A chat, rendered by the chat template and tokenized as a chat completion's prompt is."""

    model: str | None = None
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


def _kind(body: Any) -> Literal["chat", "prompt"]:
    return "chat" if isinstance(body, dict) and "messages" in body else "prompt"


class TokenizeRequest(
    RootModel[
        Annotated[
            Annotated[TokenizeCompletionRequest, Tag("prompt")]
            | Annotated[TokenizeChatRequest, Tag("chat")],
            Discriminator(_kind),
        ]
    ]
):
    """``prompt`` or ``messages``: which one a body is follows from whether it has messages."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


async def create_tokenize(models: ServedModels, body: TokenizeRequest) -> TokenizeResponse:
    request = body.root
    model, backend, _ = resolve_generation(models, request.model, "/v1/tokenize")
    tokenizer = backend.tokenizer
    if isinstance(request, TokenizeChatRequest):
        ids, _ = await prepare_chat(backend, model, request, request.add_special_tokens)
    else:
        ids = await asyncio.to_thread(
            tokenize_prompt,
            tokenizer,
            request.prompt,
            backend.max_model_len,
            "prompt",
            request.add_special_tokens,
        )
    strings = (
        cast(list[str], tokenizer.convert_ids_to_tokens(ids)) if request.return_token_strs else None
    )
    return TokenizeResponse(
        count=len(ids), max_model_len=backend.max_model_len, tokens=ids, token_strs=strings
    )


async def create_detokenize(models: ServedModels, request: DetokenizeRequest) -> DetokenizeResponse:
    _, backend, _ = resolve_generation(models, request.model, "/v1/detokenize")
    tokenizer = backend.tokenizer
    return DetokenizeResponse(prompt=await asyncio.to_thread(detokenize, tokenizer, request.tokens))


def detokenize(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """The text of ``ids`` (special tokens included, as vLLM gives it); 400 for an id outside
    the vocabulary."""
    size = len(tokenizer)
    outside = next((i for i in ids if i >= size), None)
    if outside is not None:
        raise InvalidParameter(
            f"token id {outside} is not in the vocabulary (ids 0 to {size - 1})", param="tokens"
        )
    return cast(str, tokenizer.decode(ids))
