"""A request's structured-output fields as one :class:`~huggingfaceserver.generation.params.
Constraint`: OpenAI's ``response_format`` and vLLM's ``guided_*`` and ``structured_outputs``.

At most one of them may ask for something; each malformed value is a 400 that names its field.
Whether a schema, regex or grammar is valid is the backend's to say (it compiles them).
"""

from __future__ import annotations

import json
from typing import Any

from ...generation.params import Constraint, ConstraintKind
from .errors import InvalidParameter

ANY_JSON_OBJECT = '{"type": "object"}'
GUIDED: dict[str, ConstraintKind] = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def request_constraint(fields: dict[str, Any]) -> Constraint | None:
    """The one constraint the request's fields ask for (None: none)."""
    found = [
        (name, constraint)
        for name, constraint in (
            ("response_format", from_response_format(fields.get("response_format"))),
            *((name, from_guided(name, kind, fields.get(name))) for name, kind in GUIDED.items()),
            ("structured_outputs", from_structured_outputs(fields.get("structured_outputs"))),
        )
        if constraint is not None
    ]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidParameter(
            f"only one kind of structured output per request; this one sets {names}",
            param=found[1][0],
        )
    return found[0][1] if found else None


def from_response_format(value: Any) -> Constraint | None:
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json", ANY_JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidParameter(
                "response_format.json_schema must be an object with the schema under 'schema'",
                param="response_format",
            )
        schema = spec.get("schema", {"type": "object"})
        return Constraint("json", json_text(schema, "response_format"))
    raise InvalidParameter(
        "response_format.type must be 'text', 'json_object' or 'json_schema'",
        param="response_format",
    )


def from_guided(name: str, kind: ConstraintKind, value: Any) -> Constraint | None:
    """vLLM's ``guided_json`` (a schema, or its JSON text), ``guided_regex``,
    ``guided_choice`` (a list of strings) and ``guided_grammar``."""
    if value is None:
        return None
    if kind == "json":
        return Constraint("json", json_text(value, name))
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise InvalidParameter(f"{name} must be a non-empty list of strings", param=name)
        return Constraint("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise InvalidParameter(f"{name} must be a non-empty string", param=name)
    return Constraint(kind, value)


def from_structured_outputs(value: Any) -> Constraint | None:
    """vLLM's ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``."""
    if value is None:
        return None
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidParameter(f"{param} must be an object", param=param)
    given = {key: v for key, v in value.items() if key in (*GUIDED.values(), "json_object")}
    given = {key: v for key, v in given.items() if v is not None and v is not False}
    if len(given) != 1:
        raise InvalidParameter(
            f"{param} must set exactly one of json, regex, choice, grammar, json_object",
            param=param,
        )
    ((key, spec),) = given.items()
    if key == "json_object":
        return Constraint("json", ANY_JSON_OBJECT)
    return from_guided(param, key, spec)  # type: ignore[arg-type]


def json_text(schema: Any, param: str) -> str:
    """A JSON schema as JSON text: an object, or a string holding one. Its properties keep
    their order, which is the order the grammar writes them in (OpenAI's and vLLM's)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise InvalidParameter(f"{param}: the schema is not valid JSON", param=param) from None
        except RecursionError:  # what the request body's parser refuses at its depth limit
            raise InvalidParameter(f"{param}: the schema nests too deep", param=param) from None
    if not isinstance(schema, dict):
        raise InvalidParameter(f"{param}: the JSON schema must be an object", param=param)
    return json.dumps(schema)
