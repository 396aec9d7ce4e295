"""The request fields that ask for structured outputs, turned into ``StructuredOutputsParams``.

Accepted on ``/v1/chat/completions`` and ``/v1/completions`` (at most one of them per request):

=====================================================  ================================================
field                                                  constraint
=====================================================  ================================================
``response_format: {"type": "text"}``                  none (the default)
``response_format: {"type": "json_object"}``           any JSON object
``response_format: {"type": "json_schema",             JSON valid under ``schema`` (always strict: no
"json_schema": {"name", "schema", "strict"}}``         properties beyond those the schema names)
``structured_outputs: {"json" | "regex" | "choice" |   vLLM's field; the keys of
"grammar" | "json_object", "start_after"?}``           :class:`~framework.sampling_params.StructuredOutputsParams`
``guided_json``, ``guided_regex``, ``guided_choice``,  vLLM's older fields: a JSON schema, a regular
``guided_grammar``                                     expression, a list of strings, an EBNF grammar
=====================================================  ================================================

Shape errors are 400s naming the field, raised here (the API process never imports xgrammar), and
so is a schema, regex, grammar or choice list longer than
:data:`~framework.server.limits.MAX_GRAMMAR_CHARS`; whether a schema, regex or grammar parses is checked by the engine when the request is added, and
whether it compiles just after (on the engine's compile thread, before the request is scheduled).
Either error reaches the client as a 400 naming the field (:func:`grammar_errors`): streamed
responses wait for their first event before they start (:func:`first_event_or_error`).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from framework.errors import GrammarError
from framework.sampling_params import StructuredOutputsParams
from framework.server.errors import MAX_JSON_DEPTH, APIError, bad_request, json_depth
from framework.server.limits import check_grammar_size
from framework.server.state import engine_error

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_AT = re.compile(r" - at `\$\.([\w.\[\]]+)`$")


def structured_outputs_from_request(body: Any) -> StructuredOutputsParams | None:
    """The constraint a chat or completions request asks for, or None; a 400 naming the field if malformed."""
    found = _constraints(body)
    return found[0][1] if found else None


def structured_outputs_field(body: Any) -> str | None:
    """The request field that holds the grammar (``response_format.json_schema.schema``,
    ``structured_outputs.regex``, ``guided_grammar``, ...), for errors about it; None without one."""
    found = _constraints(body)
    if not found:
        return None
    name, params = found[0]
    if name == "response_format":
        return "response_format" if params.kind == "json_object" else "response_format.json_schema.schema"
    return f"structured_outputs.{params.kind}" if name == "structured_outputs" else name


def _constraints(body: Any) -> list[tuple[str, StructuredOutputsParams]]:
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        params = _from_response_format(response_format)
        if params is not None:
            found.append(("response_format", params))
    if getattr(body, "structured_outputs", None) is not None:
        found.append(("structured_outputs", _from_structured_outputs(body.structured_outputs)))
    for name, key in GUIDED_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, _build(name, {key: value})))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(
            f"give at most one of response_format, structured_outputs and the guided_* fields; got {names}", found[1][0]
        )
    return found


def grammar_errors(field: str | None) -> Callable[[Exception], APIError]:
    """:func:`~framework.server.state.engine_error`, except that the engine's error about a grammar
    (a :class:`~framework.errors.GrammarError`: invalid, or failed to compile) is a 400 naming
    ``field``, the request field the grammar came from, in place of its ``structured_outputs.<kind>``."""

    def to_api_error(error: Exception) -> APIError:
        if field is not None and isinstance(error, GrammarError):
            return bad_request(f"{field}: {str(error).split(': ', 1)[-1]}", field)
        return engine_error(error)

    return to_api_error


def _from_response_format(value: Any) -> StructuredOutputsParams | None:
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMAT_TYPES:
        kind = value.get("type") if isinstance(value, dict) else value
        raise bad_request(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}",
            "response_format.type",
        )
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema must be an object with 'name' and 'schema' when type is 'json_schema'",
            "response_format.json_schema",
        )
    schema = spec.get("schema")
    if schema is None:
        raise bad_request(
            "response_format.json_schema.schema is required: the JSON Schema the output must follow",
            "response_format.json_schema.schema",
        )
    if not isinstance(schema, dict):
        raise bad_request(
            f"response_format.json_schema.schema must be a JSON Schema object, got {type(schema).__name__}",
            "response_format.json_schema.schema",
        )
    return _build("response_format.json_schema.schema", {"json": schema})


def _from_structured_outputs(value: Any) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise bad_request(f"structured_outputs must be an object, got {type(value).__name__}", "structured_outputs")
    valid = set(StructuredOutputsParams.__struct_fields__)
    unknown = sorted(set(value) - valid)
    if unknown:
        raise bad_request(
            f"structured_outputs has unknown keys {unknown}; valid: {', '.join(sorted(valid))}",
            f"structured_outputs.{unknown[0]}",
        )
    return _build("structured_outputs", value)


def _build(param: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    schema = fields.get("json")
    if (
        isinstance(schema, str) and json_depth(schema.encode()) > MAX_JSON_DEPTH
    ):  # the body's own limit, for a schema given as text
        raise bad_request(f"{param}: the JSON schema is nested more than {MAX_JSON_DEPTH} levels deep", param)
    try:
        params = msgspec.convert(fields, StructuredOutputsParams)
    except (msgspec.ValidationError, ValueError) as error:
        text = str(error)
        at = _AT.search(text)
        if at and param == "structured_outputs":  # a wrong type: name the key
            param, text = f"{param}.{at.group(1)}", _AT.sub("", text)
        raise bad_request(f"{param}: {text}", param) from None
    check_grammar_size(f"structured_outputs.{params.kind}" if param == "structured_outputs" else param, params.spec)
    return params


async def first_event_or_error(
    events: AsyncIterator[Any], on_error: Callable[[], None], to_api_error: Callable[[Exception], APIError]
) -> AsyncIterator[Any]:
    """Wait for the stream's first event, so that an engine refusal (an invalid grammar) is an HTTP
    error instead of an SSE error event after a 200; returns the whole stream, first event included.

    On an error, ``on_error`` runs (releasing the admission slot) and the APIError is raised.
    """
    try:
        first = await events.__anext__()
    except Exception as error:
        on_error()
        await events.aclose()
        raise to_api_error(error) from None

    async def replay() -> AsyncIterator[Any]:
        try:
            yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()

    return replay()
