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
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutputsParams(json=SCHEMA),
        ),
        (
            {"structured_outputs": {"regex": "[0-9]+", "start_after": "</think>"}},
            StructuredOutputsParams(regex="[0-9]+", start_after="</think>"),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": '{"type": "object"}'}, StructuredOutputsParams(json='{"type": "object"}')),
        ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
        ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    ],
)
def test_each_field_becomes_its_constraint(make, fields, expected):
    assert structured_outputs_from_request(make(**fields)) == expected


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"response_format": {"type": "xml"}},
            "response_format.type",
            "response_format.type must be one of text, json_object, json_schema; got 'xml'",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "response_format.json_schema must be an object with 'name' and 'schema'",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
            "response_format.json_schema.schema",
            "response_format.json_schema.schema is required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}},
            "response_format.json_schema.schema",
            "must be a JSON Schema object, got list",
        ),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
            "exactly one of json, json_object, regex, grammar, choice; got regex, choice",
        ),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", "unknown keys ['regexp']"),
        (
            {"structured_outputs": {"choice": "ab"}},
            "structured_outputs.choice",
            "structured_outputs.choice: Expected `array | null`, got `str`",
        ),
        ({"guided_choice": []}, "guided_choice", "structured_outputs.choice must be a non-empty list"),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "give at most one of response_format, structured_outputs and the guided_* fields; got response_format, guided_regex",
        ),
    ],
)
def test_malformed_fields_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(APIError) as excinfo:
        structured_outputs_from_request(_chat(**fields))
    error = excinfo.value
    assert error.status == 400 and error.param == param and message in error.message


def test_only_a_grammar_error_becomes_a_400_naming_the_request_field():
    """The engine's GrammarError is reported against the field the grammar came from; any other
    refusal keeps its own message, even one that happens to start like a grammar error's."""
    from framework.errors import ConfigError, GrammarError
    from framework.server.structured_outputs import grammar_errors

    to_api_error = grammar_errors("response_format.json_schema.schema")
    grammar = to_api_error(GrammarError("structured_outputs.json: invalid JSON schema: bad type"))
    assert (grammar.status, grammar.message, grammar.param) == (
        400,
        "response_format.json_schema.schema: invalid JSON schema: bad type",
        "response_format.json_schema.schema",
    )
    other = to_api_error(ConfigError("structured_outputs.json: looks alike, but is not the grammar"))
    assert (other.status, other.message, other.param) == (
        400,
        "structured_outputs.json: looks alike, but is not the grammar",
        None,
    )
    assert grammar_errors(None)(GrammarError("structured_outputs.regex: x")).message == "structured_outputs.regex: x"


def test_the_engine_process_marks_a_grammar_refusal_for_the_client():
    """An AddRequest whose grammar is invalid is answered AddFailed(grammar=True), any other refusal
    grammar=False (test_structured_outputs_server.py sees the client turn the first into a 400 that
    names the request field)."""
    from framework.engine.engine_process import EngineLoop
    from framework.engine.messages import AddFailed, AddRequest
    from framework.errors import ConfigError, GrammarError

    sent = []

    class Core:
        def add_request(self, request_id, prompt_token_ids, params, pooling):
            raise GrammarError("structured_outputs.regex: invalid regular expression: (")

    loop = EngineLoop.__new__(EngineLoop)
    loop.core, loop.send = Core(), sent.append
    loop.handle(AddRequest(request_id="r1", prompt_token_ids=[1], params=None))
    assert sent == [
        AddFailed(request_id="r1", message="structured_outputs.regex: invalid regular expression: (", grammar=True)
    ]
    Core.add_request = lambda *args: (_ for _ in ()).throw(ConfigError("the prompt is too long"))
    loop.handle(AddRequest(request_id="r2", prompt_token_ids=[1], params=None))
    assert sent[-1] == AddFailed(request_id="r2", message="the prompt is too long", grammar=False)
