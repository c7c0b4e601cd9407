"""Incremental detokenization with the tiny byte-level BPE, WordPiece and sentencepiece
tokenizers (and a byte-fallback one built here): pieces add up to the full decode, stop strings
are cut and never leak, and each token decodes a bounded window."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from huggingfaceserver.generation.detokenize import (
    IncrementalDetokenizer,
    find_stop,
    partial_stop_length,
    token_texts,
)
from tiny_models import CORPUS

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


def test_a_sentencepiece_tokens_text_keeps_its_leading_space(tokenizers) -> None:
    """A token decoded alone loses the space its ``▁`` stands for (T5's Metaspace): logprobs
    show it, as vLLM's do; byte-level and WordPiece tokens read as decoded."""
    t5 = tokenizers["t5"]
    ids = encode(t5, "the capital of france")
    assert [t5.decode([token]) for token in ids][:3] == ["the", "capital", "of"]
    assert token_texts(t5, ids)[:3] == [" the", " capital", " of"]
    assert "".join(token_texts(t5, ids)) == " " + t5.decode(ids)
    for name in ("gpt2", "bert_fill_mask"):
        tokenizer = tokenizers[name]
        ids = encode(tokenizer, PARIS)
        assert token_texts(tokenizer, ids) == [tokenizer.decode([token]) for token in ids]


def test_partial_stop_length() -> None:
    assert partial_stop_length("hello St", ["Stop", "tea"]) == 2
    assert partial_stop_length("hello t", ["Stop", "tea"]) == 1
    assert partial_stop_length("hello", ["Stop"]) == 0
    assert partial_stop_length("Sto", ["Stop"]) == 3
    assert partial_stop_length("Stop", ["Stop"]) == 0  # whole: a match, not a beginning
    assert partial_stop_length("xabab", ["ababc", "b"]) == 4


def tails_that_begin_a_stop_string(text: str, stop: Sequence[str]) -> int:
    """Every tail of ``text`` shorter than a stop string, compared with its beginning."""
    return max(
        (n for s in stop for n in range(1, min(len(s) - 1, len(text)) + 1) if s[:n] == text[-n:]),
        default=0,
    )


@given(
    st.text(alphabet="abc\n", max_size=30),
    st.lists(st.text(alphabet="abc\n", min_size=1, max_size=12), min_size=1, max_size=3),
)
def test_partial_stop_length_is_the_longest_tail_that_begins_a_stop_string(
    text: str, stop: list[str]
) -> None:
    assert partial_stop_length(text, stop) == tails_that_begin_a_stop_string(text, stop)


# Property tests: every tokenizer family, both decode paths, against the full decode.

FAMILIES = ["gpt2", "llama", "bert_fill_mask", "t5", "byte_fallback"]
TEXTS = [
    MULTIBYTE,
    PARIS,
    "naïve café, Ünïcödé — ¿qué tal? señor",
    "日本語のテキストと中文字符。",
    "😀👍🏽 👨‍👩‍👧 emoji ✨",
    "Привет, мир! Γειά σου κόσμε",
    "  two  spaces,\ttabs\nand newlines\n\n",
    "a ##b [CLS] </s> <s> <|endoftext|> ▁x",
]
MULTILINGUAL = "aé ü日本中文😀👍🏽✨Жλ\n .,!?'-#▁"


class GenericTokenizer:
    """A tokenizer that is not fast: the detokenizer decodes its windows with ``decode``."""

    is_fast = False

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.sizes: list[int] = []

    def decode(self, ids: list[int], **kwargs: bool) -> str:
        self.sizes.append(len(ids))
        return str(self.tokenizer.decode(ids, **kwargs))


class CountingBackend:
    """A fast tokenizer's backend that records how many ids each decode call gets."""

    def __init__(self, backend: Tokenizer):
        self.backend = backend
        self.sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.sizes.append(len(ids))
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self.backend.get_added_tokens_decoder()


class CountingTokenizer:
    """A fast tokenizer whose backend counts the ids of each decode call."""

    is_fast = True

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.backend_tokenizer = CountingBackend(tokenizer.backend_tokenizer)
        self.sizes = self.backend_tokenizer.sizes


def detokenizer_for(
    tokenizer: PreTrainedTokenizerBase, path: str, **kwargs: Any
) -> IncrementalDetokenizer:
    """The detokenizer on the fast path (the tokenizer's backend) or the generic one."""
    if path == "generic":
        return IncrementalDetokenizer(
            cast(PreTrainedTokenizerBase, GenericTokenizer(tokenizer)), **kwargs
        )
    return IncrementalDetokenizer(tokenizer, **kwargs)


def full_decode(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], skip: bool) -> str:
    return str(
        tokenizer.decode(list(ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    )


def train_byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2-style sentencepiece BPE: "▁" for spaces, and characters it has no token for
    as byte tokens ("<0xE6>") that its decoder turns back into text a whole run at a time."""
    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False)
    trained.train_from_iterator(CORPUS, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = model["vocab"]
    vocab.update({f"<0x{byte:02X}>": len(vocab) + byte for byte in range(256)})
    merges = [tuple(merge) for merge in model["merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tokenizer.normalizer = trained.normalizer
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def families(tiny_models: dict[str, Path]) -> dict[str, PreTrainedTokenizerBase]:
    loaded = {name: AutoTokenizer.from_pretrained(tiny_models[name]) for name in FAMILIES[:-1]}
    return {**loaded, "byte_fallback": train_byte_fallback_tokenizer()}


@cache
def fallback_bytes(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids of byte-fallback tokens ("<0xE6>"); none for the other families."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return frozenset(i for i, token in enumerate(tokens) if re.fullmatch("<0x[0-9A-F]{2}>", token))


def byte_pieces(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids of tokens that hold part of a character (byte-level BPE splits most non-ASCII)."""
    split = [encode(tokenizer, char) for char in MULTILINGUAL if len(char.encode()) > 1]
    return sorted({token for ids in split if len(ids) > 1 for token in ids})


@cache
def token_ids(tokenizer: PreTrainedTokenizerBase) -> st.SearchStrategy[list[int]]:
    """Random ids: any token, special tokens, pieces of characters, runs of encoded text.

    Byte-fallback tokens come only in whole runs of encoded text: see
    test_byte_fallback_characters_that_a_later_byte_invalidates_stay_as_emitted.
    """
    encoded = [encode(tokenizer, text) for text in TEXTS]
    run = st.sampled_from(encoded).flatmap(
        lambda ids: st.tuples(st.integers(0, len(ids)), st.integers(0, len(ids))).map(
            lambda cut: ids[min(cut) : max(cut)]
        )
    )
    fallback = fallback_bytes(tokenizer)
    any_token = st.integers(0, len(tokenizer) - 1).filter(lambda token: token not in fallback)
    chunks = [
        st.lists(any_token, min_size=1, max_size=3),
        st.sampled_from(sorted(set(tokenizer.all_special_ids))).map(lambda token: [token]),
        st.sampled_from(encoded),
    ]
    if not fallback:  # text cut anywhere, and the pieces of split characters on their own
        chunks.append(run)
        if split := byte_pieces(tokenizer):
            chunks.append(st.sampled_from(split).map(lambda token: [token]))
    return st.lists(st.one_of(chunks), max_size=8).map(
        lambda chunks: [t for c in chunks for t in c]
    )


@cache
def interleaved(tokenizer: PreTrainedTokenizerBase) -> st.SearchStrategy[list[int]]:
    """Encoded multilingual text with special tokens between any two of its ids (not inside a
    run of byte-fallback tokens)."""
    special = st.sampled_from(sorted(set(tokenizer.all_special_ids)))
    return st.tuples(
        st.text(MULTILINGUAL, max_size=24).map(lambda text: encode(tokenizer, text)),
        st.lists(st.tuples(st.integers(0, 64), special), max_size=3),
    ).map(lambda drawn: insert(drawn[0], drawn[1], fallback_bytes(tokenizer)))


def insert(ids: list[int], inserts: list[tuple[int, int]], runs: frozenset[int]) -> list[int]:
    ids = list(ids)
    for position, token in inserts:
        at = min(position, len(ids))
        if not (0 < at < len(ids) and ids[at - 1] in runs and ids[at] in runs):
            ids.insert(at, token)
    return ids


PROPERTY = settings(max_examples=100, deadline=None)


@pytest.mark.parametrize("path", ["fast", "generic"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
@pytest.mark.parametrize("name", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_pieces_are_the_full_decode(
    families: dict[str, PreTrainedTokenizerBase], name: str, skip: bool, path: str, data: Any
) -> None:
    tokenizer = families[name]
    ids = data.draw(st.one_of(token_ids(tokenizer), interleaved(tokenizer)), label="ids")
    expected = full_decode(tokenizer, ids, skip)
    detokenizer = detokenizer_for(tokenizer, path, skip_special_tokens=skip)
    emitted = ""
    for token in ids:
        emitted += detokenizer.push(token)
        assert expected.startswith(emitted)  # never text that the full decode does not have
    emitted += detokenizer.flush()
    assert emitted == detokenizer.text == expected
    assert detokenizer.token_ids == ids


@pytest.mark.parametrize("path", ["fast", "generic"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
@pytest.mark.parametrize("name", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_split_characters_never_come_out_as_replacement_characters(
    families: dict[str, PreTrainedTokenizerBase], name: str, skip: bool, path: str, data: Any
) -> None:
    tokenizer = families[name]
    ids = data.draw(interleaved(tokenizer), label="ids")
    expected = full_decode(tokenizer, ids, skip)
    assume("\ufffd" not in expected)
    detokenizer = detokenizer_for(tokenizer, path, skip_special_tokens=skip)
    emitted = [detokenizer.push(token) for token in ids]
    assert not any("\ufffd" in piece for piece in emitted)
    assert "".join(emitted) + detokenizer.flush() == expected


def reference_stop(
    tokenizer: PreTrainedTokenizerBase,
    ids: Sequence[int],
    stop: Sequence[str],
    *,
    include: bool,
    min_tokens: int,
    skip: bool,
) -> tuple[str, str | None]:
    """The text and stop string of a choice, from full decodes: the first token after
    ``min_tokens`` whose decoded text (as it stood then) holds a stop string that starts past
    the text emitted until then ends it, at its earliest (then longest) one."""
    # emitted: the longest complete text of the decodes so far (a byte-fallback run that a new
    # byte makes invalid shrinks the decode, never what was emitted)
    start = max(
        len(full_decode(tokenizer, ids[:count], skip).rstrip("\ufffd"))
        for count in range(min_tokens + 1)
    )
    for count in range(min_tokens + 1, len(ids) + 1):
        text = full_decode(tokenizer, ids[:count], skip)
        found = [(text.find(s, start), -len(s), s) for s in stop]
        matches = [match for match in found if match[0] >= 0]
        if matches:
            index, _, s = min(matches)
            return text[: index + len(s) if include else index], s
    return full_decode(tokenizer, ids, skip), None


@pytest.mark.parametrize("path", ["fast", "generic"])
@pytest.mark.parametrize("name", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_stop_strings_cut_the_text_as_the_full_decode_does(
    families: dict[str, PreTrainedTokenizerBase], name: str, path: str, data: Any
) -> None:
    tokenizer = families[name]
    ids = data.draw(st.one_of(token_ids(tokenizer), interleaved(tokenizer)), label="ids")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    full = full_decode(tokenizer, ids, skip)
    # stop strings from the text itself (so they straddle tokens) and a few arbitrary ones
    inside = st.tuples(st.integers(0, len(full)), st.integers(1, 6)).map(
        lambda cut: full[cut[0] : cut[0] + cut[1]]
    )
    stop = data.draw(
        st.lists(st.one_of(inside, st.text("aeiost ,.日😀", max_size=4)), max_size=3),
        label="stop",
    )
    include = data.draw(st.booleans(), label="include_stop_str_in_output")
    min_tokens = data.draw(st.integers(0, len(ids)), label="min_tokens")
    detokenizer = detokenizer_for(
        tokenizer,
        path,
        skip_special_tokens=skip,
        stop=stop,
        include_stop_str_in_output=include,
        min_tokens=min_tokens,
    )
    emitted = [detokenizer.push(token) for token in ids]
    emitted.append(detokenizer.flush())
    stops = [s for s in stop if s]
    expected = reference_stop(
        tokenizer, ids, stops, include=include, min_tokens=min_tokens, skip=skip
    )
    assert ("".join(emitted), detokenizer.stopped_on) == expected
    assert detokenizer.text == expected[0]
    if not include and len(ids) > min_tokens:  # once stop strings are looked for, none comes out
        assert not any(s in piece for piece in emitted[min_tokens:] for s in stops)


def reference_pieces(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], stop: Sequence[str], skip: bool
) -> list[str]:
    """What decoding everything at every token emits (the detokenizer's former algorithm)."""
    stop = [s for s in stop if s]
    text, pieces = "", []
    for count in range(1, len(ids) + 1):
        decoded = full_decode(tokenizer, ids[:count], skip)
        if stop and (match := find_stop(decoded, stop, len(text))):
            pieces.append(decoded[len(text) : match[0]])
            return [*pieces, ""]
        safe = len(decoded.rstrip("\ufffd"))
        safe -= partial_stop_length(decoded[:safe], stop) if stop else 0
        pieces.append(decoded[len(text) : safe])
        text += pieces[-1]
    return [*pieces, full_decode(tokenizer, ids, skip)[len(text) :]]


@pytest.mark.parametrize("path", ["fast", "generic"])
@pytest.mark.parametrize("name", FAMILIES)
@PROPERTY
@given(data=st.data())
def test_each_piece_is_what_decoding_everything_emits(
    families: dict[str, PreTrainedTokenizerBase], name: str, path: str, data: Any
) -> None:
    tokenizer = families[name]
    ids = data.draw(st.one_of(token_ids(tokenizer), interleaved(tokenizer)), label="ids")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    stop = data.draw(st.lists(st.text("aeiost ,.日😀", min_size=1, max_size=3), max_size=2))
    detokenizer = detokenizer_for(tokenizer, path, skip_special_tokens=skip, stop=stop)
    emitted = pieces(detokenizer, ids)
    expected = reference_pieces(tokenizer, ids, stop, skip)
    assert emitted[: len(expected) - 1] == expected[:-1]  # the same piece for every token
    assert "".join(emitted) == "".join(expected)


@pytest.mark.parametrize("skip", [True, False], ids=["skip", "keep"])
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("double", [CountingTokenizer, GenericTokenizer])
def test_each_token_decodes_a_bounded_window(
    families: dict[str, PreTrainedTokenizerBase],
    name: str,
    skip: bool,
    double: type[CountingTokenizer] | type[GenericTokenizer],
) -> None:
    tokenizer = families[name]
    sentences = [encode(tokenizer, text) for text in TEXTS]
    special = tokenizer.all_special_ids
    ids: list[int] = []
    while len(ids) < 2000:
        ids += [*sentences[len(ids) % len(sentences)], special[len(ids) % len(special)]]
    ids = ids[:2000]
    counting = double(tokenizer)
    detokenizer = IncrementalDetokenizer(
        cast(PreTrainedTokenizerBase, counting), skip_special_tokens=skip, stop=["never seen"]
    )
    emitted = [detokenizer.push(token) for token in ids]
    emitted.append(detokenizer.flush())
    assert "".join(emitted) == full_decode(tokenizer, ids, skip)
    assert len(counting.sizes) <= 2 * len(ids)
    assert max(counting.sizes) <= 16


@pytest.mark.parametrize("after", ["", "next"])
def test_byte_fallback_characters_that_a_later_byte_invalidates_stay_as_emitted(
    families: dict[str, PreTrainedTokenizerBase], after: str
) -> None:
    """A byte-fallback decoder decodes a run of byte tokens as a whole: one byte that does not
    complete a character turns every character of the run into "\\ufffd", also characters that
    were complete and emitted. No stream can take them back (holding every byte-coded character
    until a token that is no byte follows would delay each one, newlines included), so the text
    keeps them and goes on with the full decode past them, as decoding everything at every token
    did (and as vLLM keeps them)."""
    tokenizer = families["byte_fallback"]
    ids = encode(tokenizer, "a日")
    first_byte_of_ni = ids[-3]
    ids += [first_byte_of_ni, *(encode(tokenizer, after) if after else [])]
    full = full_decode(tokenizer, ids, True)
    assert full == "a\ufffd\ufffd\ufffd\ufffd" + (" next" if after else "")
    emitted = pieces(IncrementalDetokenizer(tokenizer), ids)
    assert emitted == reference_pieces(tokenizer, ids, [], skip=True)
    assert "".join(emitted) == "a日" + full[2:]
