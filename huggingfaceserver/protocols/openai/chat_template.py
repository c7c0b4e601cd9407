"""Chat templates: the conversation rendered into the prompt text, as transformers renders it.

The server's template (the model's, or ``--chat_template``) is the operator's choice and renders
with transformers' own ``apply_chat_template``. A template sent in the request is code from the
client: refused unless the server runs with ``--trust_request_chat_template``, and then rendered
by transformers in a worker process with time and memory limits (:mod:`.template_sandbox`).
Both are blocking: callers run them in a worker thread, never on the event loop.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from .errors import InvalidParameter
from .template_sandbox import TemplateLimit, sandbox

TRUST_FLAG = "--trust_request_chat_template"


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
    """A client's template, rendered as ``apply_chat_template`` renders it (the tokenizer's
    special tokens and ``variables`` as template variables) in the sandbox's worker process:
    :class:`TemplateLimit` past a limit, :class:`~.template_sandbox.TemplateFailed` for the
    template's own errors."""
    return sandbox.render(
        template,
        conversation,
        add_generation_prompt,
        continue_final_message,
        {**tokenizer.special_tokens_map, **variables},
    )
