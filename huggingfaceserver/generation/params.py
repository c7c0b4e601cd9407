"""Backend-neutral generation settings and outputs: what every generation backend takes and
yields, so a request means the same thing whichever backend serves it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]
ConstraintKind = Literal["json", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class Constraint:
    """Structured output: what every generated text must match, whichever backend serves it."""

    kind: ConstraintKind
    spec: str
    """``json``: a JSON schema (JSON text); ``regex``: a regular expression; ``choice``: a JSON
    list of the allowed strings; ``grammar``: a grammar (GBNF/EBNF or Lark)."""
    after: str | None = None
    """A reasoning parser's end marker (a token of the vocabulary): the tokens up to it are
    free and the constraint starts after it, as vLLM's engine does with ``--reasoning-parser``
    (which the vLLM backend passes it, so its engine does this itself)."""
    thinking: str | None = None
    """With :attr:`after`: the request's ``chat_template_kwargs`` (JSON text) that make its
    model think, with which vLLM's engine makes its reasoning parser (``deepseek_v3`` thinks
    only when they say so)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to generate, after the protocol layer has validated and defaulted the request.

    Semantics follow vLLM's ``SamplingParams`` (the OpenAI meaning where OpenAI defines one).
    """

    n: int = 1
    """Independent choices generated for the prompt."""
    max_tokens: int | None = None
    """New tokens at most; None: up to the context length."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens are generated (EOS not
    with ignore_eos, where it is a regular token), and stop strings are not looked for in
    those first tokens (as vLLM)."""
    temperature: float = 1.0
    """0 means greedy, whatever the model's generation config says."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    """Per-request generator seed; never touches the global RNG. With n > 1, choice i draws
    with seed + i (as vLLM), so the choices differ and each is reproducible."""
    presence_penalty: float = 0.0
    """OpenAI's additive penalty: logit -= presence_penalty if the token occurred in the output."""
    frequency_penalty: float = 0.0
    """OpenAI's additive penalty: logit -= frequency_penalty * count in the output."""
    repetition_penalty: float = 1.0
    """Multiplicative (CTRL / transformers meaning), over prompt and output tokens."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id -> bias added to its logit."""
    stop: tuple[str, ...] = ()
    """Stop strings, matched on decoded text, cut from the output."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs; k >= 0: the sampled token's logprob plus the top k alternatives,
    from the model's raw logits (before bias, penalties and temperature)."""
    prompt_logprobs: int | None = None
    """None: none; k >= 0: each prompt token's logprob (after the first, which has none) under
    the model given the tokens before it, its rank, and the top k alternatives (decoder-only
    models)."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    constraint: Constraint | None = None
    """Structured output (``response_format``, vLLM's ``guided_*`` / ``structured_outputs``)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def answer_tokens(self, prompt_tokens: int, max_model_len: int) -> int:
        """The tokens each choice may generate after a prompt of ``prompt_tokens``:
        ``max_tokens``, at most what the context leaves."""
        room = max_model_len - prompt_tokens
        return room if self.max_tokens is None else min(room, self.max_tokens)


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None
    """1 for the most likely token; given for prompt tokens."""


@dataclass
class ChoiceDelta:
    """What one choice produced since its previous delta.

    ``text`` is already cut at a stop string and held back while it could still become one,
    so concatenating a choice's deltas gives its final text.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    """None until the choice's last delta: then "stop" (EOS, stop string, stop token) or
    "length" (max_tokens or the context limit)."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """On a choice's first delta, when ``prompt_logprobs`` was asked for: one entry per prompt
    token, None for the first."""
