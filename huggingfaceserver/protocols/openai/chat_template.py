"""Chat templates: the conversation rendered into the prompt text, as transformers renders it.

The server's template (the model's, or ``--chat_template``) is the operator's choice and renders
with transformers' own ``apply_chat_template``. A template sent in the request is code from the
client: refused unless the server runs with ``--trust_request_chat_template``, and then rendered
by :func:`render_request_template` in transformers' environment made a
:class:`~.template_sandbox.LimitedSandbox`. Both are blocking: callers run them in a worker
thread, never on the event loop.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.runtime import Macro
from transformers import PreTrainedTokenizerBase

from .errors import InvalidParameter
from .template_sandbox import (
    MAX_SOURCE_CHARS,
    LimitedSandbox,
    TemplateLimit,
    limited_render,
    render_limited,
    text_size,
)

TRUST_FLAG = "--trust_request_chat_template"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning goes by; templates read the first (transformers' aliases)."""
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""Appended to the last message to find where it ends in the output (as transformers)."""


class ChatTemplateError(ValueError):
    """A template that does not render these messages (a 400 naming the template's error)."""


def untrusted_template_error() -> InvalidParameter:
    return InvalidParameter(
        f"chat_template in a request is not accepted: the server must be started with "
        f"{TRUST_FLAG} to render templates sent by clients",
        param="chat_template",
    )


def template_limit_error(exc: TemplateLimit) -> InvalidParameter:
    return InvalidParameter(str(exc), param="chat_template")


def render_server_template(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    variables: dict[str, Any],
) -> str:
    """The operator's template, rendered by transformers."""
    text = tokenizer.apply_chat_template(
        conversation,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **variables,
    )
    assert isinstance(text, str)
    return text


def render_request_template(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    variables: dict[str, Any],
) -> str:
    """A client's template, rendered as transformers renders a template (the same variables,
    filters and globals, ``continue_final_message`` the same way) within the sandbox's limits
    (:class:`TemplateLimit` past one)."""
    if len(template) > MAX_SOURCE_CHARS:
        raise TemplateLimit(
            f"the chat template is {len(template)} characters long (limit {MAX_SOURCE_CHARS})"
        )
    # As transformers: keys whose value is None dropped, reasoning under all its names.
    chat = [alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in conversation]
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str) or "content" not in template:
            raise ChatTemplateError("continue_final_message: the template does not show content")
        chat[-1]["content"] = final + CONTINUE_TAG
    context = {
        **tokenizer.special_tokens_map,
        **variables,
        "messages": chat,
        "tools": variables.get("tools"),
        "documents": variables.get("documents"),
        "add_generation_prompt": add_generation_prompt,
    }
    with limited_render():
        text = render_limited(compile_limited(template), context)
    return text if final is None else cut_at_continue_tag(text, final)


def alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next(
        (message[key] for key in REASONING_FIELDS if message.get(key) is not None), None
    )
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def cut_at_continue_tag(text: str, final: str) -> str:
    """The output up to where the last message's content ends, so that the model continues
    it (transformers' rule)."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message: the final message does not appear in the rendered chat"
        )
    at = text.rindex(tag)
    if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


# --- transformers' environment, limited -------------------------------------------------


@lru_cache(maxsize=16)
def compile_limited(template: str) -> jinja2.Template:
    """The template compiled in a :class:`LimitedSandbox` set up as transformers sets up its
    environment (call inside :func:`~.template_sandbox.limited_render`: compiling folds
    constants, which runs filters)."""
    environment = LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    environment.globals["dict"] = TemplateDict()
    environment.globals["namespace"] = TemplateNamespace
    environment.limit_filters()
    return environment.from_string(template)


class GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for transformers'
    training masks; rendering it is rendering its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return str(caller())


def raise_exception(message: Any) -> None:
    if not isinstance(message, str):
        message = f"<{type(message).__name__} of about {text_size(message)} characters>"
    raise jinja2.exceptions.TemplateError(message)


def tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: no HTML escaping, json.dumps' options."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class TemplateDict:
    """``dict(...)`` in a template, without the type's attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` refusing underscore-prefixed names (as transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        TemplateNamespace.check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a namespace attribute may not start with an underscore: {name!r}"
            )
