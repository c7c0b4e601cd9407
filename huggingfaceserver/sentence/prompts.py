"""Which prompt a text is embedded with, as sentence-transformers' ``encode`` picks it.

A request's ``prompt`` (the text itself) or ``prompt_name`` (one of the model's prompts), else
the server's default (``--default_prompt`` or ``--default_prompt_name``), else the model's own
``default_prompt_name``; no prompt otherwise. The prompt is put before each text, and what is
embedded (and counted as the request's tokens) is that whole text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..errors import BadRequest, StartupError
from .config import SentenceConfig


class PromptChoice(Protocol):
    """A request's prompt choice (:class:`~huggingfaceserver.encoder_tasks.params.EncodeParams`)."""

    @property
    def prompt(self) -> str | None: ...

    @property
    def prompt_name(self) -> str | None: ...


@dataclass(frozen=True)
class Prompts:
    prompts: dict[str, str] = field(default_factory=dict)
    """The model's prompts, by name."""
    default: str = ""
    """The prompt of a request that names none."""

    @classmethod
    def of(
        cls,
        sentence: SentenceConfig | None,
        default_prompt_name: str | None = None,
        default_prompt: str | None = None,
    ) -> Prompts:
        """The model's prompts and the default: the flags' (a :class:`StartupError` for a name
        the model does not have), else the model's."""
        prompts = dict(sentence.prompts) if sentence is not None else {}
        if default_prompt is not None and default_prompt_name is not None:
            raise StartupError("give --default_prompt or --default_prompt_name, not both")
        if default_prompt_name is not None:
            if default_prompt_name not in prompts:
                raise StartupError(
                    f"--default_prompt_name {default_prompt_name!r} is not one of the model's "
                    f"prompts ({listing(prompts)})"
                )
            return cls(prompts, prompts[default_prompt_name])
        if default_prompt is not None:
            return cls(prompts, default_prompt)
        name = sentence.default_prompt_name if sentence is not None else None
        return cls(prompts, prompts.get(name, "") if name else "")

    def text(self, params: PromptChoice) -> str:
        """The prompt a request's texts get ("" for none); a 400 for a name the model does
        not have, listing those it has."""
        if params.prompt is not None:
            return params.prompt
        if params.prompt_name is None:
            return self.default
        if params.prompt_name not in self.prompts:
            raise BadRequest(
                f"prompt_name {params.prompt_name!r} is not one of this model's prompts "
                f"({listing(self.prompts)})"
            )
        return self.prompts[params.prompt_name]


def listing(prompts: dict[str, str]) -> str:
    return ", ".join(repr(name) for name in prompts) or "it has none"
