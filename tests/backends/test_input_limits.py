"""Inputs longer than the maximum: cut to a window that truncates exactly as transformers
truncates the whole text (bounded work), or refused with ``--no_truncation``."""

from __future__ import annotations

import random
import re
import threading

import numpy as np
import pytest
from tokenizers import AddedToken, pre_tokenizers
from transformers import AutoTokenizer

from huggingfaceserver.backends.long_inputs import InputTooLong
from huggingfaceserver.backends.row_tokenizer import RowTokenizer
from tiny_models import CORPUS

MAX_LENGTH = 24
TOKENIZERS = [
    "bert_token_classification",
    "distilbert_sequence_classification",
    "gpt2",
    "llama",
    "t5",
    "bert_token_classification+added",
    "gpt2+added",
    "t5+added",
    "t5+added+metaspace",  # whitespace pieces of their own, which an lstrip token takes
]
ADDED = [
    AddedToken("<|im_start|>", special=True),  # many pieces when cut: < | im _ start
    AddedToken("<wide_mask>", lstrip=True),  # takes the whitespace on its left
]
"""Added tokens for the ``+added`` tokenizers: ones that the cut can split at a distance."""
PIECES = [
    *" ".join(CORPUS).split(),
    *",.;:!?'\"()-",
    "ünïcödé",
    "Ångström",
    "e\u0301",  # a combining accent
    "日本語",
    "🙂",
    "[MASK]",
    "[SEP]",
    "<|endoftext|>",
    "</s>",
    *(token.content for token in ADDED),
    " " * 30 + ADDED[1].content,  # the whitespace it takes is longer than any added token
    "\x00",
    "\u200b",
    "1234567890",
    "antidisestablishmentarianism",
    "x" * 50,
]
SEPARATORS = [" ", " ", " ", "", "  ", "\n", "\t", " \n ", " " * 9]


class Recording:
    """The Rust tokenizer, noting the characters each call hands it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls: list[int] = []

    def encode(self, *texts, **kwargs):
        self.calls.append(sum(len(t) for t in texts if isinstance(t, str)))
        return self.tokenizer.encode(*texts, **kwargs)

    def encode_batch(self, inputs, **kwargs):
        self.calls.extend(sum(map(len, i)) if isinstance(i, tuple) else len(i) for i in inputs)
        return self.tokenizer.encode_batch(inputs, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def recorded(row_tokenizer: RowTokenizer) -> Recording:
    recording = Recording(row_tokenizer.rust)
    row_tokenizer.rust = recording  # type: ignore[assignment]
    assert row_tokenizer.long is not None
    row_tokenizer.long.tokenizer = recording  # type: ignore[assignment]
    return recording


def random_text(rng: random.Random, chars: int) -> str:
    parts, size = [], 0
    while size < chars:
        part = rng.choice(PIECES) + rng.choice(SEPARATORS)
        parts.append(part)
        size += len(part)
    return "".join(parts)


def long_texts(window: int, count: int = 12) -> list[str]:
    """Texts of one to four windows, cut at every kind of place, some with whitespace runs
    longer than a window (which settle no tokens: the window must grow)."""
    rng = random.Random(0)
    texts = [random_text(rng, rng.randrange(window, 4 * window)) for _ in range(count)]
    texts.append("start " + " " * (3 * window) + random_text(rng, 2 * window))
    texts.append(random_text(rng, window // 2) + "\n" * (2 * window) + random_text(rng, window))
    return texts


def assert_rows_equal(rows, reference, keys):
    assert len(rows) == len(reference["input_ids"])
    for index, row in enumerate(rows):
        for key in keys:
            want = np.array(reference[key][index], dtype=np.int64)
            got = row[key].reshape(want.shape)
            np.testing.assert_array_equal(got, want, err_msg=f"{key} of input {index}")


@pytest.fixture(params=TOKENIZERS)
def tokenizer(request, tiny_models):
    name, *variant = request.param.split("+")
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[name])
    if "added" in variant:
        tokenizer.add_tokens(ADDED)
    if "metaspace" in variant:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    return tokenizer


def test_long_texts_truncate_as_transformers_truncates_them_whole(tokenizer):
    row_tokenizer = RowTokenizer(tokenizer, MAX_LENGTH, offsets=True)
    assert row_tokenizer.long is not None
    texts = long_texts(row_tokenizer.long.first_window(MAX_LENGTH))
    recording = recorded(row_tokenizer)
    rows = row_tokenizer.texts(texts)
    reference = tokenizer(
        texts, truncation=True, max_length=MAX_LENGTH, return_offsets_mapping=True
    )
    assert_rows_equal(rows, reference, ["input_ids", "offset_mapping"])
    assert sum(recording.calls) < sum(len(text) for text in texts)  # some were cut


def test_settled_tokens_are_those_of_the_whole_text_wherever_it_is_cut(tokenizer):
    row_tokenizer = RowTokenizer(tokenizer, MAX_LENGTH)
    long = row_tokenizer.long
    assert long is not None
    rng = random.Random(2)
    text = random_text(rng, 100) + " ".join(PIECES[-20:]) + random_text(rng, 100)
    whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    counted = []
    for cut in range(1, len(text)):
        parts = long.encode(text[:cut])
        settled = long.settled_tokens(text[:cut])
        ids = [i for part in parts for i in part.ids][:settled]
        offsets = [o for part in parts for o in part.offsets][:settled]
        assert ids == whole["input_ids"][:settled], cut
        assert offsets == [tuple(o) for o in whole["offset_mapping"][:settled]], cut
        counted.append(settled)
    assert max(counted) > len(whole["input_ids"]) // 2  # not a check passed by settling nothing


@pytest.mark.parametrize("extra", [0, 1, 2, 3, 5, 8])
def test_windows_that_barely_hold_the_tokens_truncate_as_transformers_does(tokenizer, extra):
    row_tokenizer = RowTokenizer(tokenizer, MAX_LENGTH, offsets=True)
    assert row_tokenizer.long is not None
    row_tokenizer.long.first_window = lambda needed: needed + extra  # type: ignore[method-assign]
    texts = long_texts(200, count=6)
    rows = row_tokenizer.texts(texts)
    reference = tokenizer(
        texts, truncation=True, max_length=MAX_LENGTH, return_offsets_mapping=True
    )
    assert_rows_equal(rows, reference, ["input_ids", "offset_mapping"])


def test_the_real_minilm_tokenizer(minilm_path):
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    row_tokenizer = RowTokenizer(tokenizer, 512, offsets=True)
    assert row_tokenizer.long is not None
    texts = long_texts(row_tokenizer.long.first_window(512), count=4)
    rows = row_tokenizer.texts(texts)
    reference = tokenizer(texts, truncation=True, max_length=512, return_offsets_mapping=True)
    assert_rows_equal(rows, reference, ["input_ids", "token_type_ids", "offset_mapping"])


def test_a_5_mb_text_is_tokenized_in_a_bounded_window(minilm_path):
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    row_tokenizer = RowTokenizer(tokenizer, 512, offsets=True)
    assert row_tokenizer.long is not None
    window = row_tokenizer.long.first_window(512 - 2 + 1)
    text = (" ".join(CORPUS) + " ") * (5_000_000 // len(" ".join(CORPUS)) + 1)
    recording = recorded(row_tokenizer)
    [row] = row_tokenizer.texts([text])
    assert max(recording.calls) <= window and sum(recording.calls) <= 2 * window
    # the first 512 tokens of a text are those of its first 50,000 characters (as the test
    # above checks on texts that transformers can tokenize whole in a test's time)
    reference = tokenizer([text[:50_000]], truncation=True, max_length=512)
    assert_rows_equal([row], reference, ["input_ids"])


async def test_a_long_text_is_tokenized_on_the_tokenizing_thread(encoder, tiny_models, monkeypatch):
    backend = encoder(tiny_models["st_cls"]).backend
    threads = []

    def texts(inputs, *options):
        threads.append(threading.current_thread().name)
        return encode(inputs, *options)

    encode = backend.inputs.texts
    monkeypatch.setattr(backend.inputs, "texts", texts)
    await backend.infer(["a short text"])
    await backend.infer(["a long text " * 1_000])
    assert threads[0] == threading.main_thread().name
    assert threads[1].startswith("tokenize")


PAIR_MAX = 33  # 30 tokens for the two texts


@pytest.mark.parametrize("max_length", [PAIR_MAX, PAIR_MAX + 1], ids=["even", "odd"])
def test_long_pairs_truncate_as_transformers_truncates_them_whole(tiny_models, max_length):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["bert_sequence_classification"])
    encoder = RowTokenizer(tokenizer, max_length)
    assert encoder.long is not None
    window = encoder.long.first_window(max_length)
    documents = [*long_texts(window, count=4), "short document", "a b c d e f g h i j k l m n o"]
    rng = random.Random(1)
    queries = [
        "the query",
        "q " * 20,  # over half the pair's tokens: truncated too
        "q " * 40,  # over the maximum alone, yet within a window: counted whole
        random_text(rng, 3 * window),  # cut to a window
    ]
    for query in queries:
        pairs = [(query, document) for document in documents]
        if query is queries[-1] and max_length % 2 == 0:
            # Both sides cut, and an odd number of tokens to share: which side keeps the odd
            # one depends on which is longer whole, which no window tells.
            pairs = [(query, document) for document in documents if len(document) <= window]
        rows = encoder.pairs(query, [document for _, document in pairs])
        reference = tokenizer(*zip(*pairs, strict=True), truncation=True, max_length=max_length)
        assert_rows_equal(rows, reference, ["input_ids", "token_type_ids"])


def refusal(exc: pytest.ExceptionInfo[InputTooLong]) -> tuple[str, int, bool]:
    message = str(exc.value)
    assert message.endswith(
        f"more than the maximum of {MAX_LENGTH} (--max_length); "
        "shorten it or run without --no_truncation"
    ), message
    return message, exc.value.tokens, exc.value.at_least


@pytest.mark.parametrize("fast", [True, False], ids=["rust", "transformers"])
def test_without_truncation_an_input_over_the_maximum_is_refused_with_both_lengths(tokenizer, fast):
    encoder = RowTokenizer(tokenizer, MAX_LENGTH, truncate=False)
    if not fast:
        encoder.rust = encoder.long = None
    text = " ".join(CORPUS[:3])
    tokens = len(tokenizer(text)["input_ids"])
    assert tokens > MAX_LENGTH
    fits = tokenizer.decode(tokenizer(text)["input_ids"][:5], skip_special_tokens=True)
    with pytest.raises(InputTooLong) as exc:
        encoder.texts([fits, text])
    message, counted, at_least = refusal(exc)
    assert message.startswith(f"input 1 has {tokens} tokens,")
    assert (counted, at_least) == (tokens, False)
    rows = encoder.texts([fits])
    assert_rows_equal(rows, tokenizer([fits]), ["input_ids"])


def test_without_truncation_a_huge_input_is_refused_unread(tokenizer):
    encoder = RowTokenizer(tokenizer, MAX_LENGTH, truncate=False)
    recording = recorded(encoder)
    text = " ".join(CORPUS) * 2_000  # about 4 MB
    with pytest.raises(InputTooLong) as exc:
        encoder.texts([text])
    message, counted, at_least = refusal(exc)
    assert at_least and re.match(rf"input 0 has at least {counted} tokens,", message)
    whole = len(tokenizer(" ".join(CORPUS))["input_ids"])  # the text has 2,000 times more
    assert MAX_LENGTH < counted <= whole
    assert encoder.long is not None
    assert sum(recording.calls) <= encoder.long.first_window(MAX_LENGTH + 1)


def test_without_truncation_pairs_over_the_maximum_are_refused(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["bert_sequence_classification"])
    encoder = RowTokenizer(tokenizer, MAX_LENGTH, truncate=False)
    long_document = " ".join(CORPUS[:3])
    tokens = len(tokenizer("the query", long_document)["input_ids"])
    with pytest.raises(InputTooLong) as exc:
        encoder.pairs("the query", ["short", long_document])
    assert str(exc.value).startswith(
        f"pair 1 (the query and document 1) has {tokens} tokens, more than the maximum of "
        f"{MAX_LENGTH}"
    )
    with pytest.raises(InputTooLong, match="^the query has at least"):
        encoder.pairs(" ".join(CORPUS) * 100, ["short"])
