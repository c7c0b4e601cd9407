"""Prompt tokenization: the tokenizer's own ids for every prompt that fits, and a prompt far
longer than the context refused after tokenizing a bounded cut of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers.pre_tokenizers import Metaspace
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from huggingfaceserver.protocols.openai import prompts
from huggingfaceserver.protocols.openai.errors import InvalidParameter
from huggingfaceserver.protocols.openai.prompts import TokenizerTraits, tokenize_prompt

TEXTS = [
    "Hello world",
    "The capital of France is Paris. " * 40,
    "é" * 300,
    " " * 700,
    "Paris" * 200,
    "a\n\n b\tc " * 150,
]


@pytest.fixture(scope="module", params=["gpt2", "llama", "t5", "bert_fill_mask", "one piece"])
def tokenizer(request, tiny_models: dict[str, Path]) -> PreTrainedTokenizerBase:
    """The tiny models' tokenizers, and t5's made to tokenize a text as one piece (as
    sentencepiece-style BPE tokenizers such as Llama 2's do)."""
    if request.param != "one piece":
        return AutoTokenizer.from_pretrained(tiny_models[request.param])
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["t5"])
    tokenizer.backend_tokenizer.pre_tokenizer = Metaspace(split=False)
    assert not TokenizerTraits.of(tokenizer).splits
    return tokenizer


@pytest.mark.parametrize("max_len", [4, 16, 64, 1024])
@pytest.mark.parametrize("special", [True, False], ids=["special", "plain"])
def test_ids_are_the_tokenizers_or_the_prompt_is_longer_than_the_context(
    tokenizer, max_len, special
):
    for text in TEXTS:
        expected = tokenizer(text, add_special_tokens=special)["input_ids"]
        try:
            ids = tokenize_prompt(tokenizer, text, max_len, "prompt", add_special_tokens=special)
        except InvalidParameter as exc:
            assert len(expected) > max_len, (text[:40], exc.message)
            assert exc.code == "context_length_exceeded" and exc.param == "prompt"
            continue
        assert ids == expected, text[:40]


def test_a_prompt_far_longer_than_the_context_is_tokenized_only_in_part(tokenizer, monkeypatch):
    tokenized: list[int] = []
    tokenize = prompts.tokenize

    def recording(tokenizer, text, add_special_tokens):
        tokenized.append(len(text))
        return tokenize(tokenizer, text, add_special_tokens)

    monkeypatch.setattr(prompts, "tokenize", recording)
    max_len = 128
    text = "The capital of France is Paris. " * 160_000  # 5 MB
    with pytest.raises(InvalidParameter, match="at least") as caught:
        tokenize_prompt(tokenizer, text, max_len, "messages")
    assert caught.value.param == "messages"
    assert sum(tokenized) <= 2 * (max_len + 1) * TokenizerTraits.of(tokenizer).longest
