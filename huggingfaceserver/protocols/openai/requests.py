"""OpenAI completion and chat requests: they validate themselves and convert to SamplingParams.

Unknown fields: requests accept fields they do not know (``extra="allow"``, kept in
``model_extra``). OpenAI adds request fields often and ``extra="forbid"`` would break every client
that sends a new one. Fields that OpenAI (or vLLM) defines but that a plain text-generation server
cannot honour (tools, audio, ``suffix``, ``echo`` on chat, ...) are declared,
and a request that gives one of them a value that asks for something is refused with a 400 naming
the field, instead of being answered as if it had not asked. Hints that do not change the answer
(``store``, ``metadata``, ``service_tier``, ``parallel_tool_calls``, ``user`` ...) are accepted and
ignored.

Defaults: ``to_sampling_params`` takes the user's value, else the server's default, else the API's
(completions: 16 new tokens; chat: up to the context length; temperature 1.0). OpenAI's own
fields are nullable, as in the API, and ``null`` means "the default".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationInfo, field_validator

from huggingfaceserver.generation.defaults import NO_DEFAULTS, SamplingDefaults
from huggingfaceserver.generation.params import SamplingParams

from .chat_messages import ChatMessage
from .fields import (
    INT64_MAX,
    FiniteFloat,
    LogitBias,
    Stop,
    TextOrTokens,
    TokenId,
    check_logit_bias_keys,
    check_unsupported,
    is_unset,
    split_text_or_tokens,
    stop_strings,
    unset_or,
)
from .structured import GUIDED, request_constraint
from .tools import Tool, ToolChoice

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for the legacy completions API."""
DEFAULT_TEMPERATURE = 1.0
STRUCTURED_OUTPUT_FIELDS = ("response_format", *GUIDED, "structured_outputs")
GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy decoding (as in vLLM): dividing by them would overflow."""

_UNSUPPORTED_GENERATION: dict[str, Callable[[Any], bool]] = {
    "tools": is_unset,
    "tool_choice": unset_or("none", "auto"),
    "functions": is_unset,
    "function_call": unset_or("none", "auto"),
    "use_beam_search": is_unset,
}


def coalesce(value: int | None, default: int | None) -> int | None:
    return default if value is None else value


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage`` changes what we send."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False


class BaseGenerationRequest(BaseModel):
    """What completions and chat share: sampling, stopping, streaming, and our extensions."""

    model_config = ConfigDict(extra="allow")
    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = _UNSUPPORTED_GENERATION

    model: str | None = None
    """The served model's name; None: the only model served."""
    n: int | None = Field(1, ge=1, le=128)
    temperature: FiniteFloat | None = Field(None, ge=0, le=2)
    top_p: FiniteFloat | None = Field(None, gt=0, le=1)
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # The range torch.Generator.manual_seed accepts.
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: FiniteFloat | None = Field(None, ge=-2, le=2)
    frequency_penalty: FiniteFloat | None = Field(None, ge=-2, le=2)
    logit_bias: LogitBias | None = None
    user: str | None = None

    # Extensions (vLLM's names and meanings).
    top_k: int = Field(0, ge=-1, le=INT64_MAX)
    min_p: FiniteFloat = Field(0.0, ge=0, le=1)
    repetition_penalty: FiniteFloat = Field(1.0, gt=0)
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    # Defined by OpenAI or vLLM, refused unless they ask for nothing (see UNSUPPORTED).
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    use_beam_search: Any = None

    # Structured output (:mod:`.structured`): OpenAI's response_format, vLLM's guided_* and
    # structured_outputs; at most one of them.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    # vLLM's extension: the prompt tokens' logprobs (and top alternatives), non-streamed.
    prompt_logprobs: Annotated[int, Strict()] | None = Field(None, ge=0, le=20)

    @field_validator("*")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        return check_unsupported(info.field_name, value, cls.UNSUPPORTED)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias_keys(bias)

    # Checks across fields are field validators reading the fields declared before (info.data),
    # so that the error names the field at fault.
    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, options: Any, info: ValidationInfo) -> Any:
        if options is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return options

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream is true")
        return value

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _not_below_min_tokens(cls, max_tokens: int | None, info: ValidationInfo) -> int | None:
        min_tokens = info.data.get("min_tokens", 0)
        if max_tokens is not None and min_tokens > max_tokens:
            raise ValueError(f"must not be below min_tokens ({min_tokens})")
        return max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def given(self, name: str, default: Any) -> Any:
        """The request's value of a sampling field, or ``default`` where it left it out (or
        sent null)."""
        value = getattr(self, name)
        return default if value is None or name not in self.model_fields_set else value

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: SamplingDefaults = NO_DEFAULTS,
    ) -> SamplingParams:
        """``defaults``: the model's own, for the settings the request leaves out."""
        temperature = self.given("temperature", defaults.temperature)
        temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
        greedy = temperature < GREEDY_BELOW
        top_p = self.given("top_p", defaults.top_p)
        top_k = self.given("top_k", defaults.top_k)
        min_p = self.given("min_p", defaults.min_p)
        repetition_penalty = self.given("repetition_penalty", defaults.repetition_penalty)
        return SamplingParams(
            n=1 if self.n is None else self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=0.0 if greedy else temperature,
            # Greedy decoding ignores the sampling filters: say so rather than pass them on.
            top_p=1.0 if greedy or top_p is None else top_p,
            top_k=0 if greedy or top_k is None else max(top_k, 0),
            min_p=0.0 if greedy or min_p is None else min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            stop=stop_strings(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs
            if self.prompt_logprobs is None
            else self.prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            constraint=request_constraint(
                {name: getattr(self, name) for name in STRUCTURED_OUTPUT_FIELDS}
            ),
        )


class CompletionRequest(BaseGenerationRequest):
    """``POST /v1/completions``."""

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **_UNSUPPORTED_GENERATION,
        "suffix": is_unset,
    }

    prompt: TextOrTokens
    max_tokens: int | None = Field(None, ge=1)
    logprobs: Annotated[int, Strict()] | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = Field(None, ge=1)
    suffix: Any = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if best_of is not None and best_of != n:
            raise ValueError(f"only best_of equal to n ({n}) is supported")
        return best_of

    @field_validator("echo")
    @classmethod
    def _echo_with_logprobs_not_streamed(
        cls, echo: bool | None, info: ValidationInfo
    ) -> bool | None:
        if echo and info.data.get("logprobs") is not None and info.data.get("stream"):
            raise ValueError("echo with logprobs is not available when stream is true")
        return echo

    @property
    def echo_logprobs(self) -> bool:
        """Whether the echoed prompt's tokens get logprobs too (``echo`` with ``logprobs``)."""
        return bool(self.echo) and self.logprobs is not None

    def requested_max_tokens(self) -> int | None:
        """The client's limit on new tokens, if it set one."""
        return self.max_tokens

    def prompts(self) -> list[str] | list[list[int]]:
        """One entry per prompt: its text, or its token ids."""
        return split_text_or_tokens(self.prompt)

    def to_sampling_params(
        self, default_max_tokens: int | None = None, defaults: SamplingDefaults = NO_DEFAULTS
    ) -> SamplingParams:
        """The request as generation settings; ``default_max_tokens`` is the server's default,
        ``defaults`` the model's own (its generation config's, where the request leaves a
        setting out)."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens or defaults.max_tokens
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
        # echo with logprobs scores the prompt as vLLM does: with prompt_logprobs' top count,
        # else logprobs'
        scored = self.logprobs if self.echo_logprobs else None
        return self._sampling_params(max_tokens, self.logprobs, scored, defaults)


class ChatConversation(BaseModel):
    """A chat as its template renders it: what chat completions and ``/v1/tokenize`` share."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_generation_prompt(cls, cont: bool, info: ValidationInfo) -> bool:
        if cont and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message needs add_generation_prompt to be false")
        return cont

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as a chat template takes them (text content, ``developer`` as system)."""
        return [message.for_template() for message in self.messages]

    def template_kwargs(self) -> dict[str, Any]:
        """The template's extra variables: ``chat_template_kwargs``, and ``tools``."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tools:
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        return kwargs


class ChatCompletionRequest(ChatConversation, BaseGenerationRequest):
    """``POST /v1/chat/completions``."""

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        **{k: v for k, v in _UNSUPPORTED_GENERATION.items() if k not in ("tools", "tool_choice")},
        "audio": is_unset,
        "modalities": unset_or(["text"]),
        "prediction": is_unset,
        "web_search_options": is_unset,
        "echo": is_unset,
    }

    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tool_choice: ToolChoice | None = None  # type: ignore[assignment]
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True
    """vLLM's: false leaves a ``--reasoning-parser``'s reasoning out of the answer."""

    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    echo: Any = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, choice: Any) -> Any:
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise ValueError(
                "must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}'
            )
        return choice

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return top

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_sampling_params(
        self, default_max_tokens: int | None = None, defaults: SamplingDefaults = NO_DEFAULTS
    ) -> SamplingParams:
        """The request as generation settings; ``default_max_tokens`` is the server's default,
        ``defaults`` the model's own (its generation config's, where the request leaves a
        setting out).

        Without either, generation runs up to the context length (``max_tokens=None``).
        """
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = default_max_tokens or defaults.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults=defaults)
