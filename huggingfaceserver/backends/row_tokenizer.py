"""Encoder inputs as rows (:class:`RowTokenizer`): per instance, one unpadded int64 array per
model input.

Texts go straight to the Rust tokenizer (``tokenizers``) when the model's tokenizer is a fast
one, configured once as transformers configures it per call (truncation to the maximum
length, special tokens, the same outputs), which gives the same ids at a fraction of the cost
of ``tokenizer(...)`` and its padded tensors. Whether the copy encodes as the tokenizer does
is checked at load on probe texts (:data:`PROBE_TEXTS`: scripts, accents, case, spaces, a text
over the maximum, pairs) through both public calls: a tokenizer class that encodes otherwise
(its own preprocessing, say) goes through transformers, as do slow tokenizers.
Padding happens later, once rows of many requests are merged (:func:`.batching.collate`).
A text far longer than the maximum is cut first to a window that tokenizes to the same first
tokens (:mod:`.long_inputs`), so that its cost is bounded. With ``--no_truncation`` nothing is
truncated: an input over the maximum is refused (:class:`InputTooLong`).

A request may ask for other truncation than the server's (:class:`Truncation`: off, from the
left, to fewer tokens). Texts are then encoded by a copy without truncation, cut with
``Encoding.truncate`` and given their special tokens by ``post_process``: the steps the Rust
tokenizer itself takes when truncation is set (checked at load on the probe texts, as above).
Pairs truncated from the left get a copy of their own, made on first use.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from tokenizers import Encoding, Tokenizer
from transformers import PreTrainedTokenizerBase

from ..errors import BadRequest
from .long_inputs import Cut, InputTooLong, LongInputs
from .truncation import Truncation, truncated, truncates_alike

PROBE_TEXTS = (
    "Hello, World! How are you today?",
    "  spaces   before, between\tand after \n ",
    "UPPER lower MiXeD Case 12345 3.14",
    "naïve café, Ångström, façade, Straße",
    "日本語のテキストと中文文本",
    "emoji 🤗🚀 and symbols @#$%^&*()[]{}",
    "don't won't it's e-mail https://example.com/a?b=c",
    "",
)
"""Texts on which the Rust copy must encode as the tokenizer's own call, alone and as pairs."""
FEW_INPUTS = 4
"""Up to this many inputs are encoded one by one, more in one parallel batch."""

INPUT_NAME = "input {}"
PAIR_NAME = "pair {0} (the query and document {0})"
"""How a refusal names an input or a pair, by its index."""
QUERY_NAME = "the query"
REQUEST_HINT = "shorten it or send truncate: true"
"""What a refusal suggests when the request itself asked not to truncate."""

Row = dict[str, np.ndarray]
"""One instance's model inputs (``input_ids``, ``token_type_ids``, ``offset_mapping``...),
unpadded; the attention mask is made when rows are merged."""


def rust_copy(
    tokenizer: PreTrainedTokenizerBase, max_length: int, truncate: bool, side: str
) -> Tokenizer:
    """A private copy of the Rust tokenizer, set up as transformers sets it for
    ``tokenizer(..., truncation=truncate, max_length=max_length)`` with ``side`` as its
    truncation side."""
    rust = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    rust.no_padding()
    rust.no_truncation()
    if truncate:
        rust.enable_truncation(max_length, stride=0, strategy="longest_first", direction=side)
    rust.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return rust


def rust_tokenizer(
    tokenizer: PreTrainedTokenizerBase, max_length: int, truncate: bool = True
) -> Tokenizer | None:
    """:func:`rust_copy` on the tokenizer's own side; None when transformers does more than
    that for this tokenizer (a slow tokenizer, or one whose own call encodes the probe texts
    otherwise)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    rust = rust_copy(tokenizer, max_length, truncate, tokenizer.truncation_side)
    return rust if encodes_alike(tokenizer, rust, max_length, truncate) else None


def encodes_alike(
    tokenizer: PreTrainedTokenizerBase, rust: Tokenizer, max_length: int, truncate: bool
) -> bool:
    """Whether ``rust`` gives the ids, token types and offsets that ``tokenizer``'s own call
    gives on :data:`PROBE_TEXTS` (and one text over the maximum), with and without special
    tokens, and on pairs of them."""
    texts = [*PROBE_TEXTS, "probe " * (max_length + 8)]
    pairs = list(zip(texts, reversed(texts), strict=True))
    options = {"truncation": truncate, "max_length": max_length}
    options |= {"return_token_type_ids": True, "return_offsets_mapping": True}
    try:
        cases = [
            (
                rust.encode_batch(texts, add_special_tokens=add),
                tokenizer(texts, add_special_tokens=add, **options),
            )
            for add in (True, False)
        ]
        first, second = [list(side) for side in zip(*pairs, strict=True)]
        cases.append((rust.encode_batch(pairs), tokenizer(first, second, **options)))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot answer these goes the slow way
        return False
    return all(
        encoding.ids == list(theirs["input_ids"][index])
        and encoding.type_ids == list(theirs["token_type_ids"][index])
        and [tuple(o) for o in encoding.offsets]
        == [tuple(o) for o in theirs["offset_mapping"][index]]
        for ours, theirs in cases
        for index, encoding in enumerate(ours)
    )


class RowTokenizer:
    """Texts, text pairs or token ids -> :data:`Row` s. Texts are truncated to the maximum
    length, or refused beyond it (``truncate=False``), unless a request asks otherwise
    (:class:`Truncation`); token ids are checked by the caller. With ``pooling_mask`` each row
    also says which of its tokens pooling reads: all but a prompt's (``prompt_length``)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_length: int,
        add_special_tokens: bool = True,
        token_type_ids: bool = False,
        offsets: bool = False,
        truncate: bool = True,
        pooling_mask: bool = False,
    ):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.add_special_tokens = add_special_tokens
        self.token_type_ids = token_type_ids or "token_type_ids" in tokenizer.model_input_names
        self.offsets = offsets
        self.truncate = truncate
        self.pooling_mask = pooling_mask
        self.default = Truncation(truncate, tokenizer.truncation_side, max_length)
        """The server's own truncation (``--max_length``, ``--no_truncation``)."""
        self.rust = rust_tokenizer(tokenizer, max_length, truncate)
        self.long: LongInputs | None = None
        if self.rust is not None and tokenizer.truncation_side == "right":
            # a window (the text's start) holds the first tokens: truncation on the right only
            self.long = LongInputs(self.rust)
        self.single_specials = tokenizer.num_special_tokens_to_add(pair=False)
        self.text_specials = self.single_specials if add_special_tokens else 0
        """The special tokens each single text gets."""
        self.pair_specials = tokenizer.num_special_tokens_to_add(pair=True)
        self._copies: dict[tuple[bool, str], tuple[Tokenizer, LongInputs | None]] = {}
        self._manual: bool | None = None
        self._lock = threading.Lock()
        """Around making copies, and the slow path's change of the tokenizer's side."""

    # texts

    def texts(
        self, texts: Sequence[str], truncation: Truncation | None = None, prompt_length: int = 0
    ) -> list[Row]:
        """Texts, each on its own (as the embedding and classification tasks read them);
        ``prompt_length``: the tokens of a prompt they start with (see ``pooling_mask``)."""
        truncation = truncation or self.default
        if truncation == self.default or self.rust is None:
            rows = self._texts(texts, truncation)
        else:
            rows = self._texts_cut(texts, truncation)
        return self.with_pooling_mask(rows, prompt_length)

    def _texts(self, texts: Sequence[str], truncation: Truncation) -> list[Row]:
        """The server's own truncation on the Rust copy, or any through transformers."""
        specials = self.text_specials
        long = self.long if self.rust is not None else None
        cuts = [self.cut(text, truncation.limit - specials + 1, long) for text in texts]
        for index, cut in enumerate(cuts):
            self.refuse_cut(cut, INPUT_NAME.format(index), index, specials, truncation)
        rows = self._encode([cut.text for cut in cuts], self.add_special_tokens, truncation)
        self.refuse_long(rows, INPUT_NAME, truncation)
        return rows

    def _texts_cut(self, texts: Sequence[str], truncation: Truncation) -> list[Row]:
        """Another truncation than the server's: encoded whole (or a window of the start, as
        far as truncating on the right or refusing needs) and cut as the Rust tokenizer
        would cut it (:func:`truncated`)."""
        if not self.cuts_alike():
            raise BadRequest(
                "this model's tokenizer serves only the server's own truncation: leave "
                "truncate, truncation_direction and truncate_prompt_tokens out"
            )
        plain, long = self.copy(False, "right")
        specials = self.text_specials
        keep = truncation.limit - specials
        windowed = long if truncation.side == "right" or not truncation.enabled else None
        cuts = [self.cut(text, keep + 1, windowed) for text in texts]
        for index, cut in enumerate(cuts):
            self.refuse_cut(cut, INPUT_NAME.format(index), index, specials, truncation)
        rows = []
        for index, cut in enumerate(cuts):
            encoding = plain.encode(cut.text, add_special_tokens=False)
            if len(encoding.ids) > keep and not truncation.enabled:
                tokens = len(encoding.ids) + specials
                raise self.too_long(INPUT_NAME.format(index), index, tokens, truncation)
            encoding = truncated(plain, encoding, keep, truncation.side, self.add_special_tokens)
            rows.append(self._row(encoding))
        return rows

    def cuts_alike(self) -> bool:
        """Whether :func:`truncated` encodes as the Rust tokenizer does (checked once)."""
        if self._manual is None:
            assert self.rust is not None
            plain, _ = self.copy(False, "right")
            self._manual = truncates_alike(self.rust, plain, self.max_length)
        return self._manual

    def copy(self, truncate: bool, side: str) -> tuple[Tokenizer, LongInputs | None]:
        """A Rust copy truncating at the maximum on ``side`` (or not at all), made on first
        use, with the windows of its long inputs where it keeps the start."""
        key = (truncate, side if truncate else "right")
        with self._lock:
            if key not in self._copies:
                rust = rust_copy(self.tokenizer, self.max_length, truncate, side)
                self._copies[key] = (rust, LongInputs(rust) if key[1] == "right" else None)
            return self._copies[key]

    def with_pooling_mask(self, rows: list[Row], prompt_length: int) -> list[Row]:
        if self.pooling_mask:
            for row in rows:
                mask = np.ones(len(row["input_ids"]), dtype=np.int64)
                mask[:prompt_length] = 0
                row["pooling_mask"] = mask
        return rows

    def prompt_length(self, prompt: str) -> int:
        """A prompt's tokens as sentence-transformers counts them to leave them out of the
        pooling: the prompt encoded alone, less a special token it ends with."""
        if not prompt:
            return 0
        if self.rust is not None:
            ids = self.rust.encode(prompt, add_special_tokens=self.add_special_tokens).ids
        else:
            ids = self.tokenizer(
                prompt,
                truncation=self.truncate,
                max_length=self.max_length,
                add_special_tokens=self.add_special_tokens,
            )["input_ids"]
        special = set(self.tokenizer.all_special_ids)
        return len(ids) - (1 if ids and ids[-1] in special else 0)

    # pairs

    def pairs(
        self, query: str, documents: Sequence[str], truncation: Truncation | None = None
    ) -> list[Row]:
        """(query, document) pairs, as a cross-encoder reads them."""
        return self.pairs_of([(query, document) for document in documents], truncation, True)

    def pairs_of(
        self,
        pairs: Sequence[tuple[str, str]],
        truncation: Truncation | None = None,
        one_query: bool = False,
    ) -> list[Row]:
        """Text pairs, each encoded as the tokenizer encodes ``tokenizer(first, second)``;
        ``one_query``: every pair has the same first text, named "the query" in refusals."""
        truncation = truncation or self.default
        if truncation.limit != self.max_length:
            raise BadRequest("truncate_prompt_tokens applies to single texts, not to pairs")
        rust, long = self.rust, self.long
        if rust is not None and truncation != self.default:
            rust, long = self.copy(truncation.enabled, truncation.side)
            if not truncation.enabled:
                long = self.copy(False, "right")[1]
        needed = self.max_length - self.pair_specials + 1
        counted: dict[str, Cut] = {}
        lengths: dict[str, int] = {}
        cut_pairs = []
        for index, (first, second) in enumerate(pairs):
            if first not in counted:
                counted[first] = self.cut(first, needed, long)
                what = QUERY_NAME if one_query else PAIR_NAME.format(index)
                self.refuse_cut(counted[first], what, index, self.pair_specials, truncation)
            first_cut, wanted = counted[first], needed
            # Truncation shortens the longer side of a pair first: a second text cut to a
            # window must stay longer than the first, as the whole text is. (With both sides
            # cut and an odd number of tokens to share, which side keeps the odd one may
            # differ from truncating both whole: no window tells which is longer.)
            if (
                first_cut.settled is None
                and long is not None
                and len(second) > long.first_window(needed)
            ):
                if first not in lengths:
                    lengths[first] = long.count(first)
                wanted = max(needed, lengths[first] + 1)
            second_cut = self.cut(second, wanted, long)
            what = PAIR_NAME.format(index) if one_query else f"pair {index}"
            self.refuse_cut(second_cut, what, index, self.pair_specials, truncation)
            cut_pairs.append((first_cut.text, second_cut.text))
        rows = self._encode(cut_pairs, True, truncation, rust)
        self.refuse_long(rows, PAIR_NAME if one_query else "pair {}", truncation)
        return rows

    # shared

    def cut(self, text: str, needed: int, long: LongInputs | None = None) -> Cut:
        """``text``, or the window of it that holds its first ``needed`` tokens (with
        truncation on the right, any more would be cut off)."""
        if long is None:
            return Cut(text)
        return long.cut(text, needed)

    def refuse_cut(
        self, cut: Cut, what: str, index: int, specials: int, truncation: Truncation
    ) -> None:
        """Without truncation, a text cut to a window is over the maximum."""
        if not truncation.enabled and cut.settled is not None:
            raise self.too_long(what, index, cut.settled + specials, truncation, True)

    def refuse_long(self, rows: list[Row], name: str, truncation: Truncation) -> None:
        """Without truncation, a row over the maximum is refused (``name``: the row's name,
        its index to be formatted in)."""
        if truncation.enabled:
            return
        for index, row in enumerate(rows):
            tokens = len(row["input_ids"])
            if tokens > truncation.limit:
                raise self.too_long(name.format(index), index, tokens, truncation)

    def too_long(
        self, what: str, index: int, tokens: int, truncation: Truncation, at_least: bool = False
    ) -> InputTooLong:
        hint = None if truncation == self.default else REQUEST_HINT
        return InputTooLong(what, index, tokens, truncation.limit, at_least, hint)

    def token_ids(self, inputs: Sequence[Sequence[int]]) -> list[Row]:
        """Token ids used as they are (no special tokens added)."""
        rows = []
        for ids in inputs:
            row = {"input_ids": np.asarray(ids, dtype=np.int64)}
            if self.token_type_ids:
                row["token_type_ids"] = np.zeros(len(ids), dtype=np.int64)
            if self.offsets:
                row["offset_mapping"] = np.zeros((len(ids), 2), dtype=np.int64)
            rows.append(row)
        return self.with_pooling_mask(rows, 0)

    def _encode(
        self,
        inputs: list[Any],
        add_special_tokens: bool,
        truncation: Truncation,
        rust: Tokenizer | None = None,
    ) -> list[Row]:
        rust = self.rust if rust is None else rust
        if rust is None:
            return self._slow(inputs, add_special_tokens, truncation)
        if len(inputs) <= FEW_INPUTS:
            # one by one: encode keeps the GIL, encode_batch releases it (to encode in
            # parallel) and must then wait to get it back from busy threads
            encodings = [self._encode_one(rust, item, add_special_tokens) for item in inputs]
        else:
            encodings = rust.encode_batch(inputs, add_special_tokens=add_special_tokens)
        return [self._row(encoding) for encoding in encodings]

    @staticmethod
    def _encode_one(
        rust: Tokenizer, item: str | tuple[str, str], add_special_tokens: bool
    ) -> Encoding:
        if isinstance(item, tuple):
            return rust.encode(item[0], item[1], add_special_tokens=add_special_tokens)
        return rust.encode(item, add_special_tokens=add_special_tokens)

    def _row(self, encoding: Encoding) -> Row:
        row = {"input_ids": np.array(encoding.ids, dtype=np.int64)}
        if self.token_type_ids:
            row["token_type_ids"] = np.array(encoding.type_ids, dtype=np.int64)
        if self.offsets:
            row["offset_mapping"] = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return row

    @contextmanager
    def _side(self, side: str) -> Iterator[None]:
        """The tokenizer truncating on ``side`` for the duration (the slow path's calls)."""
        with self._lock:
            saved = self.tokenizer.truncation_side
            self.tokenizer.truncation_side = side
            try:
                yield
            finally:
                self.tokenizer.truncation_side = saved

    def _slow(
        self, inputs: list[Any], add_special_tokens: bool, truncation: Truncation
    ) -> list[Row]:
        """Through transformers (tokenizers without a plain Rust backend)."""
        options = {"truncation": truncation.enabled, "max_length": truncation.limit}
        with self._side(truncation.side):
            if inputs and isinstance(inputs[0], tuple):
                first, second = [list(side) for side in zip(*inputs, strict=True)]
                encoded = self.tokenizer(first, second, **options)
            else:
                encoded = self.tokenizer(
                    inputs,
                    add_special_tokens=add_special_tokens,
                    return_token_type_ids=self.token_type_ids or None,
                    return_offsets_mapping=self.offsets,
                    **options,
                )
        rows = []
        for index, ids in enumerate(encoded["input_ids"]):
            row = {"input_ids": np.array(ids, dtype=np.int64)}
            if self.token_type_ids:
                types = encoded.get("token_type_ids")
                row["token_type_ids"] = (
                    np.array(types[index], dtype=np.int64)
                    if types is not None
                    else np.zeros(len(ids), dtype=np.int64)
                )
            if self.offsets:
                offsets = encoded["offset_mapping"][index]
                row["offset_mapping"] = np.array(offsets, dtype=np.int64).reshape(-1, 2)
            rows.append(row)
        return rows
