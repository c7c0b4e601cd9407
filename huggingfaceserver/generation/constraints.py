"""Structured output on the transformers backend: grammar-constrained decoding with llguidance.

A request's :class:`~.params.Constraint` becomes an llguidance grammar (checked once, cached by
constraint); each constrained row gets its own :class:`GrammarMatcher`. Before the rows of a
step sample, one call fills the masks of all their constrained rows (llguidance's batched
executor) and the tokens each grammar does not allow next are masked out of its row's logits;
after, each row's token is fed to its matcher. A matcher in error, or one that allows nothing,
fails its row (a 400): a row never goes on unconstrained. Rows without a constraint are not
touched. JSON is compact (no free whitespace), as
vLLM's ``disable_any_whitespace``: a small model left free to emit whitespace can emit little
else. A constraint ``after`` a reasoning parser's end marker is one grammar too: any tokens but
the marker, the marker, then the constraint's grammar (vLLM's engine instead turns its grammar
on when it sees the marker; the masks are the same).

llguidance rather than xgrammar: the same masks (vLLM uses either), without xgrammar's
dependency on triton (a gigabyte on Linux) for a server that runs without vLLM.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
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
        self.vocabulary = tokenizer
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
        if constraint.after is not None:
            grammar = after_token(grammar, self._marker_id(constraint.after))
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise BadRequest(f"invalid {name}: {error}"[:2000])
        return grammar

    def _marker_id(self, marker: str) -> int:
        token_id = self.vocabulary.get_vocab().get(marker)
        if token_id is None:
            raise BadRequest(
                f"structured output after the reasoning needs {marker!r} as one token of the "
                "model's vocabulary, and this tokenizer has none"
            )
        return token_id

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


def after_token(grammar: str, token_id: int) -> str:
    """``grammar`` (llguidance's, as :func:`to_grammar` gives it), started after the token
    ``token_id``: any tokens but that one (the reasoning; an end of sequence there ends the
    text, as it would unconstrained), the token, then the grammar."""
    if grammar.lstrip().startswith("{"):  # a top-level grammar: its first one is the start
        grammars = json.loads(grammar)["grammars"]
    else:  # Lark text
        grammars = [{"lark_grammar": grammar}]
    name = grammars[0].get("name") or "constrained"
    grammars[0]["name"] = name
    free = f"start: reasoning @{name}\nreasoning: <[^{token_id}]>* <[{token_id}]>\n"
    return json.dumps({"grammars": [{"name": "after_reasoning", "lark_grammar": free}, *grammars]})


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
