"""Reasoning output on the OpenAI routes: what a request with a ``--reasoning-parser`` gets.

The split itself is :mod:`...generation.reasoning`'s (a function of the whole text, and a
streaming splitter); here is what a request decides about it: whether its model thinks (its
``chat_template_kwargs``), whether the reasoning is sent (``include_reasoning``), whether its
structured output starts after the reasoning, and how many tokens the reasoning took.
Tool calls and the content are what follows the reasoning.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from ...generation.params import ChoiceDelta, SamplingParams
from ...generation.reasoning import ReasoningFormat, ReasoningSplit, ReasoningStream
from .prompts import encode


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's output is split into reasoning and content."""

    form: ReasoningFormat
    template_kwargs: Mapping[str, Any]
    include: bool
    """``include_reasoning``: false counts the reasoning but does not send it."""

    @property
    def thinks(self) -> bool:
        return self.form.thinks(self.template_kwargs)

    def split(self, text: str) -> ReasoningSplit:
        return self.form.split(text, self.template_kwargs)

    def stream(self) -> ReasoningStream:
        return self.form.stream(self.template_kwargs)

    def shown(self, reasoning: str | None) -> str | None:
        """The reasoning as sent: None when there is none or the request asked for none."""
        return (reasoning or None) if self.include else None


def plan_reasoning(
    form: ReasoningFormat | None, request: Any, params: SamplingParams
) -> tuple[ReasoningPlan | None, SamplingParams]:
    """The request's reasoning plan (None without a parser) and the sampling settings it
    needs. ``request`` carries ``chat_template_kwargs`` and ``include_reasoning``.

    A structured output (or a tool choice that constrains) of a model that thinks starts
    after the reasoning's end marker, as in vLLM: the grammar leaves the reasoning free. (The
    vLLM backend's engine does that itself, given ``--reasoning-parser``.)"""
    if form is None:
        return None, params
    plan = ReasoningPlan(
        form, dict(request.chat_template_kwargs or {}), bool(request.include_reasoning)
    )
    if params.constraint is not None and plan.thinks:
        thinking = json.dumps(plan.template_kwargs)
        constraint = replace(params.constraint, after=form.end, thinking=thinking)
        params = replace(params, constraint=constraint)
    if form.keeps_special_tokens:
        params = replace(params, skip_special_tokens=False)
    return plan, params


def count_reasoning_tokens(tokenizer: PreTrainedTokenizerBase, reasonings: Iterable[str]) -> int:
    """The tokens of the choices' reasoning texts (blocking: it tokenizes).

    The reasoning text tokenized, markers excluded, as vLLM counts the tokens between them.
    Not the generated tokens up to the end marker: their texts do not line up with the split
    (a delta may hold the end of the reasoning and the start of the content, a marker may
    span tokens, and the deltas the split sees are cut at stop strings), and the count would
    need the token ids the non-streamed path does not keep. Tokenizing gives the same count
    wherever the model wrote its tokenizer's own tokenization of the text (greedy output
    nearly always); a sampled, unusual tokenization may count a few tokens differently."""
    return sum(len(encode(tokenizer, text, False)) for text in reasonings if text)


@dataclass
class ThoughtStreams:
    """The reasoning splitters of a streamed answer's choices, by choice index (none without a
    plan): what each delta adds to the reasoning and to the content."""

    plan: ReasoningPlan | None
    streams: dict[int, ReasoningStream] = field(default_factory=dict)

    def push(self, index: int, delta: ChoiceDelta) -> tuple[str | None, str]:
        """The reasoning to send (None: none) and the content the delta adds."""
        if self.plan is None:
            return None, delta.text
        stream = self.streams.setdefault(index, self.plan.stream())
        thought, text = stream.push(delta.text)
        if delta.finish_reason is not None:
            rest_thought, rest = stream.finish()
            thought, text = thought + rest_thought, text + rest
        return self.plan.shown(thought), text

    async def count_tokens(self, tokenizer: PreTrainedTokenizerBase) -> int:
        reasonings = [stream.reasoning for stream in self.streams.values()]
        return await asyncio.to_thread(count_reasoning_tokens, tokenizer, reasonings)
