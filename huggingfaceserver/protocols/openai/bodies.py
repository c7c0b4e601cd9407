"""What every OpenAI response body shares: ids, timestamps and one-pass JSON serialization.

The response models themselves are in :mod:`.responses` (completions and chat) and
:mod:`.encoder_responses` (embeddings and rerank).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel
from starlette.responses import Response


def new_id(prefix: str) -> str:
    """A response id as OpenAI writes them: ``cmpl-...``, ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """The ``created`` timestamp: Unix seconds."""
    return int(time.time())


def to_json(response: BaseModel) -> str:
    """The response as JSON text, with the fields its builder set and no others, serialized
    by pydantic-core (Rust) in one pass: an embedding's floats through ``model_dump`` and
    ``json.dumps`` cost several times more."""
    return response.model_dump_json(exclude_unset=True)


def to_json_dict(response: BaseModel) -> dict[str, Any]:
    """What :func:`to_json` sends, as data."""
    data: dict[str, Any] = json.loads(to_json(response))
    return data


class JSONBody(Response):
    """A response whose JSON text is already made (see :func:`to_json`)."""

    media_type = "application/json"
