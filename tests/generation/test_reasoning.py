"""The reasoning split (``--reasoning-parser``) against vLLM's own parsers of the same names, on
the same texts: whole, and streamed token by token as vLLM's engine streams; and our streamed
split, fed deltas that cut the markers anywhere, adding up to the whole one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from huggingfaceserver.generation.reasoning import REASONING_PARSERS, ReasoningSplit
from tiny_models import train_llama_tokenizer

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
TEXTS = [
    "<think>I add 2 and 2.</think>It is 4.",
    "I add 2 and 2.</think>It is 4.",  # the start marker was in the prompt
    "<think>Still thinking when max_tokens cut it",
    "No markers at all",
    "</think>Only content",
    "<think></think>",
    "<think>Only reasoning</think>",
    "<think>Spaces stay  \n</think>\n\nThe answer.",
    "<think>One <tag> that is no marker</think>After",
    "<think>Call it.<tool_call>{}</tool_call>",
    "",
]
DIVERGENT = {
    # Where vLLM's streamed and whole splits disagree, ours follows the one named.
    ("deepseek_r1", "Before<think>inside</think>after"): ("Beforeinside", "after"),  # streamed
    ("qwen3", "Before<think>inside</think>after"): ("Beforeinside", "after"),  # both
    ("deepseek_r1", "a</think>b</think>c"): ("a", "b</think>c"),  # whole
    ("qwen3", "a</think>b</think>c"): ("a", "bc"),  # both
}
THINKING_KWARGS = [None, {"enable_thinking": False}, {"thinking": True}, {"enable_thinking": True}]


class VllmRequest:
    """What vLLM's parsers read of a request."""

    include_reasoning = True
    tools = None
    tool_choice = None
    chat_template_kwargs = None


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A chat tokenizer whose vocabulary has the markers as tokens (as thinking models' do)."""
    tokenizer = train_llama_tokenizer(Path(tmp_path_factory.mktemp("think")))
    tokenizer.add_tokens(MARKERS)
    return tokenizer


def vllm_splits(name: str, tokenizer: Any, text: str, kwargs: dict | None) -> tuple[Any, Any]:
    """vLLM's split of ``text``: whole, and streamed one token per delta."""
    from vllm.reasoning import ReasoningParserManager

    parser_class = ReasoningParserManager.get_reasoning_parser(name)
    extra = {} if kwargs is None else {"chat_template_kwargs": kwargs}
    whole = parser_class(tokenizer, **extra).extract_reasoning(text, VllmRequest())
    parser = parser_class(tokenizer, **extra)
    previous_ids: list[int] = []
    previous = ""
    reasoning, content = "", ""
    for token in tokenizer.encode(text, add_special_tokens=False):
        ids = [*previous_ids, token]
        current = tokenizer.decode(ids)
        delta = parser.extract_reasoning_streaming(
            previous, current, current[len(previous) :], previous_ids, ids, [token]
        )
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
        previous_ids, previous = ids, current
    finish = getattr(parser, "finish_streaming", None)
    last = finish() if finish is not None else None
    if last is not None:
        reasoning += last.reasoning or ""
        content += last.content or ""
    return (whole[0] or None, whole[1] or None), (reasoning or None, content or None)


def streamed(name: str, deltas: list[str], kwargs: dict | None = None) -> tuple[Any, Any]:
    stream = REASONING_PARSERS[name].stream(kwargs)
    parts = [stream.push(delta) for delta in deltas] + [stream.finish()]
    reasoning = "".join(part[0] for part in parts)
    content = "".join(part[1] for part in parts)
    return reasoning or None, content or None


def pair(split: ReasoningSplit) -> tuple[str | None, str | None]:
    return split.reasoning, split.content


@pytest.mark.vllm
@pytest.mark.parametrize("kwargs", THINKING_KWARGS)
@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_the_split_is_vllms(tokenizer, name, kwargs):
    pytest.importorskip("vllm")
    for text in TEXTS:
        whole, vllm_streamed = vllm_splits(name, tokenizer, text, kwargs)
        ours = pair(REASONING_PARSERS[name].split(text, kwargs))
        assert ours == whole, text
        form = REASONING_PARSERS[name]
        if not (form.drops_late_ends and not form.thinks(kwargs or {})):
            assert ours == vllm_streamed, text  # vLLM's Qwen3 streamed drops it, thinking off


@pytest.mark.vllm
@pytest.mark.parametrize(("name", "text"), sorted(DIVERGENT))
def test_where_vllms_streamed_and_whole_splits_differ(tokenizer, name, text):
    pytest.importorskip("vllm")
    expected = DIVERGENT[(name, text)]
    assert expected in vllm_splits(name, tokenizer, text, None)
    assert pair(REASONING_PARSERS[name].split(text)) == expected


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", TEXTS + [text for _, text in DIVERGENT])
def test_any_cut_of_the_deltas_adds_up_to_the_whole_split(name, text):
    whole = pair(REASONING_PARSERS[name].split(text, {"thinking": True}))
    assert streamed(name, list(text), {"thinking": True}) == whole  # a character a delta
    for cut in range(len(text) + 1):  # markers split across two deltas anywhere
        assert streamed(name, [text[:cut], text[cut:]], {"thinking": True}) == whole


def test_a_marker_split_across_deltas_is_held_until_it_is_known():
    stream = REASONING_PARSERS["deepseek_r1"].stream()
    assert stream.push("I think</th") == ("I think", "")
    assert stream.push("ink>The answer") == ("", "The answer")
    stream = REASONING_PARSERS["deepseek_r1"].stream()
    assert stream.push("a </") == ("a ", "")
    assert stream.push("b") == ("</b", "")  # not a marker after all: it goes out
    assert stream.finish() == ("", "")
    assert stream.reasoning == "a </b"


def test_held_text_at_the_end_is_what_it_was_going_to_be():
    stream = REASONING_PARSERS["qwen3"].stream()
    assert stream.push("thought</think>x</thi") == ("thought", "x")
    assert stream.finish() == ("", "</thi")


def test_qwen3_ends_the_reasoning_at_a_tool_call_and_drops_late_end_markers():
    split = REASONING_PARSERS["qwen3"].split("plan<tool_call>{}</tool_call></think>done")
    assert pair(split) == ("plan", "<tool_call>{}</tool_call>done")
    split = REASONING_PARSERS["deepseek_r1"].split("plan<tool_call>{}</tool_call></think>done")
    assert pair(split) == ("plan<tool_call>{}</tool_call>", "done")


def test_deepseek_r1_content_is_as_written():
    # vLLM's whole split takes what follows a late <think> as the reasoning, and its streamed
    # one drops the marker; ours keeps the content as the model wrote it.
    split = REASONING_PARSERS["deepseek_r1"].split("a</think>b<think>c</think>")
    assert pair(split) == ("a", "b<think>c</think>")


@pytest.mark.parametrize(
    ("name", "kwargs", "thinks"),
    [
        ("qwen3", None, True),
        ("qwen3", {"enable_thinking": False}, False),
        ("deepseek_r1", {"enable_thinking": False}, True),  # R1's parser reads no flag
        ("deepseek_v3", None, False),
        ("deepseek_v3", {"thinking": True}, True),
        ("holo2", None, True),
        ("holo2", {"thinking": False}, False),
    ],
)
def test_chat_template_kwargs_turn_thinking_on_or_off(name, kwargs, thinks):
    split = pair(REASONING_PARSERS[name].split("a</think>b", kwargs))
    assert split == (("a", "b") if thinks else (None, "a</think>b"))
