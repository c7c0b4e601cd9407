"""Request chat templates: rendered as transformers' ``apply_chat_template`` renders them, and
stopped by the sandbox's time, memory, size and output limits, in its worker process (this
process allocates nothing for them)."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from huggingfaceserver.protocols.openai.chat_template import (
    render_request_template,
    render_server_template,
)
from huggingfaceserver.protocols.openai.requests import ChatCompletionRequest
from huggingfaceserver.protocols.openai.template_sandbox import (
    MAX_OUTPUT_CHARS,
    MAX_SECONDS,
    MAX_SOURCE_CHARS,
    TemplateLimit,
    sandbox,
)

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
MISTRAL = """
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- else %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""
# Namespaces, loop controls, ~, % and .format, filters (trim, indent, tojson, map, join),
# the {% generation %} tag, names, reasoning aliases, template kwargs.
FEATURES = """
{%- set ns = namespace(system='', count=0) %}
{%- for m in messages %}
  {%- if m.role == 'system' %}{% set ns.system = ns.system ~ m.content %}{% continue %}{% endif %}
  {%- set ns.count = ns.count + 1 %}
{%- endfor %}
{{- bos_token }}{% if ns.system %}SYSTEM: {{ ns.system | trim }}{% endif %}
{%- for m in messages if m.role != 'system' %}
<{{ m.role }}{% if m.name is defined %} name={{ m.name | tojson }}{% endif %}>
{%- if m.thinking is defined %}<think>{{ m.thinking }}</think>{% endif %}
{%- generation %}{{ m.content | indent(2) }}{% endgeneration %}</{{ m.role }}>
{%- if loop.index >= 10 %}{% break %}{% endif %}
{%- endfor %}
{{ messages | map(attribute='role') | join(',') }} {{ ns.count }} {{ '%s-%d' % ('x', 3) }}
{{- ' {}!'.format(ns.count) }} {{ dict(a=1, b=[1, 'é']) | tojson(indent=2) }}
{%- if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}
{%- if add_generation_prompt %}<assistant>{% endif %}
"""
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "mistral": MISTRAL, "features": FEATURES}

CONVERSATIONS: dict[str, dict[str, Any]] = {
    "system and user": {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello  world\n  "},
        ]
    },
    "turns": {
        "messages": [
            {"role": "user", "content": "What is 2+2?", "name": "ann"},
            {"role": "assistant", "content": "4", "reasoning_content": "adding"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "3+3?"}],
            },
        ],
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "continue": {
        "messages": [
            {"role": "user", "content": "Say hello"},
            {"role": "assistant", "content": "Hello th"},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
}


class SpecialTokens:
    """What a request template may read from the tokenizer, and nothing else."""

    special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>"}


def render(template: str, **fields: Any) -> str:
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )
    return render_request_template(
        SpecialTokens(),  # type: ignore[arg-type]
        template,
        request.conversation(),
        request.add_generation_prompt,
        request.continue_final_message,
        request.chat_template_kwargs or {},
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_models: dict[str, Path]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_models["llama"])


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_request_template_renders_as_transformers_renders_it(tokenizer, name, conversation):
    request = ChatCompletionRequest.model_validate(CONVERSATIONS[conversation])
    args = (
        TEMPLATES[name],
        request.conversation(),
        request.add_generation_prompt,
        request.continue_final_message,
        request.chat_template_kwargs or {},
    )
    expected = tokenizer.apply_chat_template(
        args[1],
        chat_template=args[0],
        tokenize=False,
        add_generation_prompt=args[2],
        continue_final_message=args[3],
        **args[4],
    )
    assert render_server_template(tokenizer, *args) == expected
    assert render_request_template(tokenizer, *args) == expected


def test_template_errors_are_raised_as_transformers_raises_them(tokenizer):
    messages = [{"role": "assistant", "content": "first"}]
    with pytest.raises(Exception, match="must alternate"):
        render_request_template(tokenizer, MISTRAL, messages, True, False, {})


HOSTILE = {
    "repetition": "{{ ('x'*1200000000)|length }}",
    "power": "{{ (2 ** 10000000000) % 7 }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "padding": "{{ 'x'|center(1000000000) }}",
    "format width": "{{ '{:>1000000000}'.format('x') }}",
    "percent width": "{{ '%*s' % (100000000, 'x') }}",
    "replace": "{% set s = 'x'*3000 %}{{ s.replace('x', s).replace('x', s)|length }}",
    "join": "{% set s = 'x'*4000000 %}{{ ([s]*1000)|join|length }}",
    "shared items": "{% set s = 'x'*4000000 %}{{ ([s]*1000)|string|length }}",
    "indent": "{{ ('x\n'*1000000)|indent(1000)|length }}",
    "tojson": "{% set s = 'x'*4000000 %}{{ ([s]*100)|tojson|length }}",
    "lists kept": "{% set ns = namespace(x=[]) %}{% for i in range(1000) %}"
    "{% set ns.x = ns.x + [[0]*1000000] %}{% endfor %}{{ ns.x|length }}",
    "output": "{% set s = 'x'*1000000 %}{% for i in range(100) %}{{ s }}{% endfor %}",
}


@pytest.mark.parametrize("template", HOSTILE.values(), ids=list(HOSTILE))
def test_a_template_that_grows_stops_in_its_worker(template):
    sandbox.warm()  # a worker replaced after the previous case: its start-up is not the render's
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(TemplateLimit, match="limit"):
            render(template)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < MAX_SECONDS + 1  # the deadline, and the kill
    assert peak < 16 * 2**20  # the request and the reply: the template ran elsewhere


def test_a_template_that_loops_stops_at_the_time_limit():
    template = "{% for i in range(12000) %}{% for j in range(12000) %}x{% endfor %}{% endfor %}"
    sandbox.warm()
    started = time.monotonic()
    with pytest.raises(TemplateLimit, match=f"limit of {MAX_SECONDS:g} s"):
        render(template)
    assert MAX_SECONDS <= time.monotonic() - started < MAX_SECONDS + 1


def test_a_template_longer_than_the_limit_is_refused_unread():
    with pytest.raises(TemplateLimit, match=str(MAX_SOURCE_CHARS)):
        render("x" * (MAX_SOURCE_CHARS + 1))


def test_output_up_to_the_limit_renders():
    text = render("{{ 'x' * n }}", chat_template_kwargs={"n": MAX_OUTPUT_CHARS})
    assert text == "x" * MAX_OUTPUT_CHARS


def test_the_sandbox_still_refuses_internals():
    with pytest.raises(Exception, match="unsafe|not safely|underscore"):
        render("{{ namespace(_x=1) }}")
    assert render("{{ ''.__class__ }}|{{ cycler.__init__ }}") == "|"
