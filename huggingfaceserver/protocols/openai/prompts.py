"""Prompts as token ids: completion texts, and chat conversations through the chat template.

Rendering and tokenizing are blocking work and run in a worker thread, never on the event
loop. A text far longer than the context is refused after tokenizing only a cut of it
(:func:`tokenize_prompt`); a text that passes is tokenized whole, so its ids are exactly the
tokenizer's.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from dataclasses import dataclass

from transformers import BatchEncoding, PreTrainedTokenizerBase

from ...backends.base import GenerationBackend
from ...errors import BadRequest, ServerError
from ..kserve_model import GenerationModel
from .chat_template import (
    render_request_template,
    render_server_template,
    template_limit_error,
    untrusted_template_error,
)
from .errors import InvalidParameter, prompt_too_long_error
from .requests import ChatConversation, CompletionRequest
from .template_sandbox import TemplateLimit

Prompt = tuple[list[int], str | None]
"""A prompt's token ids, and its text (None for a prompt sent as token ids)."""

FIRST_CUT_CHARS_PER_TOKEN = 8
"""The first cut tried holds this many characters per context token (English averages 4)."""
CUT_GROWTH = 4


@dataclass(frozen=True)
class TokenizerTraits:
    """What bounding a prompt's tokenization needs to know of a tokenizer, found once."""

    longest: int
    """The longest token in the vocabulary (added tokens included), in characters."""
    splits: bool
    """Whether it splits texts into pieces (fast tokenizers' word ids say which)."""

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> TokenizerTraits:
        with _traits_lock:
            known = _traits.get(tokenizer)
        if known is None:
            longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
            try:
                words = tokenizer("a b c", add_special_tokens=False).word_ids()
            except ValueError:  # a slow tokenizer: no word ids
                words = []
            known = cls(longest, len({word for word in words if word is not None}) > 1)
            with _traits_lock:
                _traits[tokenizer] = known
        return known


_traits: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, TokenizerTraits] = (
    weakref.WeakKeyDictionary()
)
_traits_lock = threading.Lock()


def tokenize(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool
) -> BatchEncoding:
    """The one place prompts are tokenized (blocking)."""
    return tokenizer(text, add_special_tokens=add_special_tokens)


def encode(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenize(tokenizer, text, add_special_tokens)["input_ids"])


def tokenize_prompt(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    max_len: int,
    param: str,
    add_special_tokens: bool = True,
) -> list[int]:
    """``text``'s ids as ``tokenizer(text)`` gives them, or the context-length 400 (naming
    ``param``) after tokenizing only a cut of it when it is far too long.

    The first cut holds :data:`FIRST_CUT_CHARS_PER_TOKEN` characters per context token; a cut
    whose sure tokens (:func:`tokens_kept`) are too few grows until it holds
    ``(max_len + 1) * longest`` characters, which hold more than ``max_len`` tokens unless the
    normalizer dropped characters (collapsed whitespace, a long word that is one ``[UNK]``):
    past that, the text is tokenized whole."""
    traits = TokenizerTraits.of(tokenizer)
    enough = (max_len + 1) * traits.longest
    cut = min((max_len + 1) * FIRST_CUT_CHARS_PER_TOKEN, enough)
    while cut < len(text):
        at_least = tokens_kept(tokenizer, traits, text[:cut], add_special_tokens)
        if at_least > max_len:
            raise prompt_too_long_error(max_len, at_least, cut, param)
        if cut >= enough:
            break  # characters the normalizer drops: only the whole text tells
        cut = min(cut * CUT_GROWTH, enough)
    return encode(tokenizer, text, add_special_tokens)


def tokens_kept(
    tokenizer: PreTrainedTokenizerBase, traits: TokenizerTraits, cut: str, add_special_tokens: bool
) -> int:
    """How many tokens of the text ``cut`` was cut from are sure to be at least.

    A splitting tokenizer tokenizes each piece (word, punctuation, whitespace run) on its own,
    left to right, so a cut changes only its last pieces: the tokens of the pieces at least two
    before the cut's last are the whole text's. A tokenizer that does not split
    (sentencepiece-style BPE) has no token longer than its vocabulary's longest, so the whole
    text has at least as many tokens over the same characters as the cut."""
    encoding = tokenize(tokenizer, cut, add_special_tokens)
    if not traits.splits:
        return len(encoding["input_ids"])
    words = encoding.word_ids()
    last = max((word for word in words if word is not None), default=0)
    return sum(1 for word in words if word is None or word < last - 1)


def check_prompt_count(request: CompletionRequest, limit: int) -> None:
    """At most ``limit`` prompts, and ``limit`` choices (prompts times ``n``), per request."""
    prompts = len(request.prompts())
    choices = prompts * (request.n or 1)
    if prompts > limit or choices > limit:
        what = f"{prompts} prompts" if prompts > limit else f"{prompts} prompts x n={request.n}"
        raise InvalidParameter(
            f"at most {limit} prompts (and prompts x n choices) per request "
            f"(--max_inputs_per_request {limit}); this request asks for {what}",
            param="prompt" if prompts > limit else "n",
        )


def completion_prompts(
    tokenizer: PreTrainedTokenizerBase, request: CompletionRequest, max_len: int
) -> list[Prompt]:
    """(token ids, text or None) per prompt; texts are tokenized as the tokenizer does by
    default, token-id prompts are used as they are (checked later, with the context)."""
    out: list[Prompt] = []
    for prompt in request.prompts():
        if isinstance(prompt, str):
            out.append((tokenize_prompt(tokenizer, prompt, max_len, "prompt"), prompt))
        else:
            out.append((list(prompt), None))
    return out


async def prepare_completion(
    backend: GenerationBackend, model: GenerationModel, request: CompletionRequest
) -> list[Prompt]:
    """The request's prompts, tokenized in a worker thread (after the count check)."""
    check_prompt_count(request, model.max_inputs_per_request)
    return await asyncio.to_thread(
        completion_prompts, backend.tokenizer, request, backend.max_model_len
    )


def chat_text(
    tokenizer: PreTrainedTokenizerBase, request: ChatConversation, server_template: str | None
) -> str:
    """The conversation rendered by the request's template (trusted by the caller) or the
    server's."""
    template = request.chat_template or server_template or tokenizer.chat_template
    if not template:
        raise BadRequest(
            "this model has no chat template: pass --chat_template at startup (or send "
            "chat_template in the request to a server started with "
            "--trust_request_chat_template), or use /v1/completions"
        )
    render = render_request_template if request.chat_template else render_server_template
    try:
        return render(
            tokenizer,
            template,
            request.conversation(),
            request.add_generation_prompt,
            request.continue_final_message,
            request.template_kwargs(),
        )
    except TemplateLimit as exc:
        raise template_limit_error(exc) from None
    except ServerError:  # the request template's worker did not start: not the template's fault
        raise
    except Exception as exc:  # template code from the request or the model: any failure
        raise BadRequest(f"the chat template failed on these messages: {exc!r}"[:2000]) from None


def chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    request: ChatConversation,
    server_template: str | None,
    max_len: int,
    add_special_tokens: bool = False,
) -> Prompt:
    """Render the conversation and tokenize it (by default no special tokens added a second
    time: the template writes them)."""
    text = chat_text(tokenizer, request, server_template)
    ids = tokenize_prompt(tokenizer, text, max_len, "messages", add_special_tokens)
    return ids, text


async def prepare_chat(
    backend: GenerationBackend,
    model: GenerationModel,
    request: ChatConversation,
    add_special_tokens: bool = False,
) -> Prompt:
    """The chat's prompt, rendered and tokenized in a worker thread; a template in the request
    is refused unless the server trusts them."""
    if request.chat_template and not model.trust_request_chat_template:
        raise untrusted_template_error()
    return await asyncio.to_thread(
        chat_prompt,
        backend.tokenizer,
        request,
        model.chat_template,
        backend.max_model_len,
        add_special_tokens,
    )
