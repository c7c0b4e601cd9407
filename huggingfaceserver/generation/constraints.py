"""Structured output on the transformers backend: grammar-constrained decoding with llguidance.

A request's :class:`~.params.Constraint` becomes an llguidance grammar (checked once, cached by
constraint); each constrained row gets its own matcher. Before a row samples, the tokens its
grammar does not allow next are masked out of its logits; after, the token is fed to its
matcher. Rows without a constraint are not touched. JSON is compact (no free whitespace), as
vLLM's ``disable_any_whitespace``: a small model left free to emit whitespace can emit little
else.

llguidance rather than xgrammar: the same masks (vLLM uses either), without xgrammar's
dependency on triton (a gigabyte on Linux) for a server that runs without vLLM.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

from ..errors import BadRequest
from .params import Constraint

CACHED_GRAMMARS = 256
JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions
KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_BITS = torch.arange(32, dtype=torch.int32)


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

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher, at the start of the constraint's grammar."""
        return llguidance.LLMatcher(self.tokenizer, self.grammar(constraint))


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


def allowed_tokens(matcher: llguidance.LLMatcher, vocab_size: int) -> torch.Tensor:
    """Which tokens the matcher allows next: a bool mask ``[vocab_size]``."""
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> _BITS) & 1
    return bits.flatten()[:vocab_size].bool()


def mask_disallowed(logits: torch.Tensor, matcher: llguidance.LLMatcher) -> None:
    """Set the logits of the tokens the matcher does not allow next to -inf (in place). Once
    the grammar is complete only the end of sequence is allowed. A matcher in error (it
    allows nothing) leaves the logits alone rather than make every token impossible."""
    allowed = allowed_tokens(matcher, logits.shape[-1]).to(logits.device)
    if allowed.any():
        logits.masked_fill_(~allowed, float("-inf"))
