"""One choice being generated, row by row: its settings, random generator, tokens, text and
finish state, and the step that turns a batch of rows' logits into their next tokens.

Backend-neutral torch: the rows of one decode batch may belong to different requests, and a
problem of one row (its settings, its logits, its grammar, its text) fails that row alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...generation.constraints import GrammarMatcher
from ...generation.params import ChoiceDelta, FinishReason, SamplingParams, TokenLogprob
from ...generation.text import ChoiceText
from .sampling import SamplingBatch


@dataclass(eq=False)
class SequenceState:
    """One choice being generated: its settings, generator, tokens, text and finish state."""

    index: int
    params: SamplingParams
    prompt_ids: list[int]
    stop_ids: frozenset[int]
    """Tokens that end the choice: EOS (unless ignore_eos) and the stop token ids."""
    budget: int
    """New tokens at most: max_tokens, capped by the context length."""
    generator: torch.Generator | None
    """The row's own generator when its request has a seed; None otherwise (greedy rows, and
    unseeded ones, which draw from the process's sampling generator)."""
    text: ChoiceText | None
    """None when the text is made elsewhere (a front process): deltas then carry tokens only,
    with the finish reasons the tokens decide."""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    aborted: bool = False
    """Set from another thread when whoever makes the text ended the choice (a stop string):
    the row leaves the batch after the current step."""
    matcher: GrammarMatcher | None = None
    """Structured output: the grammar the row's tokens must follow (None: unconstrained)."""

    def append(self, token_id: int, logprob: TokenLogprob | None) -> ChoiceDelta:
        """Take the next token; the delta it makes, with the finish reason when it ends.

        Raises what fails the row: a :class:`~...errors.BadRequest` when the token breaks the
        row's grammar, whatever making its text raises.
        """
        self.output_ids.append(token_id)
        ended: FinishReason | None = None
        if self.matcher is not None:
            self.matcher.consume(token_id)
        if token_id in self.stop_ids:  # a finished grammar allows only these
            ended = "stop"
        elif len(self.output_ids) >= self.budget:
            ended = "length"
        text = ""
        if self.text is None:
            self.finish_reason = ended
        else:
            text, self.finish_reason = self.text.take(token_id, ended)
        logprobs = None if logprob is None else [logprob]
        return ChoiceDelta(self.index, text, [token_id], logprobs, self.finish_reason)


def advance(
    rows: list[SequenceState],
    logits: torch.Tensor,
    sampler: SamplingBatch,
    ahead: Callable[[], bool] | None = None,
) -> list[ChoiceDelta | Exception]:
    """Choose each row's next token from its logits ``[rows, vocab]`` with ``sampler`` (the
    rows' :class:`~.sampling.SamplingBatch`): per row, its delta, or the exception that
    failed that row (its settings, logits, grammar or text; see
    :class:`~.sampling.NextTokens`). Nothing a row does raises here, and the other rows'
    tokens are those they would have had without the failed ones; only a batch-level mistake
    (logits for another number of rows) raises.

    ``ahead``: called once the tokens are chosen on the device and their copy to the host is
    under way, before the host waits for it; it may queue the next step on them (returning
    whether it did), which then runs on the device while the host makes this step's text."""
    chosen = sampler.begin(logits, volatile=ahead is not None)
    stepped = ahead() if ahead is not None and chosen.done is None else False
    tokens, logprobs, failures = chosen.result(redo=not stepped)
    outcomes: list[ChoiceDelta | Exception] = []
    for index, (row, token) in enumerate(zip(rows, tokens, strict=True)):
        if token is None:
            outcomes.append(failures[index])
            continue
        try:
            outcomes.append(row.append(token, logprobs[index]))
        except Exception as exc:  # this row's failure, not the batch's
            outcomes.append(exc)
    return outcomes
