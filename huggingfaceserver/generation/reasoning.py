"""Reasoning output (``--reasoning-parser NAME``): a thinking model's text split into its
reasoning and the content after it, on every backend.

The names and what each does are vLLM's (``vllm/reasoning``), for the families whose reasoning
is delimited by plain text markers:

- ``deepseek_r1`` (DeepSeek-R1 and its distills): the output starts in the reasoning (the
  template writes ``<think>`` into the prompt), a ``<think>`` the model writes is dropped, the
  first ``</think>`` ends it; whatever follows is content, as written.
- ``qwen3`` and ``mimo`` (Qwen3, MiMo): as ``deepseek_r1``, but a ``<tool_call>`` also ends the
  reasoning (and begins the content), and a ``</think>`` after the reasoning is dropped from
  the content. ``chat_template_kwargs: {"enable_thinking": false}``: all content.
- ``deepseek_v3`` (DeepSeek-V3.1 and later): ``deepseek_r1`` when the request's
  ``chat_template_kwargs`` turn ``thinking`` (or ``enable_thinking``) on, else all content;
  ``holo2``: the same, thinking unless the request says either.

The split is made on text, not token ids, so that it is the same on both backends and a marker
that the model writes in several tokens (or that reaches us split across two deltas) counts
too. Where vLLM's own streamed and non-streamed splits disagree (text before a ``<think>``,
which vLLM's non-streamed ``deepseek_r1`` drops and its streamed one sends as reasoning; a
``<think>`` after ``</think>``), both of ours follow the streamed one: the non-streamed split
is the streamed one fed the whole text, so a stream always adds up to the whole answer.

gpt-oss's harmony channels are not plain markers: ``openai_gptoss`` is not offered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"
QWEN3_TOOL_CALL = "<tool_call>"

TemplateKwargs = Mapping[str, Any]


@dataclass(frozen=True)
class ReasoningSplit:
    """A model's text as reasoning and content (None for an empty part)."""

    reasoning: str | None
    content: str | None


def always_thinks(kwargs: TemplateKwargs) -> bool:
    return True


def thinks_unless_disabled(kwargs: TemplateKwargs) -> bool:
    """Qwen3's templates think unless ``enable_thinking`` is false."""
    return bool(kwargs.get("enable_thinking", True))


def thinks_when_enabled(kwargs: TemplateKwargs) -> bool:
    """DeepSeek-V3.1's templates think only when ``thinking`` (or ``enable_thinking``) is on."""
    return bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))


def thinks_unless_told(kwargs: TemplateKwargs) -> bool:
    """Holo2: thinking by default; either flag, once given, decides as for DeepSeek-V3.1."""
    if kwargs.get("thinking") is None and kwargs.get("enable_thinking") is None:
        return True
    return thinks_when_enabled(kwargs)


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family of models marks its reasoning."""

    name: str
    thinks: Callable[[TemplateKwargs], bool] = always_thinks
    """Whether the model reasons at all, from the request's ``chat_template_kwargs``."""
    start: str = THINK_START
    """Dropped while in the reasoning: the model may write it, or the prompt already has."""
    end: str = THINK_END
    content_starts: tuple[str, ...] = ()
    """Markers that end the reasoning without its end marker and begin the content."""
    drops_late_ends: bool = False
    """Whether an end marker after the reasoning is dropped from the content (else kept)."""
    keeps_special_tokens: bool = False
    """Whether the text must keep special tokens (vLLM's parser turns ``skip_special_tokens``
    off for the request)."""

    def stream(self, template_kwargs: TemplateKwargs | None = None) -> ReasoningStream:
        """A splitter for one choice of a request with these ``chat_template_kwargs``."""
        thinking = self.thinks(template_kwargs or {})
        return ReasoningStream(self, thinking, in_reasoning=thinking)

    def split(self, text: str, template_kwargs: TemplateKwargs | None = None) -> ReasoningSplit:
        """The whole text as reasoning and content."""
        stream = self.stream(template_kwargs)
        reasoning, content = stream.push(text)
        rest_reasoning, rest_content = stream.finish()
        return ReasoningSplit(reasoning + rest_reasoning or None, content + rest_content or None)

    def markers(self, in_reasoning: bool) -> tuple[str, ...]:
        """The markers that change something in the reasoning, or after it."""
        if in_reasoning:
            return (self.start, self.end, *self.content_starts)
        return (self.end,) if self.drops_late_ends else ()


@dataclass
class ReasoningStream:
    """One choice's text, fed delta by delta, as reasoning and content deltas.

    A delta's end that may be the beginning of a marker is held until the next delta (or
    :meth:`finish`) says whether it is one, so the deltas add up to :meth:`ReasoningFormat.split`
    of the whole text.
    """

    form: ReasoningFormat
    thinking: bool
    """False: the request turned thinking off, and the whole text is content, as written."""
    in_reasoning: bool
    held: str = ""
    reasoning_parts: list[str] = field(default_factory=list)
    """Every reasoning delta given out so far (what the usage counts)."""

    @property
    def reasoning(self) -> str:
        """The reasoning given out so far."""
        return "".join(self.reasoning_parts)

    def push(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that can go out now, either possibly empty."""
        text, self.held = self.held + delta, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            markers = self.form.markers(self.in_reasoning) if self.thinking else ()
            out = reasoning if self.in_reasoning else content
            found = earliest(text, markers)
            if found is None:
                keep = partial_marker(text, markers)
                out.append(text[: len(text) - keep])
                self.held = text[len(text) - keep :]
                break
            at, marker = found
            out.append(text[:at])
            if self.in_reasoning and marker in self.form.content_starts:
                self.in_reasoning = False  # the marker itself is the content's start
                text = text[at:]
                continue
            if marker == self.form.end:
                self.in_reasoning = False
            text = text[at + len(marker) :]
        return self._given("".join(reasoning)), "".join(content)

    def finish(self) -> tuple[str, str]:
        """At the choice's end: the held text, as what it is."""
        rest, self.held = self.held, ""
        if self.in_reasoning:
            return self._given(rest), ""
        return "", rest

    def _given(self, reasoning: str) -> str:
        if reasoning:
            self.reasoning_parts.append(reasoning)
        return reasoning


def earliest(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The first marker in ``text`` and where it starts (the longest of those starting there)."""
    found = [(at, -len(marker), marker) for marker in markers if (at := text.find(marker)) >= 0]
    if not found:
        return None
    at, _, marker = min(found)
    return at, marker


def partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that is the beginning of a marker."""
    for size in range(min(max((len(m) for m in markers), default=1) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-size:]) for marker in markers):
            return size
    return 0


QWEN3 = ReasoningFormat(
    "qwen3",
    thinks=thinks_unless_disabled,
    content_starts=(QWEN3_TOOL_CALL,),
    drops_late_ends=True,
    keeps_special_tokens=True,
)
REASONING_PARSERS: dict[str, ReasoningFormat] = {
    form.name: form
    for form in (
        ReasoningFormat("deepseek_r1"),
        ReasoningFormat("deepseek_v3", thinks=thinks_when_enabled),
        ReasoningFormat("holo2", thinks=thinks_unless_told),
        QWEN3,
        replace(QWEN3, name="mimo"),
    )
}
"""``--reasoning-parser`` names (vLLM's) and their formats."""
