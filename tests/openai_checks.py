"""Checks on OpenAI answers that hold whichever backend serves them, and the transformers
oracle they are compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

if TYPE_CHECKING:  # the clients are the callers'; the GPU machine's tests run without openai
    import openai

MAX_TOKENS = 12
"""Tokens the greedy comparisons generate unless they say otherwise."""


def check_streamed_chat_adds_up(client: openai.OpenAI, model: str, messages: Any) -> None:
    """The streamed chat equals the whole answer: role in the first delta only, finish_reason
    in the last chunk only, then the usage chunk (``stream_options.include_usage``)."""
    request = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 16}
    whole = client.chat.completions.create(**request)
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    *deltas, last = chunks
    assert deltas[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in deltas[1:])
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == (
        whole.choices[0].message.content
    )
    assert [c.choices[0].finish_reason for c in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert last.choices == [] and last.usage == whole.usage


def middle_substring(text: str, length: int = 3) -> str:
    """A substring from the second half of ``text`` that is whole characters (a stop string
    that greedy generation meets midway)."""
    return next(
        text[i : i + length]
        for i in range(len(text) // 2, len(text) - length)
        if "\ufffd" not in text[i : i + length]
    )


@dataclass
class Reference:
    """The model and tokenizer loaded straight from the folder: the oracle."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def chat_ids(self, messages: list[dict[str, str]], template: str | None = None) -> list[int]:
        """The chat template rendered with the generation prompt, tokenized without adding
        special tokens a second time."""
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def greedy(self, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        """``model.generate`` greedy: the new tokens, up to and with the EOS if it came."""
        with torch.no_grad():
            output = self.model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_tokens,
            )[0].tolist()
        return output[1:] if self.model.config.is_encoder_decoder else output[len(prompt_ids) :]

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def log_softmax(self, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        """The model's log-softmax at each generated position: ``[len(output_ids), vocab]``."""
        return model_log_softmax(self.model, prompt_ids, output_ids)

    def finish_reason(self, new_ids: list[int], max_tokens: int = MAX_TOKENS) -> str:
        ended_on_eos = len(new_ids) < max_tokens or new_ids[-1] == self.tokenizer.eos_token_id
        return "stop" if ended_on_eos else "length"


def model_log_softmax(
    model: PreTrainedModel, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """The model's log-softmax at each generated position: ``[len(output_ids), vocab]``."""
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            start = model.config.decoder_start_token_id
            logits = model(
                input_ids=torch.tensor([prompt_ids]),
                decoder_input_ids=torch.tensor([[start, *output_ids[:-1]]]),
            ).logits[0]
        else:
            ids = torch.tensor([prompt_ids + output_ids[:-1]])
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 :]
    return logits.float().log_softmax(dim=-1)
