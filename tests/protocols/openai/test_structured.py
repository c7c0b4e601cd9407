"""The structured-output fields of a request, as one constraint: each form, and the 400s."""

from __future__ import annotations

import json

import pytest

from huggingfaceserver.generation.params import Constraint
from huggingfaceserver.protocols.openai.errors import InvalidParameter
from huggingfaceserver.protocols.openai.requests import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA)
ORDERED = {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {}}}
"""Properties in the order the output is to write them (the grammar keeps the schema's)."""


def constraint(**fields):
    return CompletionRequest(prompt="x", **fields).to_sampling_params().constraint


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, Constraint("json", '{"type": "object"}')),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA},
                }
            },
            Constraint("json", SCHEMA_TEXT),
        ),
        ({"guided_json": SCHEMA}, Constraint("json", SCHEMA_TEXT)),
        ({"guided_json": json.dumps(SCHEMA)}, Constraint("json", SCHEMA_TEXT)),
        ({"guided_json": ORDERED}, Constraint("json", json.dumps(ORDERED))),
        ({"guided_json": json.dumps(ORDERED)}, Constraint("json", json.dumps(ORDERED))),
        ({"guided_regex": "[0-9]+"}, Constraint("regex", "[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, Constraint("choice", '["yes", "no"]')),
        ({"guided_grammar": 'root ::= "a"'}, Constraint("grammar", 'root ::= "a"')),
        ({"structured_outputs": {"regex": "a+"}}, Constraint("regex", "a+")),
        ({"structured_outputs": {"json_object": True}}, Constraint("json", '{"type": "object"}')),
        ({"structured_outputs": {"choice": ["a"], "regex": None}}, Constraint("choice", '["a"]')),
    ],
)
def test_each_form_becomes_one_constraint(fields, expected):
    assert constraint(**fields) == expected
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    assert chat.to_sampling_params().constraint == expected


@pytest.mark.parametrize(
    ("fields", "param", "in_message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"response_format": "json"}, "response_format", "type"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": [1]}, "guided_json", "must be an object"),
        ({"guided_json": "[" * 5000}, "guided_json", "nests too deep"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "[" * 5000}}},
            "response_format",
            "nests too deep",
        ),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", 1]}, "guided_choice", "strings"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "only one",
        ),
    ],
)
def test_malformed_fields_are_400s_naming_the_field(fields, param, in_message):
    with pytest.raises(InvalidParameter) as caught:
        constraint(**fields)
    assert caught.value.param == param
    assert in_message in str(caught.value)
