"""Response builders: the `openai` SDK parses what they produce, strictly and as a client."""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai.types import Completion, CreateEmbeddingResponse, Embedding
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs as SDKCompletionLogprobs
from openai.types.create_embedding_response import Usage as EmbeddingUsage
from pydantic import BaseModel

from huggingfaceserver.protocols.openai import bodies, encoder_responses, responses
from huggingfaceserver.protocols.openai.bodies import to_json, to_json_dict
from huggingfaceserver.protocols.openai.encoder_requests import EmbeddingRequest
from huggingfaceserver.protocols.openai.logprobs import (
    FLOOR_LOGPROB,
    TokenLogprobText,
    chat_logprobs,
    completion_logprobs,
)

ENTRIES = [
    TokenLogprobText("Hel", -0.5, [("Hel", -0.5), ("He", -1.5)]),
    TokenLogprobText("lo", -0.25, [("lo", -0.25)]),
    TokenLogprobText("é", float("-inf"), [("é", float("-inf")), ("e", float("nan"))]),
]


def sdk_client(answer: Callable[[dict[str, Any]], httpx.Response]) -> openai.OpenAI:
    """An SDK client whose server is ``answer`` (request JSON -> response)."""

    def handle(request: httpx.Request) -> httpx.Response:
        return answer(json.loads(request.content))

    transport = httpx.MockTransport(handle)
    return openai.OpenAI(
        api_key="unused", base_url="http://test/v1", http_client=httpx.Client(transport=transport)
    )


def sse(events: list[dict[str, Any]]) -> httpx.Response:
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
    {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
]
PROMPT_LOGPROBS = [None, {"7": {"logprob": -1.5, "rank": 2, "decoded_token": "Hi"}}]
USAGE = responses.completion_usage(3, 4)


@dataclass(frozen=True)
class Sent:
    """A response we send, the SDK type a client reads it as, and whether that type's
    declarations admit it (the API sends nulls where some SDK fields are not Optional: a
    streamed completion choice's ``finish_reason``, an echoed prompt's first logprob; the SDK
    client reads them anyway, since it constructs without validating)."""

    build: Callable[[], BaseModel]
    sdk_type: type[BaseModel]
    validates: bool = True


SENT = {
    "completion": Sent(
        lambda: responses.completion_response(
            "cmpl-1",
            "m",
            [
                responses.completion_choice(0, "Hel", "length", completion_logprobs(ENTRIES, 2)),
                responses.completion_choice(1, "Hi", "stop"),
            ],
            3,
            5,
            created=7,
        ),
        Completion,
    ),
    "completion echoing logprobs and prompt_logprobs": Sent(
        lambda: responses.completion_response(
            "cmpl-1",
            "m",
            [
                responses.completion_choice(
                    0,
                    "<s>Hel",
                    "stop",
                    completion_logprobs([TokenLogprobText("<s>", None, None), *ENTRIES]),
                    PROMPT_LOGPROBS,
                )
            ],
            3,
            5,
            created=7,
        ),
        Completion,
        validates=False,
    ),
    "completion chunk": Sent(
        lambda: responses.completion_chunk(
            "cmpl-1",
            "m",
            7,
            responses.completion_stream_choice(0, "lo", None, completion_logprobs(ENTRIES[1:2])),
            include_usage=True,
        ),
        Completion,
        validates=False,
    ),
    "completion last chunk": Sent(
        lambda: responses.completion_chunk(
            "cmpl-1", "m", 7, responses.completion_stream_choice(1, "", "length")
        ),
        Completion,
    ),
    "completion usage chunk": Sent(
        lambda: responses.completion_chunk("cmpl-1", "m", 7, usage=USAGE, include_usage=True),
        Completion,
    ),
    "chat": Sent(
        lambda: responses.chat_response(
            "chatcmpl-1",
            "m",
            [
                responses.chat_choice(0, "Hello", "stop", chat_logprobs(ENTRIES)),
                responses.chat_choice(1, "", "length", []),
            ],
            4,
            3,
            created=7,
        ),
        ChatCompletion,
    ),
    "chat tool calls and prompt_logprobs": Sent(
        lambda: responses.chat_response(
            "chatcmpl-1",
            "m",
            [responses.chat_choice(0, None, "tool_calls", tool_calls=CALLS)],
            4,
            3,
            created=7,
            prompt_logprobs=PROMPT_LOGPROBS,
        ),
        ChatCompletion,
    ),
    "chat reasoning and its tokens": Sent(
        lambda: responses.chat_response(
            "chatcmpl-1",
            "m",
            [responses.chat_choice(0, "Paris.", "stop", reasoning="France's capital.")],
            4,
            3,
            created=7,
            reasoning_tokens=2,
        ),
        ChatCompletion,
    ),
    "chat reasoning chunk": Sent(
        lambda: responses.chat_chunk(
            "chatcmpl-1", "m", 7, responses.chat_stream_choice(0, first=True, reasoning="Hm")
        ),
        ChatCompletionChunk,
    ),
    "chat usage chunk with reasoning tokens": Sent(
        lambda: responses.chat_chunk(
            "chatcmpl-1", "m", 7, usage=responses.completion_usage(3, 2, 1), include_usage=True
        ),
        ChatCompletionChunk,
    ),
    "chat first chunk": Sent(
        lambda: responses.chat_chunk(
            "chatcmpl-1",
            "m",
            7,
            responses.chat_stream_choice(0, "Hel", None, chat_logprobs(ENTRIES[:1]), first=True),
            include_usage=True,
        ),
        ChatCompletionChunk,
    ),
    "chat tool calls chunk": Sent(
        lambda: responses.chat_chunk(
            "chatcmpl-1",
            "m",
            7,
            responses.chat_stream_choice(0, "", "tool_calls", first=True, tool_calls=CALLS),
        ),
        ChatCompletionChunk,
    ),
    "chat last chunk": Sent(
        lambda: responses.chat_chunk(
            "chatcmpl-1", "m", 7, responses.chat_stream_choice(2, finish_reason="length")
        ),
        ChatCompletionChunk,
    ),
    "chat usage chunk": Sent(
        lambda: responses.chat_chunk("chatcmpl-1", "m", 7, usage=USAGE, include_usage=True),
        ChatCompletionChunk,
    ),
}
EXTENSIONS = {"prompt_logprobs", "reasoning", "reasoning_content"}
"""Fields we send that the SDK does not declare (vLLM's, DeepSeek's): it keeps them as extras."""


def assert_read_as_sent(parsed: Any, sent: Any, path: str = "", free: bool = False) -> None:
    """Every JSON object we sent became an SDK model whose declared fields hold exactly what
    we sent (no field of ours lands in the model's extras, as a misspelled one would), but for
    maps the SDK itself types as maps (``free``: completion ``top_logprobs``, extensions)."""
    if isinstance(sent, dict) and not free:
        assert isinstance(parsed, BaseModel), f"{path}: {parsed!r} is no SDK model"
        extras = set(parsed.model_extra or {})
        assert extras <= EXTENSIONS, f"{path}: fields the SDK does not know: {extras}"
        assert parsed.model_fields_set | extras == set(sent), path
        for key, value in sent.items():
            free_map = key in extras or (
                isinstance(parsed, SDKCompletionLogprobs) and key == "top_logprobs"
            )
            assert_read_as_sent(getattr(parsed, key), value, f"{path}.{key}", free_map)
    elif isinstance(sent, list):
        assert isinstance(parsed, list) and len(parsed) == len(sent), path
        for index, (parsed_item, item) in enumerate(zip(parsed, sent, strict=True)):
            assert_read_as_sent(parsed_item, item, f"{path}[{index}]", free)
    else:
        assert parsed == sent and type(parsed) is type(sent), f"{path}: {parsed!r} != {sent!r}"


@pytest.mark.parametrize("name", [name for name, sent in SENT.items() if sent.validates])
def test_the_sdk_types_validate_what_we_send(name):
    sent = SENT[name]
    text = to_json(sent.build())
    parsed = sent.sdk_type.model_validate_json(text)
    assert_read_as_sent(parsed, json.loads(text))
    assert json.loads(parsed.model_dump_json(exclude_unset=True)) == json.loads(text)


@pytest.mark.parametrize("name", list(SENT))
def test_the_sdk_reads_what_we_send_as_its_client_does(name):
    """The SDK client builds its types from the JSON without validating (``construct``)."""
    sent = SENT[name]
    body = json.loads(to_json(sent.build()))
    parsed = sent.sdk_type.model_construct(**body)
    assert_read_as_sent(parsed, body)
    assert json.loads(parsed.model_dump_json(exclude_unset=True, warnings=False)) == body


def test_every_response_type_we_send_is_checked_against_the_sdk():
    sent_types = {type(sent.build()) for sent in SENT.values()}
    assert sent_types == {
        responses.ScoredCompletion,
        responses.CompletionChunk,
        responses.ChatCompletion,
        responses.ChatCompletionChunk,
    }


def test_completion_response_parses_strictly_and_through_the_sdk():
    logprobs = completion_logprobs(ENTRIES)
    choices = [
        responses.completion_choice(0, "Hello", "length", logprobs),
        responses.completion_choice(1, "Hi", "stop"),
    ]
    response = responses.completion_response("cmpl-1", "m", choices, 3, 5, created=7)
    body = to_json_dict(response)
    assert responses.ScoredCompletion.model_validate(body) == response
    parsed_logprobs = Completion.model_validate(body).choices[0].logprobs  # the SDK's type
    assert parsed_logprobs is not None and parsed_logprobs.model_dump() == logprobs.model_dump()
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert body["choices"][1]["logprobs"] is None
    assert "prompt_logprobs" not in body["choices"][0]

    client = sdk_client(lambda _: httpx.Response(200, json=body))
    parsed = client.completions.create(model="m", prompt="x", logprobs=2)
    assert [c.text for c in parsed.choices] == ["Hello", "Hi"]
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.tokens == ["Hel", "lo", "é"]


def test_an_echoed_prompts_null_first_logprob_and_prompt_logprobs_reach_the_sdk():
    echoed = [TokenLogprobText("<s>", None, None), *ENTRIES]
    prompt_logprobs = [None, {"7": {"logprob": -1.5, "rank": 2, "decoded_token": "Hi"}}]
    choice = responses.completion_choice(
        0, "Hello", "length", completion_logprobs(echoed), prompt_logprobs
    )
    body = to_json_dict(responses.completion_response("cmpl-1", "m", [choice], 3, 5))
    (sent,) = body["choices"]
    assert sent["logprobs"]["token_logprobs"][0] is None
    assert sent["logprobs"]["top_logprobs"][0] is None
    assert sent["prompt_logprobs"] == prompt_logprobs

    client = sdk_client(lambda _: httpx.Response(200, json=body))
    (parsed,) = client.completions.create(model="m", prompt="x", echo=True, logprobs=2).choices
    assert parsed.logprobs is not None and parsed.logprobs.tokens == ["<s>", "Hel", "lo", "é"]
    assert parsed.prompt_logprobs == prompt_logprobs  # type: ignore[attr-defined]


def test_completion_stream_through_the_sdk():
    created = bodies.now()
    chunks = [
        responses.completion_chunk(
            "cmpl-1", "m", created, responses.completion_stream_choice(0, "Hel"), include_usage=True
        ),
        responses.completion_chunk(
            "cmpl-1",
            "m",
            created,
            responses.completion_stream_choice(0, "lo", "stop"),
            include_usage=True,
        ),
        responses.completion_chunk(
            "cmpl-1", "m", created, usage=responses.completion_usage(2, 2), include_usage=True
        ),
    ]
    events = [to_json_dict(chunk) for chunk in chunks]
    assert events[0]["choices"][0]["finish_reason"] is None
    assert [e["usage"] for e in events[:2]] == [None, None]
    assert events[2]["choices"] == []

    client = sdk_client(lambda _: sse(events))
    stream = list(client.completions.create(model="m", prompt="x", stream=True))
    assert "".join(c.choices[0].text for c in stream if c.choices) == "Hello"
    assert stream[1].choices[0].finish_reason == "stop"
    assert stream[-1].usage is not None and stream[-1].usage.total_tokens == 4


def test_stream_chunks_have_no_usage_unless_asked():
    choice = responses.completion_stream_choice(0, "x")
    assert "usage" not in to_json_dict(responses.completion_chunk("c", "m", 1, choice))
    chat_choice = responses.chat_stream_choice(0, "x")
    assert "usage" not in to_json_dict(responses.chat_chunk("c", "m", 1, chat_choice))


def test_chat_response_parses_strictly_and_through_the_sdk():
    choice = responses.chat_choice(0, "Hello", "stop", chat_logprobs(ENTRIES))
    response = responses.chat_response("chatcmpl-1", "m", [choice], 4, 3)
    body = to_json_dict(response)
    assert responses.ChatCompletion.model_validate(body) == response
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}

    client = sdk_client(lambda _: httpx.Response(200, json=body))
    parsed = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert parsed.choices[0].message.content == "Hello"
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.content is not None
    assert parsed.choices[0].logprobs.content[2].logprob == FLOOR_LOGPROB


def test_chat_stream_role_first_finish_last_usage_after():
    created = bodies.now()
    choices = [
        responses.chat_stream_choice(0, "", first=True),
        responses.chat_stream_choice(0, "Hel"),
        responses.chat_stream_choice(0, "lo"),
        responses.chat_stream_choice(0, finish_reason="length"),
    ]
    chunks = [responses.chat_chunk("c", "m", created, c, include_usage=True) for c in choices]
    usage = responses.completion_usage(3, 2)
    chunks.append(responses.chat_chunk("c", "m", created, usage=usage, include_usage=True))
    events = [to_json_dict(chunk) for chunk in chunks]
    for event in events:
        ChatCompletionChunk.model_validate(event)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
        {"content": "lo"},
        {},
    ]
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None, None, None, "length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 5

    client = sdk_client(lambda _: sse(events))
    stream = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "Hello"
    assert stream[-1].usage is not None and stream[-1].usage.completion_tokens == 2


def test_chat_stream_logprobs():
    logprobs = chat_logprobs(ENTRIES[:1])
    event = to_json_dict(
        responses.chat_chunk("c", "m", 1, responses.chat_stream_choice(0, "Hel", logprobs=logprobs))
    )
    assert event["choices"][0]["logprobs"]["content"][0]["token"] == "Hel"
    ChatCompletionChunk.model_validate(event)


def test_completion_logprobs_format():
    logprobs = completion_logprobs(ENTRIES, text_offset=10)
    assert logprobs.tokens == ["Hel", "lo", "é"]
    assert logprobs.token_logprobs == [-0.5, -0.25, FLOOR_LOGPROB]
    assert logprobs.top_logprobs == [
        {"Hel": -0.5, "He": -1.5},
        {"lo": -0.25},
        {"é": FLOOR_LOGPROB, "e": FLOOR_LOGPROB},
    ]
    assert logprobs.text_offset == [10, 13, 15]
    json.dumps(logprobs.model_dump(), allow_nan=False)  # no -Infinity / NaN in the JSON
    sampled_past_the_top = [TokenLogprobText("lo", -3.0, [("Hel", -0.5)])]
    assert completion_logprobs(sampled_past_the_top).top_logprobs == [{"lo": -3.0, "Hel": -0.5}]
    assert completion_logprobs([TokenLogprobText("lo", -3.0, [])]).top_logprobs == [{"lo": -3.0}]


def test_chat_logprobs_format():
    content = chat_logprobs(ENTRIES)
    assert [t.token for t in content] == ["Hel", "lo", "é"]
    assert content[2].bytes == [0xC3, 0xA9]
    assert content[2].logprob == FLOOR_LOGPROB
    assert [(t.token, t.logprob, t.bytes) for t in content[0].top_logprobs] == [
        ("Hel", -0.5, [72, 101, 108]),
        ("He", -1.5, [72, 101]),
    ]
    assert chat_logprobs([TokenLogprobText("x", -1.0)])[0].top_logprobs == []


@pytest.mark.parametrize("vector", [[0.1, -2.5, 3.0e-8], np.array([1.0, 2.0], dtype=np.float64)])
def test_base64_round_trip(vector):
    encoded = encoder_responses.embedding_to_base64(vector)
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(vector, dtype=np.float32))
    assert base64.b64decode(encoded) == struct.pack(f"<{len(vector)}f", *vector)


def test_embedding_response_float_and_base64():
    vectors = np.array([[0.5, -0.25], [1.0, 0.0]], dtype=np.float32)
    floats = to_json_dict(encoder_responses.embedding_response("m", vectors, prompt_tokens=6))
    assert CreateEmbeddingResponse.model_validate(floats)
    assert floats["object"] == "list"
    assert floats["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    assert [d["index"] for d in floats["data"]] == [0, 1]
    assert floats["data"][0] == {"object": "embedding", "index": 0, "embedding": [0.5, -0.25]}
    as_base64 = to_json_dict(encoder_responses.embedding_response("m", vectors, 6, as_base64=True))
    assert as_base64["data"][1]["embedding"] == encoder_responses.embedding_to_base64([1.0, 0.0])


class SDKBase64Embedding(Embedding):
    embedding: str  # type: ignore[assignment]


class SDKEmbeddingResponse(CreateEmbeddingResponse):
    data: list[SDKBase64Embedding | Embedding]  # type: ignore[assignment]


def sdk_embedding_response(vectors: np.ndarray, as_base64: bool) -> SDKEmbeddingResponse:
    """The embedding response built from the openai SDK's own types."""
    data: list[SDKBase64Embedding | Embedding] = [
        SDKBase64Embedding(
            object="embedding", index=i, embedding=encoder_responses.embedding_to_base64(v)
        )
        if as_base64
        else Embedding(object="embedding", index=i, embedding=v.astype(np.float64).tolist())
        for i, v in enumerate(vectors)
    ]
    usage = EmbeddingUsage(prompt_tokens=7, total_tokens=7)
    return SDKEmbeddingResponse(object="list", data=data, model="m", usage=usage)


@pytest.mark.parametrize("as_base64", [False, True])
def test_embedding_json_is_the_sdk_types_json(as_base64):
    """Our models (an encoder server never imports the SDK) send the very same bytes."""
    vectors = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    ours = encoder_responses.embedding_response("m", vectors, 7, as_base64=as_base64)
    assert to_json(ours) == to_json(sdk_embedding_response(vectors, as_base64))


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_embeddings_through_the_sdk(encoding_format):
    """The SDK asks for base64 unless told otherwise, and decodes it itself."""
    vectors = [[0.1, 0.2, 0.3], [-1.0, 0.5, 0.0]]

    def answer(body: dict[str, Any]) -> httpx.Response:
        request = EmbeddingRequest.model_validate(body)
        response = encoder_responses.embedding_response("m", vectors, 4, as_base64=request.base64)
        return httpx.Response(200, json=to_json_dict(response))

    kwargs = {} if encoding_format is None else {"encoding_format": encoding_format}
    parsed = sdk_client(answer).embeddings.create(model="m", input=["a", "b"], **kwargs)
    if encoding_format == "base64":
        got = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in parsed.data]
    else:
        got = [np.asarray(d.embedding) for d in parsed.data]
    np.testing.assert_allclose(np.stack(got), np.asarray(vectors), rtol=1e-6)


def test_rerank_response_sorted_and_top_n():
    scores = [0.1, 0.9, 0.5, 0.9]
    body = to_json_dict(
        encoder_responses.rerank_response(
            "m", scores, ["a", "b", "c", "d"], 12, top_n=3, request_id="r"
        )
    )
    assert body["id"] == "r" and body["model"] == "m" and body["usage"] == {"total_tokens": 12}
    assert body["results"] == [
        {"index": 1, "relevance_score": 0.9, "document": {"text": "b"}},
        {"index": 3, "relevance_score": 0.9, "document": {"text": "d"}},
        {"index": 2, "relevance_score": 0.5, "document": {"text": "c"}},
    ]


def test_rerank_response_without_documents():
    body = to_json_dict(
        encoder_responses.rerank_response("m", [0.2, 0.3], ["a", "b"], 4, return_documents=False)
    )
    assert body["results"] == [
        {"index": 1, "relevance_score": 0.3},
        {"index": 0, "relevance_score": 0.2},
    ]
    assert body["id"].startswith("rerank-")


def test_ids_and_timestamps():
    assert bodies.new_id("chatcmpl").startswith("chatcmpl-")
    assert bodies.new_id("cmpl") != bodies.new_id("cmpl")
    assert math.isclose(bodies.now(), bodies.now(), abs_tol=2)


@pytest.mark.parametrize("char", ["\x85", "\u2028", "\u2029"])
def test_an_event_stays_one_line_for_every_line_splitter(char):
    """JSON leaves these as they are inside strings, but ``str.splitlines`` (httpx's
    ``iter_lines``) breaks lines at them: the event escapes them and means the same."""
    from pydantic import BaseModel

    from huggingfaceserver.protocols.openai.serving_generation import sse

    class Delta(BaseModel):
        content: str

    for payload in (Delta(content=f"a{char}b"), {"content": f"a{char}b"}):
        event = sse(payload)
        [line, blank] = event.splitlines()
        assert blank == "" and line.startswith("data: ")
        assert json.loads(line.removeprefix("data: ")) == {"content": f"a{char}b"}
