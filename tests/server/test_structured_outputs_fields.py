"""The request fields that ask for structured outputs: response_format, structured_outputs, guided_*."""

from __future__ import annotations

import msgspec
import pytest

from framework.sampling_params import StructuredOutputsParams
from framework.server.errors import APIError
from framework.server.protocol import ChatCompletionRequest, CompletionRequest
from framework.server.structured_outputs import structured_outputs_from_request

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(**fields):
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


def _completion(**fields):
    return msgspec.convert({"prompt": "hi", **fields}, CompletionRequest)


@pytest.mark.parametrize("make", [_chat, _completion])
@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+", "start_after": "</think>"}},
     StructuredOutputsParams(regex="[0-9]+", start_after="</think>")),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": '{"type": "object"}'}, StructuredOutputsParams(json='{"type": "object"}')),
    ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
    ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
])
def test_each_field_becomes_its_constraint(make, fields, expected):
    assert structured_outputs_from_request(make(**fields)) == expected


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"response_format": {"type": "xml"}}, "response_format.type",
     "response_format.type must be one of text, json_object, json_schema; got 'xml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "response_format.json_schema must be an object with 'name' and 'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema",
     "response_format.json_schema.schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}},
     "response_format.json_schema.schema", "must be a JSON Schema object, got list"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one of json, json_object, regex, grammar, choice; got regex, choice"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "unknown keys ['regexp']"),
    ({"structured_outputs": {"choice": "ab"}}, "structured_outputs.choice",
     "structured_outputs.choice: Expected `array | null`, got `str`"),
    ({"guided_choice": []}, "guided_choice", "structured_outputs.choice must be a non-empty list"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "give at most one of response_format, structured_outputs and the guided_* fields; got response_format, guided_regex"),
])
def test_malformed_fields_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(APIError) as excinfo:
        structured_outputs_from_request(_chat(**fields))
    error = excinfo.value
    assert error.status == 400 and error.param == param and message in error.message
