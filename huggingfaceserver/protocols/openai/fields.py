"""Field types and checks shared by the OpenAI request models.

Each check raises ``ValueError`` with a message meant for the client; pydantic turns it into a
``ValidationError`` located at the field, which the OpenAI error handler answers with a 400 whose
``param`` names that field.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, Strict

MAX_STOP_STRINGS = 16


def check_finite(value: Any) -> Any:
    """Say that NaN and infinities are not numbers, before a range check would call NaN
    "not <= 2". JSON's ``NaN`` / ``Infinity`` literals and strings like ``"nan"`` arrive here."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value  # pydantic says it is not a number
    if isinstance(number, float) and math.isnan(number):
        raise ValueError("must be a number, got NaN")
    if isinstance(number, float) and math.isinf(number):
        sign = "-" if number < 0 else ""
        raise ValueError(f"must be a finite number, got {sign}Infinity")
    return value


FiniteFloat = Annotated[float, BeforeValidator(check_finite)]
"""A float field that refuses NaN and infinities with a message that says so."""

INT64_MAX = 2**63 - 1
"""The largest count a request may give (``top_k``, ``min_tokens``): as vLLM's server bounds its
integers, and what the engine's messages carry."""

TokenId = Annotated[int, Strict(), Field(ge=0)]
"""A vocabulary index; ``Strict`` so that ``true`` is not taken for token 1."""

TextOrTokensInput = str | list[str] | list[int] | list[list[int]]
"""OpenAI's four prompt / input forms: a text, texts, one token id list, token id lists."""

_TEXT_OR_TOKENS_FORMS = (
    "expected a string, a list of strings, a list of token ids, or a list of token id lists"
)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        type(token) is int and token >= 0
        for token in value  # bool is not a token id
    )


def split_text_or_tokens(value: Any) -> list[str] | list[list[int]]:
    """One item per prompt: a text or a token id list. Raises ``ValueError`` on other shapes."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return value
        if _is_token_ids(value):
            return [value]
        if all(isinstance(item, list) and _is_token_ids(item) for item in value):
            return value
    if isinstance(value, list) and not value:
        raise ValueError("must not be empty")
    raise ValueError(_TEXT_OR_TOKENS_FORMS)


def check_text_or_tokens(value: Any) -> Any:
    """Accept the four input forms with no empty text and no empty token list."""
    for item in split_text_or_tokens(value):
        if len(item) == 0:
            raise ValueError("must not contain an empty string or an empty token id list")
    return value


TextOrTokens = Annotated[TextOrTokensInput, BeforeValidator(check_text_or_tokens)]


def check_stop(value: Any) -> Any:
    """``None``, a stop string, or up to :data:`MAX_STOP_STRINGS` of them, none empty."""
    if value is None:
        return None
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise ValueError("expected a string or a list of strings")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
    if any(s == "" for s in strings):
        raise ValueError("stop strings must not be empty")
    return value


Stop = Annotated[str | list[str] | None, BeforeValidator(check_stop)]


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """The stop field as the tuple :class:`SamplingParams` takes."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def check_logit_bias_keys(bias: dict[str, float] | None) -> dict[str, float] | None:
    """Keys are token ids written as JSON strings (``{"50256": -100}``)."""
    for key in bias or {}:
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"key {key!r} is not a token id (an integer)") from None
        if token < 0:
            raise ValueError(f"key {key!r} is not a token id (a non-negative integer)")
    return bias


LogitBias = dict[str, Annotated[FiniteFloat, Field(ge=-100, le=100)]]


# Fields OpenAI defines that a plain text-generation server cannot honour. Each maps to the test
# of values that ask for nothing (so that clients sending e.g. `"tools": []` still work).
def is_unset(value: Any) -> bool:
    """``None``, ``False`` or an empty string, list or dict: the field asks for nothing."""
    return value is None or value is False or (isinstance(value, str | list | dict) and not value)


def unset_or(*allowed: Any) -> Callable[[Any], bool]:
    """The field asks for nothing, or for one of ``allowed`` (e.g. ``tool_choice: "none"``)."""
    return lambda value: is_unset(value) or value in allowed


def check_unsupported(name: str, value: Any, harmless: dict[str, Callable[[Any], bool]]) -> Any:
    """Refuse ``value`` for field ``name`` when ``harmless`` lists the field and rejects it."""
    accepts = harmless.get(name)
    if accepts is not None and not accepts(value):
        raise ValueError(f"'{name}' is not supported by this server")
    return value
