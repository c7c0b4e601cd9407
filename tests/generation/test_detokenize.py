"""Incremental detokenization with the tiny byte-level BPE, WordPiece and sentencepiece
tokenizers: pieces add up to the decoded text, stop strings are cut and never leak."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from huggingfaceserver.generation.detokenize import (
    IncrementalDetokenizer,
    find_stop,
    partial_stop_length,
)

MULTIBYTE = "Hello wörld 日本 😀! The capital of France is Paris."
PARIS = "The capital of France is Paris. Berlin is the capital of Germany."


@pytest.fixture(scope="module")
def gpt2(tiny_models: dict[str, Path]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_models["gpt2"])


@pytest.fixture(scope="module")
def tokenizers(tiny_models: dict[str, Path]) -> dict[str, PreTrainedTokenizerBase]:
    names = ("gpt2", "bert_fill_mask", "t5")
    return {name: AutoTokenizer.from_pretrained(tiny_models[name]) for name in names}


def pieces(detokenizer: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    """Push every token (until the detokenizer stops), then flush."""
    out = [detokenizer.push(token) for token in ids]
    return [*out, detokenizer.flush()]


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("name", ["gpt2", "bert_fill_mask", "t5"])
def test_pieces_add_up_to_the_decoded_text(
    tokenizers: dict[str, PreTrainedTokenizerBase], name: str
) -> None:
    tokenizer = tokenizers[name]
    ids = tokenizer(MULTIBYTE).input_ids  # with the special tokens, skipped in the text
    detokenizer = IncrementalDetokenizer(tokenizer)
    emitted = pieces(detokenizer, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(emitted) == detokenizer.text == expected
    assert not detokenizer.stopped


def test_incomplete_characters_are_held_back(gpt2: PreTrainedTokenizerBase) -> None:
    ids = encode(gpt2, MULTIBYTE)
    emitted = pieces(IncrementalDetokenizer(gpt2), ids)
    assert all("\ufffd" not in piece for piece in emitted)
    assert "".join(emitted) == MULTIBYTE
    assert "" in emitted  # some tokens are only part of a character


def test_an_invalid_byte_sequence_comes_out_when_finished(gpt2: PreTrainedTokenizerBase) -> None:
    first_byte_of_ni = encode(gpt2, "日")[0]
    detokenizer = IncrementalDetokenizer(gpt2)
    assert detokenizer.push(encode(gpt2, "a")[0]) == "a"
    assert detokenizer.push(first_byte_of_ni) == ""
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == "a\ufffd"


def test_special_tokens_kept_when_asked(gpt2: PreTrainedTokenizerBase) -> None:
    ids = [*encode(gpt2, "Paris"), gpt2.eos_token_id]
    detokenizer = IncrementalDetokenizer(gpt2, skip_special_tokens=False)
    assert "".join(pieces(detokenizer, ids)) == "Paris<|endoftext|>"


def test_stop_string_is_cut(gpt2: PreTrainedTokenizerBase) -> None:
    detokenizer = IncrementalDetokenizer(gpt2, stop=["Paris"])
    emitted = pieces(detokenizer, encode(gpt2, PARIS))
    assert "".join(emitted) == detokenizer.text == "The capital of France is "
    assert detokenizer.stopped_on == "Paris"
    assert detokenizer.push(encode(gpt2, "x")[0]) == ""


def test_stop_string_kept_when_asked(gpt2: PreTrainedTokenizerBase) -> None:
    detokenizer = IncrementalDetokenizer(gpt2, stop=["Paris"], include_stop_str_in_output=True)
    assert "".join(pieces(detokenizer, encode(gpt2, PARIS))) == "The capital of France is Paris"


def test_stop_string_inside_a_token(gpt2: PreTrainedTokenizerBase) -> None:
    detokenizer = IncrementalDetokenizer(gpt2, stop=["ari"])
    assert "".join(pieces(detokenizer, encode(gpt2, PARIS))) == "The capital of France is P"


def test_text_that_may_become_a_stop_string_is_held_back(gpt2: PreTrainedTokenizerBase) -> None:
    detokenizer = IncrementalDetokenizer(gpt2, stop=["Paris!"])
    emitted = [detokenizer.push(token) for token in encode(gpt2, "The capital of France is Paris")]
    assert "".join(emitted) == "The capital of France is "
    assert detokenizer.push(encode(gpt2, ".")[0]) == "Paris."
    assert not detokenizer.stopped


def test_held_back_text_is_flushed_at_the_end(gpt2: PreTrainedTokenizerBase) -> None:
    detokenizer = IncrementalDetokenizer(gpt2, stop=["Paris!"])
    emitted = pieces(detokenizer, encode(gpt2, "The capital of France is Par"))
    assert emitted[-1] == "Par"
    assert "".join(emitted) == "The capital of France is Par"


def test_the_earliest_stop_string_wins(gpt2: PreTrainedTokenizerBase) -> None:
    detokenizer = IncrementalDetokenizer(gpt2, stop=["Germany", "capital"])
    assert "".join(pieces(detokenizer, encode(gpt2, PARIS))) == "The "
    assert detokenizer.stopped_on == "capital"


def test_no_stop_string_within_min_tokens(gpt2: PreTrainedTokenizerBase) -> None:
    ids = encode(gpt2, PARIS)
    detokenizer = IncrementalDetokenizer(gpt2, stop=["capital"], min_tokens=3)
    assert "".join(pieces(detokenizer, ids)) == "The capital of France is Paris. Berlin is the "


def test_stop_strings_with_wordpiece(tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    bert = tokenizers["bert_fill_mask"]
    detokenizer = IncrementalDetokenizer(bert, stop=["paris"])
    assert "".join(pieces(detokenizer, encode(bert, PARIS))) == "the capital of france is "


def test_find_stop() -> None:
    assert find_stop("abcabc", ["c", "bc"], 0) == (1, "bc")
    assert find_stop("abcabc", ["c"], 3) == (5, "c")
    assert find_stop("abc", ["x"], 0) is None


def test_partial_stop_length() -> None:
    assert partial_stop_length("hello St", ["Stop", "tea"]) == 2
    assert partial_stop_length("hello t", ["Stop", "tea"]) == 1
    assert partial_stop_length("hello", ["Stop"]) == 0
    assert partial_stop_length("Sto", ["Stop"]) == 3
