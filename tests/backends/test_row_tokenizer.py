"""Encoder inputs to rows: the same token ids, types and offsets as ``tokenizer(...)``, for
every tokenizer the tests build, through the Rust fast path and through transformers."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from huggingfaceserver.backends.long_inputs import InputTooLong
from huggingfaceserver.backends.row_tokenizer import FEW_INPUTS, RowTokenizer
from huggingfaceserver.backends.truncation import Truncation
from tiny_models import CORPUS

TEXTS = [
    "john lives in new york",
    "The Capital of FRANCE is Paris, isn't it?",
    "ünïcödé 日本語 and an emoji 🙂",
    "  spaces   around  ",
    "a very long text " * 40,
]
MAX_LENGTH = 24
TOKENIZERS = [
    "bert_token_classification",
    "distilbert_sequence_classification",
    "gpt2",
    "llama",
    "t5",
]


def expected(tokenizer, *args, **kwargs) -> dict:
    return tokenizer(*args, truncation=True, max_length=MAX_LENGTH, **kwargs)


def check_rows(rows, reference, keys):
    assert len(rows) == len(reference["input_ids"])
    for row, index in zip(rows, range(len(rows)), strict=True):
        for key in keys:
            want = np.array(reference[key][index], dtype=np.int64)
            assert row[key].dtype == np.int64
            np.testing.assert_array_equal(row[key].reshape(want.shape), want, err_msg=key)


@pytest.fixture(params=TOKENIZERS)
def tokenizer(request, tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models[request.param])


@pytest.mark.parametrize("fast", [True, False], ids=["rust", "transformers"])
@pytest.mark.parametrize("count", [1, FEW_INPUTS + 1], ids=["one-by-one", "batched"])
def test_texts_are_tokenized_as_the_tokenizer_does(tokenizer, fast, count):
    row_tokenizer = RowTokenizer(tokenizer, MAX_LENGTH, offsets=True)
    if not fast:
        row_tokenizer.rust = None
    assert (row_tokenizer.rust is not None) == fast
    texts = (TEXTS * 2)[:count]
    reference = expected(tokenizer, texts, return_offsets_mapping=True)
    keys = ["input_ids", "offset_mapping"]
    if "token_type_ids" in tokenizer.model_input_names:
        keys.append("token_type_ids")
    check_rows(row_tokenizer.texts(texts), reference, keys)


def test_without_special_tokens(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["bert_token_classification"])
    rows = RowTokenizer(tokenizer, MAX_LENGTH, add_special_tokens=False).texts(TEXTS[:2])
    check_rows(rows, expected(tokenizer, TEXTS[:2], add_special_tokens=False), ["input_ids"])


@pytest.mark.parametrize("count", [2, FEW_INPUTS + 2])
def test_pairs_are_the_cross_encoder_inputs(tiny_models, count):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["bert_sequence_classification"])
    documents = (TEXTS * 2)[:count]
    reference = expected(tokenizer, ["the query"] * count, documents)
    rows = RowTokenizer(tokenizer, MAX_LENGTH).pairs("the query", documents)
    check_rows(rows, reference, ["input_ids", "token_type_ids"])


def test_forced_token_type_ids_for_a_tokenizer_without_them(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["distilbert_sequence_classification"])
    assert "token_type_ids" not in tokenizer.model_input_names
    assert "token_type_ids" not in RowTokenizer(tokenizer, MAX_LENGTH).texts(["a"])[0]
    forced = RowTokenizer(tokenizer, MAX_LENGTH, token_type_ids=True).texts(TEXTS[:2])
    reference = expected(tokenizer, TEXTS[:2], return_token_type_ids=True)
    check_rows(forced, reference, ["input_ids", "token_type_ids"])


def test_token_ids_are_used_as_they_are_with_the_same_columns(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["bert_token_classification"])
    row_tokenizer = RowTokenizer(tokenizer, MAX_LENGTH, offsets=True)
    [row] = row_tokenizer.token_ids([[5, 6, 7]])
    assert set(row) == set(row_tokenizer.texts(["a"])[0])
    np.testing.assert_array_equal(row["input_ids"], [5, 6, 7])
    np.testing.assert_array_equal(row["token_type_ids"], [0, 0, 0])
    assert row["offset_mapping"].shape == (3, 2)


def test_the_real_minilm_tokenizer(minilm_path):
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    row_tokenizer = RowTokenizer(tokenizer, 512)
    assert row_tokenizer.rust is not None
    rows = row_tokenizer.texts(TEXTS)
    reference = tokenizer(TEXTS, truncation=True, max_length=512)
    check_rows(rows, reference, ["input_ids", "token_type_ids"])


def test_a_tokenizer_that_encodes_otherwise_goes_through_transformers(tiny_models):
    """A fast tokenizer whose own call changes the text first (here: upper case) is not
    copied to the Rust path, whose ids would differ: its rows are what its call gives."""
    plain = AutoTokenizer.from_pretrained(tiny_models["gpt2"])

    class Shouting(type(plain)):  # type: ignore[misc]
        def __call__(self, text=None, text_pair=None, **kwargs):
            def upper(value):
                if isinstance(value, str):
                    return value.upper()
                return None if value is None else [upper(v) for v in value]

            return super().__call__(upper(text), upper(text_pair), **kwargs)

    shouting = Shouting.from_pretrained(tiny_models["gpt2"])
    assert RowTokenizer(plain, MAX_LENGTH).rust is not None
    row_tokenizer = RowTokenizer(shouting, MAX_LENGTH, offsets=True)
    assert row_tokenizer.rust is None
    reference = expected(shouting, TEXTS, return_offsets_mapping=True)
    assert reference["input_ids"] != expected(plain, TEXTS)["input_ids"]
    check_rows(row_tokenizer.texts(TEXTS), reference, ["input_ids", "offset_mapping"])


def tokenized_as(tokenizer, truncation: Truncation, *texts, **kwargs) -> dict:
    """What ``tokenizer`` gives truncating at ``truncation`` (its side set for the call)."""
    saved, tokenizer.truncation_side = tokenizer.truncation_side, truncation.side
    try:
        return tokenizer(*texts, truncation=True, max_length=truncation.limit, **kwargs)
    finally:
        tokenizer.truncation_side = saved


LONG = " ".join(CORPUS[:3])
ASKED = [
    Truncation(True, "left", MAX_LENGTH),
    Truncation(True, "right", 9),
    Truncation(True, "left", 9),
]


@pytest.mark.parametrize("fast", [True, False], ids=["rust", "transformers"])
@pytest.mark.parametrize("truncation", ASKED, ids=["left", "right-9", "left-9"])
def test_a_request_truncates_its_own_way(tokenizer, fast, truncation):
    """Another side or fewer tokens than the server's: what the tokenizer gives truncating
    that way, special tokens kept, offsets of the text's own characters."""
    row_tokenizer = RowTokenizer(tokenizer, MAX_LENGTH, offsets=True)
    if not fast:
        row_tokenizer.rust = row_tokenizer.long = None
    texts = [*TEXTS, LONG, LONG * 300]
    reference = tokenized_as(tokenizer, truncation, texts, return_offsets_mapping=True)
    keys = ["input_ids", "offset_mapping"]
    if "token_type_ids" in tokenizer.model_input_names:
        keys.append("token_type_ids")
    check_rows(row_tokenizer.texts(texts, truncation), reference, keys)
    # the server's own truncation is untouched by the requests that asked for another
    check_rows(
        row_tokenizer.texts(texts), expected(tokenizer, texts, return_offsets_mapping=True), keys
    )


def test_a_request_that_refuses_truncation(tokenizer):
    row_tokenizer = RowTokenizer(tokenizer, MAX_LENGTH)
    tokens = len(tokenizer(LONG)["input_ids"])
    with pytest.raises(InputTooLong, match=rf"^input 1 has {tokens} tokens, .*truncate: true$"):
        row_tokenizer.texts(["short", LONG], Truncation(False, "right", MAX_LENGTH))
    with pytest.raises(InputTooLong, match=r"^input 0 has at least \d+ tokens"):
        row_tokenizer.texts([LONG * 2_000], Truncation(False, "left", MAX_LENGTH))


@pytest.mark.parametrize("side", ["left", "right"])
def test_pairs_truncated_on_a_side(tiny_models, side):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["bert_sequence_classification"])
    row_tokenizer = RowTokenizer(tokenizer, MAX_LENGTH)
    pairs = [("the query", LONG), (LONG, "a short document"), ("a", "b")]
    truncation = Truncation(True, side, MAX_LENGTH)
    reference = tokenized_as(tokenizer, truncation, *map(list, zip(*pairs, strict=True)))
    check_rows(
        row_tokenizer.pairs_of(pairs, truncation), reference, ["input_ids", "token_type_ids"]
    )


def test_rows_say_which_tokens_pooling_reads(tiny_models):
    """Left out of the pooling: a prompt's tokens, less the special token it ends with when
    encoded alone (as sentence-transformers counts them)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["bert_embedding"])
    row_tokenizer = RowTokenizer(tokenizer, MAX_LENGTH, pooling_mask=True)
    prompt = "represent the question :"
    length = row_tokenizer.prompt_length(prompt)
    assert length == len(tokenizer(prompt)["input_ids"]) - 1  # [CLS] and its words, not [SEP]
    [row] = row_tokenizer.texts([prompt + " where is paris"], prompt_length=length)
    np.testing.assert_array_equal(row["pooling_mask"][: length + 1], [0] * length + [1])
    assert row["pooling_mask"][length:].all()
    [plain] = row_tokenizer.token_ids([[5, 6, 7]])
    np.testing.assert_array_equal(plain["pooling_mask"], [1, 1, 1])
