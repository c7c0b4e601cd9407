"""Structured output on the transformers backend: grammar-constrained decoding with llguidance.

A request's :class:`~.params.Constraint` becomes an llguidance grammar (checked once, cached by
constraint); each constrained row gets its own :class:`GrammarMatcher`. Before the rows of a
step sample, one call fills the masks of all their constrained rows (llguidance's batched
executor) and the tokens each grammar does not allow next are masked out of its row's logits;
after, each row's token is fed to its matcher. A matcher in error, or one that allows nothing,
fails its row (a 400): a row never goes on unconstrained. Rows without a constraint are not
touched. JSON is compact (no free whitespace), as
vLLM's ``disable_any_whitespace``: a small model left free to emit whitespace can emit little
else.

llguidance rather than xgrammar: the same masks (vLLM uses either), without xgrammar's
dependency on triton (a gigabyte on Linux) for a server that runs without vLLM.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ..errors import BadRequest
from .params import Constraint

CACHED_GRAMMARS = 256
JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions
KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
LOGGED_ERROR_CHARS = 2000

logger = logging.getLogger(__name__)


class Grammars:
    """The grammars of one tokenizer's requests, and the matchers of their rows."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: list[int]):
        if not tokenizer.is_fast:
            raise BadRequest("structured output needs a fast (tokenizers) tokenizer")
        fast: Any = tokenizer
        try:
            self.tokenizer = llguidance.hf.from_tokenizer(fast, n_vocab=vocab_size, eos_token=eos)
        except ValueError as exc:  # a decoder llguidance cannot map to bytes (T5's Metaspace)
            raise BadRequest(
                f"structured output is not available for this model's tokenizer: {exc}"
            ) from None
        self.vocab_size = vocab_size
        self.cache: OrderedDict[Constraint, str] = OrderedDict()
        self.lock = threading.Lock()

    def grammar(self, constraint: Constraint) -> str:
        """The constraint's llguidance grammar; a 400 that names the problem when invalid."""
        with self.lock:
            if constraint in self.cache:
                self.cache.move_to_end(constraint)
                return self.cache[constraint]
        grammar = self._checked(constraint)
        with self.lock:
            self.cache[constraint] = grammar
            while len(self.cache) > CACHED_GRAMMARS:
                self.cache.popitem(last=False)
        return grammar

    def _checked(self, constraint: Constraint) -> str:
        name = KIND_NAMES[constraint.kind]
        try:
            grammar = to_grammar(constraint)
        except (ValueError, TypeError) as exc:
            raise BadRequest(f"invalid {name}: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise BadRequest(f"invalid {name}: {error}"[:2000])
        return grammar

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher, at the start of the constraint's grammar."""
        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(constraint))
        return GrammarMatcher(matcher, self.tokenizer.vocab_size)


class LazyGrammars:
    """A backend's :class:`Grammars`, made on the first constrained request (reading the
    vocabulary takes a moment that a server without one need not spend)."""

    def __init__(self, make: Callable[[], Grammars]):
        self.make = make
        self.made: Grammars | None = None
        self.lock = threading.Lock()

    @classmethod
    def for_tokenizer(
        cls, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos: Iterable[int] | None = None
    ) -> LazyGrammars:
        """The grammars of ``tokenizer``'s requests; ``eos``: the tokens that end a sequence
        (by default the tokenizer's end-of-sequence token)."""
        if eos is None:
            eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        eos_ids = sorted(eos)
        return cls(lambda: Grammars(tokenizer, vocab_size, eos_ids))

    def get(self) -> Grammars:
        with self.lock:
            if self.made is None:
                self.made = self.make()
            return self.made


def to_grammar(constraint: Constraint) -> str:
    """The llguidance grammar text of a constraint (not yet checked)."""
    if constraint.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.loads(constraint.spec), defaults=JSON_OPTIONS
        )
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    if constraint.kind == "choice":
        return llguidance.grammar_from("choice", constraint.spec)
    return llguidance.grammar_from("grammar", constraint.spec)


@dataclass(eq=False)
class GrammarMatcher:
    """One row's place in its grammar: llguidance's matcher, and the vocabulary its masks cover
    (the size the grammar's tokenizer was made with, which a model's logits may exceed)."""

    matcher: llguidance.LLMatcher
    vocab_size: int

    def consume(self, token_id: int) -> None:
        """Move past the row's new token; a :class:`BadRequest` when the grammar fails on it."""
        self.matcher.consume_token(token_id)
        failed = self.failure()
        if failed is not None:
            raise failed

    def failure(self) -> BadRequest | None:
        """What failed the grammar, once the matcher is in error (it stays so); else None."""
        if not self.matcher.is_error():
            return None
        error = self.matcher.get_error()
        logger.warning("structured output failed: %s", error[:LOGGED_ERROR_CHARS])
        first_line = error.strip().splitlines()[0] if error.strip() else "the matcher is in error"
        return BadRequest(f"structured output failed: {first_line}")

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and takes nothing more: only the end of sequence is left."""
        return self.matcher.is_stopped() and not self.matcher.is_error()


@functools.cache
def mask_executor() -> llguidance.LLExecutor:
    """The threads that compute the masks of a step's constrained rows (one pool a process)."""
    return llguidance.LLExecutor()


def mask_disallowed(
    logits: torch.Tensor, matchers: Sequence[tuple[int, GrammarMatcher]]
) -> dict[int, BadRequest]:
    """Set the logits of the tokens each row's grammar does not allow next to -inf, in place:
    ``matchers`` are ``(row of logits, its matcher)``. One llguidance call fills the masks of
    all the rows. Returns the rows that cannot go on: a matcher in error, or one that allows
    no token (their logits are then left to whoever fails them)."""
    failures = {row: failed for row, m in matchers if (failed := m.failure()) is not None}
    by_vocab: dict[int, list[tuple[int, GrammarMatcher]]] = {}
    for row, matcher in matchers:
        if row not in failures:
            by_vocab.setdefault(matcher.vocab_size, []).append((row, matcher))
    for vocab_size, group in by_vocab.items():
        bitmask = llguidance.numpy.allocate_token_bitmask(len(group), vocab_size)
        llguidance.numpy.fill_next_token_bitmask_par(
            mask_executor(), [(m.matcher, k) for k, (_, m) in enumerate(group)], bitmask
        )
        allows_nothing = (bitmask == 0).all(axis=1).tolist()
        for k, (row, matcher) in enumerate(group):
            failed = matcher.failure()  # computing a mask can hit the grammar's limits
            if failed is None and allows_nothing[k]:
                failed = BadRequest("structured output failed: the grammar allows no next token")
            if failed is not None:
                failures[row] = failed
        allowed = unpack_bitmask(bitmask, logits.shape[-1], logits.device)
        rows = [row for row, _ in group]
        if rows == list(range(logits.shape[0])):
            logits.masked_fill_(~allowed, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return failures


def unpack_bitmask(bitmask: np.ndarray, vocab: int, device: torch.device) -> torch.Tensor:
    """llguidance's token bitmask ``[rows, words]`` (int32; bit ``j`` of word ``w``: token
    ``32 * w + j``) as a bool mask ``[rows, vocab]`` on ``device``; tokens past the mask's
    width are not allowed.

    On CPU numpy's ``unpackbits`` (int32 words are little-endian on every platform torch runs
    on), under a millisecond for 32 rows of 150k tokens; on an accelerator the words travel and
    are unpacked there. llguidance's numpy helpers, not its torch ones: ``llguidance.torch``
    goes through ``torch.compile`` (its import adds 2.6 s to every process, and its mask
    kernel compiles on the decode thread at the first constrained step, 19 s on a 2-core CPU
    and 2.6 s with a warm cache, and again at new shapes).
    """
    if device.type == "cpu":
        bits = torch.from_numpy(np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little"))
    else:
        words = torch.from_numpy(bitmask).to(device)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        bits = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)
    allowed = bits[:, :vocab].bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return allowed
