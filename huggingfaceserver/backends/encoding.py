"""Encoder inputs as rows: per instance, one unpadded int64 array per model input.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from tokenizers import Encoding, Tokenizer
from transformers import PreTrainedTokenizerBase

from .long_inputs import Cut, InputTooLong, LongInputs

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

Row = dict[str, np.ndarray]
"""One instance's model inputs (``input_ids``, ``token_type_ids``, ``offset_mapping``...),
unpadded; the attention mask is made when rows are merged."""


def rust_tokenizer(
    tokenizer: PreTrainedTokenizerBase, max_length: int, truncate: bool = True
) -> Tokenizer | None:
    """A private copy of the Rust tokenizer, set up as transformers sets it for
    ``tokenizer(..., truncation=truncate, max_length=max_length)``; None when transformers
    does more than that for this tokenizer (a slow tokenizer, or one whose own call encodes
    the probe texts otherwise)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    rust = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    rust.no_padding()
    rust.no_truncation()
    if truncate:
        rust.enable_truncation(
            max_length, stride=0, strategy="longest_first", direction=tokenizer.truncation_side
        )
    rust.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
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


class InputEncoder:
    """Texts, text pairs or token ids -> :data:`Row` s. Texts are truncated to the maximum
    length, or refused beyond it (``truncate=False``); token ids are checked by the caller."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_length: int,
        add_special_tokens: bool = True,
        token_type_ids: bool = False,
        offsets: bool = False,
        truncate: bool = True,
    ):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.add_special_tokens = add_special_tokens
        self.token_type_ids = token_type_ids or "token_type_ids" in tokenizer.model_input_names
        self.offsets = offsets
        self.truncate = truncate
        self.rust = rust_tokenizer(tokenizer, max_length, truncate)
        self.long: LongInputs | None = None
        if self.rust is not None and tokenizer.truncation_side == "right":
            # a window (the text's start) holds the first tokens: truncation on the right only
            self.long = LongInputs(self.rust)
        self.single_specials = tokenizer.num_special_tokens_to_add(pair=False)
        self.pair_specials = tokenizer.num_special_tokens_to_add(pair=True)

    def texts(self, texts: Sequence[str]) -> list[Row]:
        """Texts, each on its own (as the embedding and classification tasks read them)."""
        specials = self.single_specials if self.add_special_tokens else 0
        cuts = [self.cut(text, self.max_length - specials + 1) for text in texts]
        for index, cut in enumerate(cuts):
            self.refuse_cut(cut, INPUT_NAME.format(index), index, specials)
        rows = self._encode([cut.text for cut in cuts], self.add_special_tokens)
        self.refuse_long(rows, INPUT_NAME)
        return rows

    def pairs(self, query: str, documents: Sequence[str]) -> list[Row]:
        """(query, document) pairs, as a cross-encoder reads them."""
        needed = self.max_length - self.pair_specials + 1
        query_cut = self.cut(query, needed)
        self.refuse_cut(query_cut, "the query", 0, self.pair_specials)
        if query_cut.settled is None and self.long is not None:
            # Truncation shortens the longer side of a pair first: a document cut to a window
            # must stay longer than the query, as the whole document is. (With both sides cut
            # and an odd number of tokens to share, which side keeps the odd one may differ
            # from truncating both whole: no window tells which is longer.)
            window = self.long.first_window(needed)
            if any(len(document) > window for document in documents):
                needed = max(needed, self.long.count(query) + 1)
        cuts = [self.cut(document, needed) for document in documents]
        for index, cut in enumerate(cuts):
            self.refuse_cut(cut, PAIR_NAME.format(index), index, self.pair_specials)
        rows = self._encode([(query_cut.text, cut.text) for cut in cuts], True)
        self.refuse_long(rows, PAIR_NAME)
        return rows

    def cut(self, text: str, needed: int) -> Cut:
        """``text``, or the window of it that holds its first ``needed`` tokens (with
        truncation on the right, any more would be cut off)."""
        if self.long is None:
            return Cut(text)
        return self.long.cut(text, needed)

    def refuse_cut(self, cut: Cut, what: str, index: int, specials: int) -> None:
        """Without truncation, a text cut to a window is over the maximum."""
        if not self.truncate and cut.settled is not None:
            raise InputTooLong(what, index, cut.settled + specials, self.max_length, True)

    def refuse_long(self, rows: list[Row], name: str) -> None:
        """Without truncation, a row over the maximum is refused (``name``: the row's name,
        its index to be formatted in)."""
        if self.truncate:
            return
        for index, row in enumerate(rows):
            if len(row["input_ids"]) > self.max_length:
                tokens = len(row["input_ids"])
                raise InputTooLong(name.format(index), index, tokens, self.max_length)

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
        return rows

    def _encode(self, inputs: list[Any], add_special_tokens: bool) -> list[Row]:
        if self.rust is None:
            return self._slow(inputs, add_special_tokens)
        if len(inputs) <= FEW_INPUTS:
            # one by one: encode keeps the GIL, encode_batch releases it (to encode in
            # parallel) and must then wait to get it back from busy threads
            encodings = [self._encode_one(item, add_special_tokens) for item in inputs]
        else:
            encodings = self.rust.encode_batch(inputs, add_special_tokens=add_special_tokens)
        return [self._row(encoding) for encoding in encodings]

    def _encode_one(self, item: str | tuple[str, str], add_special_tokens: bool) -> Encoding:
        assert self.rust is not None
        if isinstance(item, tuple):
            return self.rust.encode(item[0], item[1], add_special_tokens=add_special_tokens)
        return self.rust.encode(item, add_special_tokens=add_special_tokens)

    def _row(self, encoding: Encoding) -> Row:
        row = {"input_ids": np.array(encoding.ids, dtype=np.int64)}
        if self.token_type_ids:
            row["token_type_ids"] = np.array(encoding.type_ids, dtype=np.int64)
        if self.offsets:
            row["offset_mapping"] = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        return row

    def _slow(self, inputs: list[Any], add_special_tokens: bool) -> list[Row]:
        """Through transformers (tokenizers without a plain Rust backend)."""
        if inputs and isinstance(inputs[0], tuple):
            first, second = [list(side) for side in zip(*inputs, strict=True)]
            encoded = self.tokenizer(
                first, second, truncation=self.truncate, max_length=self.max_length
            )
        else:
            encoded = self.tokenizer(
                inputs,
                truncation=self.truncate,
                max_length=self.max_length,
                add_special_tokens=add_special_tokens,
                return_token_type_ids=self.token_type_ids or None,
                return_offsets_mapping=self.offsets,
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
