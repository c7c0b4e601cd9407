"""Request limits shared by the KServe and OpenAI routes, checked before any work is done."""

from __future__ import annotations

from ..errors import BadRequest


def check_input_count(count: int, limit: int, what: str = "inputs") -> None:
    """More than ``--max_inputs_per_request`` texts (``what``: instances, documents,
    prompts...) in one request is a 400 naming the limit."""
    if count > limit:
        raise BadRequest(
            f"too many {what}: {count}; at most {limit} inputs per request "
            "(--max_inputs_per_request)"
        )
