"""OpenAI request models: bounds, input forms, unsupported fields, conversion to SamplingParams."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from huggingfaceserver.generation.params import SamplingParams
from huggingfaceserver.protocols.openai.encoder_requests import EmbeddingRequest, RerankRequest
from huggingfaceserver.protocols.openai.requests import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def embedding(**fields: Any) -> EmbeddingRequest:
    return EmbeddingRequest.model_validate({"model": "m", "input": "hi", **fields})


def rerank(**fields: Any) -> RerankRequest:
    return RerankRequest.model_validate({"model": "m", "query": "q", "documents": ["d"], **fields})


def refused(build: Any, **fields: Any) -> tuple[tuple[int | str, ...], str]:
    """The location and message of the one error ``build(**fields)`` raises."""
    with pytest.raises(ValidationError) as caught:
        build(**fields)
    errors = caught.value.errors()
    assert len(errors) == 1, errors
    return errors[0]["loc"], errors[0]["msg"]


BOUNDS = [
    (completion, "temperature", -0.1),
    (completion, "temperature", 2.01),
    (completion, "top_p", 0),
    (completion, "top_p", 1.01),
    (completion, "n", 0),
    (completion, "n", 129),
    (completion, "presence_penalty", -2.01),
    (completion, "frequency_penalty", 2.01),
    (completion, "max_tokens", 0),
    (completion, "logprobs", 21),
    (completion, "logprobs", -1),
    (completion, "logprobs", True),
    (completion, "best_of", 0),
    (completion, "seed", 2**64),
    (completion, "top_k", -2),
    (completion, "top_k", 2**63),
    (completion, "min_tokens", 2**63),
    (completion, "min_p", 1.5),
    (completion, "repetition_penalty", 0),
    (completion, "min_tokens", -1),
    (completion, "stop_token_ids", [-1]),
    (completion, "stop", ["s"] * 17),
    (completion, "stop", ""),
    (completion, "stop", ["a", 1]),
    (completion, "stream_options", {"include_usage": True}),  # without stream
    (chat, "temperature", 3),
    (chat, "max_tokens", 0),
    (chat, "max_completion_tokens", 0),
    (chat, "top_logprobs", 21),
    (chat, "logprobs", 5),
    (chat, "messages", []),
    (embedding, "dimensions", 0),
    (embedding, "encoding_format", "int8"),
    (rerank, "top_n", 0),
    (rerank, "query", ""),
    (rerank, "documents", []),
]


@pytest.mark.parametrize(
    ("build", "field", "value"), BOUNDS, ids=[f"{b.__name__}-{f}-{v!r}"[:60] for b, f, v in BOUNDS]
)
def test_out_of_bounds_values_name_their_field(build, field, value):
    loc, _ = refused(build, **{field: value})
    assert loc[0] == field


def test_logit_bias_value_bounds_name_the_key():
    loc, _ = refused(completion, logit_bias={"5": 100.5})
    assert loc == ("logit_bias", "5")


@pytest.mark.parametrize("key", ["abc", "-1", "1.5", ""])
def test_logit_bias_keys_must_be_token_ids(key):
    loc, message = refused(chat, logit_bias={key: 1})
    assert loc == ("logit_bias",)
    assert repr(key) in message


def test_logit_bias_keys_become_ints():
    params = chat(logit_bias={"50256": -100, "7": 2.5}).to_sampling_params()
    assert params.logit_bias == {50256: -100.0, 7: 2.5}


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("once upon", ["once upon"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_forms(prompt, prompts):
    assert completion(prompt=prompt).prompts() == prompts


@pytest.mark.parametrize(
    "prompt",
    [5, None, {"text": "a"}, [], "", [""], [[]], ["a", 1], [1, "a"], [[1], "a"], [-1], [True]],
)
def test_bad_prompts_are_refused(prompt):
    loc, _ = refused(completion, prompt=prompt)
    assert loc == ("prompt",)


def test_text_content_parts_are_joined():
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    request = chat(messages=[{"role": "user", "content": parts}])
    assert request.conversation() == [{"role": "user", "content": "first\nsecond"}]


@pytest.mark.parametrize("part_type", ["image_url", "input_audio", "file", "refusal"])
def test_other_content_parts_are_refused_by_name(part_type):
    part = {"type": part_type, part_type: {"url": "http://x"}}
    loc, message = refused(chat, messages=[{"role": "user", "content": [part]}])
    assert loc == ("messages", 0, "content")
    assert part_type in message


@pytest.mark.parametrize("content", [["plain string"], [{"text": "no type"}], 42])
def test_malformed_content_is_refused(content):
    loc, _ = refused(chat, messages=[{"role": "user", "content": content}])
    assert loc == ("messages", 0, "content")


def test_conversation_for_the_chat_template():
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert chat(messages=messages).conversation() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


def test_messages_need_a_known_role_and_content():
    loc, _ = refused(chat, messages=[{"role": "function", "content": "x"}])
    assert loc == ("messages", 0, "role")
    loc, message = refused(chat, messages=[{"role": "user"}])
    assert loc == ("messages", 0)
    assert "content" in message


@pytest.mark.parametrize(
    ("fields", "default", "expected"),
    [
        ({"max_tokens": 10, "max_completion_tokens": 20}, 99, 20),
        ({"max_tokens": 10}, 99, 10),
        ({"max_completion_tokens": 20}, None, 20),
        ({}, 99, 99),
        ({}, None, None),  # up to the context length
        ({"max_tokens": None, "max_completion_tokens": None}, None, None),
    ],
)
def test_chat_max_tokens_precedence(fields, default, expected):
    assert chat(**fields).to_sampling_params(default).max_tokens == expected


@pytest.mark.parametrize(
    ("fields", "default", "expected"),
    [({"max_tokens": 5}, 99, 5), ({}, 99, 99), ({}, None, 16), ({"max_tokens": None}, None, 16)],
)
def test_completion_max_tokens_precedence(fields, default, expected):
    assert completion(**fields).to_sampling_params(default).max_tokens == expected


def test_defaults_are_the_neutral_sampling_params():
    assert chat().to_sampling_params() == SamplingParams()
    assert completion().to_sampling_params() == SamplingParams(max_tokens=16)
    nulls = dict.fromkeys(
        ["temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty"]
    )
    assert chat(**nulls, logit_bias=None, stream=None).to_sampling_params() == SamplingParams()


@pytest.mark.parametrize("temperature", [0, 0.0, 1e-6])
def test_temperature_zero_is_greedy(temperature):
    params = chat(temperature=temperature, top_p=0.5, top_k=5, min_p=0.2).to_sampling_params()
    assert params.greedy
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 1.0, 0, 0.0)


def test_top_k_minus_one_is_off():
    assert chat(top_k=-1).to_sampling_params().top_k == 0


def test_fully_specified_completion_converts_exactly():
    request = completion(
        prompt=[[1, 2]],
        max_tokens=32,
        temperature=0.7,
        top_p=0.9,
        n=3,
        best_of=3,
        stop=["\n\n", "END"],
        stream=True,
        stream_options={"include_usage": True},
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"11": 5},
        logprobs=2,
        echo=False,
        user="u",
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=4,
        ignore_eos=True,
        stop_token_ids=[7, 8],
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    assert request.include_usage
    assert request.to_sampling_params(default_max_tokens=100) == SamplingParams(
        n=3,
        max_tokens=32,
        min_tokens=4,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={11: 5.0},
        stop=("\n\n", "END"),
        stop_token_ids=(7, 8),
        ignore_eos=True,
        logprobs=2,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )


def test_stop_string_becomes_a_tuple():
    assert chat(stop="###").to_sampling_params().stop == ("###",)


@pytest.mark.parametrize(
    ("fields", "logprobs"),
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 0}, 0),
        ({"logprobs": True, "top_logprobs": 5}, 5),
    ],
)
def test_chat_logprobs(fields, logprobs):
    assert chat(**fields).to_sampling_params().logprobs == logprobs


@pytest.mark.parametrize("logprobs", [None, False])
def test_chat_top_logprobs_require_logprobs(logprobs):
    loc, message = refused(chat, logprobs=logprobs, top_logprobs=2)
    assert loc == ("top_logprobs",)
    assert "logprobs" in message


@pytest.mark.parametrize(("logprobs", "expected"), [(None, None), (0, 0), (3, 3)])
def test_completion_logprobs(logprobs, expected):
    assert completion(logprobs=logprobs).to_sampling_params().logprobs == expected


UNSUPPORTED = [
    (completion, "suffix", "!"),
    (completion, "tools", [{"type": "function", "function": {"name": "f"}}]),
    (chat, "functions", [{"name": "f"}]),
    (chat, "function_call", {"name": "f"}),
    (chat, "audio", {"voice": "alloy", "format": "wav"}),
    (chat, "modalities", ["text", "audio"]),
    (chat, "prediction", {"type": "content", "content": "x"}),
    (chat, "echo", True),
    (chat, "use_beam_search", True),
]


@pytest.mark.parametrize(
    ("build", "field", "value"), UNSUPPORTED, ids=[f"{b.__name__}-{f}" for b, f, _ in UNSUPPORTED]
)
def test_unsupported_fields_are_refused_by_name(build, field, value):
    loc, message = refused(build, **{field: value})
    assert loc == (field,)
    assert f"'{field}' is not supported" in message


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [], "tool_choice": "none", "functions": None},
        {"tool_choice": "auto", "function_call": "none"},
        {"response_format": {"type": "text"}},
        {"modalities": ["text"], "echo": False, "audio": None},
        {
            "store": True,
            "metadata": {"a": "b"},
            "service_tier": "auto",
            "parallel_tool_calls": False,
        },
    ],
)
def test_fields_that_ask_for_nothing_are_accepted(fields):
    chat(**fields)


def test_unknown_fields_are_kept_aside():
    request = completion(suffix="", some_new_openai_field={"x": 1})
    assert request.model_extra == {"some_new_openai_field": {"x": 1}}
    assert request.to_sampling_params() == SamplingParams(max_tokens=16)


def test_model_is_optional():
    request = CompletionRequest.model_validate({"prompt": "x"})
    assert request.model is None


@pytest.mark.parametrize("n", [1, 2])
def test_best_of_equal_to_n_is_accepted(n):
    assert completion(n=n, best_of=n).to_sampling_params().n == n


def test_best_of_other_than_n_is_refused():
    loc, _ = refused(completion, n=1, best_of=2)
    assert loc == ("best_of",)


def test_echo_with_logprobs_scores_the_prompt_and_is_not_streamed():
    assert completion(echo=True, logprobs=2).to_sampling_params().prompt_logprobs == 2
    assert completion(echo=True).to_sampling_params().prompt_logprobs is None
    assert completion(logprobs=2).to_sampling_params().prompt_logprobs is None
    asked = completion(echo=True, logprobs=2, prompt_logprobs=5)
    assert asked.to_sampling_params().prompt_logprobs == 5
    loc, message = refused(completion, echo=True, logprobs=1, stream=True)
    assert loc == ("echo",) and "stream" in message


@pytest.mark.parametrize("build", [completion, chat])
def test_prompt_logprobs_are_bounded_and_not_streamed(build):
    assert build(prompt_logprobs=0).to_sampling_params().prompt_logprobs == 0
    assert build(prompt_logprobs=20).to_sampling_params().prompt_logprobs == 20
    assert build().to_sampling_params().prompt_logprobs is None
    for value in (-1, 21, True, 1.5):
        loc, _ = refused(build, prompt_logprobs=value)
        assert loc == ("prompt_logprobs",)
    loc, message = refused(build, prompt_logprobs=1, stream=True)
    assert loc == ("prompt_logprobs",) and "stream" in message


def test_min_tokens_above_max_tokens_is_refused():
    loc, message = refused(chat, min_tokens=10, max_completion_tokens=5)
    assert loc == ("max_completion_tokens",)
    assert "min_tokens" in message
    assert completion(min_tokens=5, max_tokens=5).to_sampling_params().min_tokens == 5


def test_stream_options():
    assert not chat(stream=True).include_usage
    assert not chat(stream=True, stream_options={"include_usage": False}).include_usage
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage


def test_continue_final_message_excludes_the_generation_prompt():
    loc, _ = refused(chat, continue_final_message=True)
    assert loc == ("continue_final_message",)
    request = chat(continue_final_message=True, add_generation_prompt=False)
    assert request.continue_final_message and not request.add_generation_prompt


def test_chat_template_options_are_kept():
    request = chat(chat_template="{{ messages }}", chat_template_kwargs={"enable_thinking": False})
    assert request.chat_template == "{{ messages }}"
    assert request.chat_template_kwargs == {"enable_thinking": False}
    assert request.add_generation_prompt and not request.continue_final_message


def test_json_bodies_validate_the_same():
    body = '{"model": "m", "prompt": [[1, 2]], "logit_bias": {"3": -1}, "stop": "x"}'
    params = CompletionRequest.model_validate_json(body).to_sampling_params()
    assert params.logit_bias == {3: -1.0}
    assert params.stop == ("x",)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json('{"model": "m", "prompt": "x", "logprobs": true}')


@pytest.mark.parametrize(
    ("value", "inputs"),
    [("a", ["a"]), (["a", "b"], ["a", "b"]), ([5, 6], [[5, 6]]), ([[5], [6, 7]], [[5], [6, 7]])],
)
def test_embedding_input_forms(value, inputs):
    request = embedding(input=value)
    assert request.inputs() == inputs
    assert request.encoding_format == "float" and not request.base64


@pytest.mark.parametrize("value", ["", ["a", ""], [], [[]], 3, [1.5]])
def test_bad_embedding_inputs_are_refused(value):
    loc, _ = refused(embedding, input=value)
    assert loc == ("input",)


def test_embedding_options():
    request = embedding(encoding_format="base64", dimensions=8, user="u")
    assert request.base64 and request.dimensions == 8
    assert embedding(encoding_format=None).encoding_format is None


def test_rerank_documents_as_strings_or_objects():
    request = rerank(documents=["a", {"text": "b", "title": "t"}])
    assert request.texts() == ["a", "b"]
    assert request.top_n is None and request.return_documents


@pytest.mark.parametrize("documents", [[1], [{"title": "no text"}], "not a list"])
def test_bad_rerank_documents_are_refused(documents):
    loc, _ = refused(rerank, documents=documents)
    assert loc == ("documents",)
