"""Tools and reasoning for one chat request: validate ``tools`` / ``tool_choice``, pick parsers,
and run them over each choice's text.

=================  ===========================================================================
``tool_choice``    effect
=================  ===========================================================================
``"none"``         no tools go to the template and nothing is parsed as a call
``"auto"``         tools go to the template; the server's tool parser reads calls (default
                   when the request has tools)
``"required"``     the reply is constrained to a JSON array of one or more calls
named function     ``{"type": "function", "function": {"name": ...}}``: constrained to that call
=================  ===========================================================================
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from framework import plugins, registries
from framework.errors import ConfigError
from framework.parsers.base import ReasoningParser, ToolCallDelta, ToolParser
from framework.parsers.tool_choice import ConstrainedCallsParser, tool_calls_schema
from framework.sampling_params import SamplingParams, StructuredOutputsParams
from framework.server.errors import bad_request


@dataclass(slots=True)
class ServedParsers:
    """The server's parsers: named on the command line, else picked from the chat template."""

    tool: type[ToolParser] | None = None
    tool_name: str | None = None
    reasoning: type[ReasoningParser] | None = None
    reasoning_name: str | None = None


#: The flag that names each kind of parser, and its registry.
_PARSER_FLAGS = {
    "tool": ("--enforce-parser", registries.tool_parsers),
    "reasoning": ("--reasoning-parser", registries.reasoning_parsers),
}


def _checked_parser_name(kind: str, name: str | None) -> str | None:
    """``name`` if a plugin registers a ``kind`` parser by it, None for no name or ``"none"``;
    ConfigError naming the flag and listing the valid names otherwise."""
    if name in (None, "none"):
        return None
    flag, registry_of = _PARSER_FLAGS[kind]
    registry = registry_of()
    if name not in registry.names():
        raise ConfigError(f"{flag} {name!r}: no such {kind} parser; valid: {', '.join(sorted(registry.names()))}, none")
    return name


def resolve_parsers(tool_name: str | None, reasoning_name: str | None, chat_template: str | None) -> ServedParsers:
    """Load the named parsers (``--enforce-parser``, ``--reasoning-parser``), else the template's defaults.

    ``"none"`` turns a kind off. Unknown names raise ConfigError listing the valid ones.
    """
    defaults = plugins.call_first("default_parsers", model_config=None, chat_template=chat_template) or {}
    served = ServedParsers()
    for kind, name in (("tool", tool_name), ("reasoning", reasoning_name)):
        name = _checked_parser_name(kind, defaults.get(kind) if name is None else name)
        if name is not None:
            setattr(served, kind, _PARSER_FLAGS[kind][1]().get(name).load())
            setattr(served, f"{kind}_name", name)
    return served


def check_parser_names(tool_name: str | None, reasoning_name: str | None) -> None:
    """Fail early (at ``fw serve``, before the model's template is known) on a parser name that no
    plugin registers; the same check and message as :func:`resolve_parsers`."""
    _checked_parser_name("tool", tool_name)
    _checked_parser_name("reasoning", reasoning_name)


@dataclass(slots=True)
class ToolSetup:
    """What one request asked for: ``tools`` for the template, the mode, and the named function."""

    tools: list[dict[str, Any]] | None = None
    mode: str = "none"  # none | auto | required | named
    named: str | None = None
    parallel: bool = True
    schema: dict[str, Any] | None = field(default=None)


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Check OpenAI ``tools``; errors name the entry and say what a tool must look like."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request('\'tools\' must be a list of {"type": "function", "function": {...}} objects', "tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}}}',
                f"tools[{i}]",
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        if name in names:
            raise bad_request(f"tools[{i}].function.name {name!r} appears twice", f"tools[{i}].function.name")
        names.add(name)
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters"
            )
    return tools or None


def tool_setup(body: Any, extra_tools: list[dict[str, Any]] | None = None, can_parse_calls: bool = True) -> ToolSetup:
    """Validate ``tools`` / ``tool_choice`` / ``parallel_tool_calls``.

    ``extra_tools`` (the MCP tools) are offered when the request brings none of its own, unless
    the server has no tool parser (``can_parse_calls``) and the request did not ask for a call.
    """
    tools = validate_tools(body.tools)
    choice = body.tool_choice
    if tools is None and extra_tools and (can_parse_calls or choice not in (None, "auto")):
        tools = extra_tools
    parallel = body.parallel_tool_calls is not False
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolSetup(mode="none")
    if choice in ("auto", "required"):
        if not tools:
            raise bad_request(f"tool_choice {choice!r} needs 'tools'", "tool_choice")
        schema = tool_calls_schema(tools) if choice == "required" else None
        if schema is not None and not parallel:
            schema["maxItems"] = 1
        return ToolSetup(tools, choice, parallel=parallel, schema=schema)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if not tools or name not in {t["function"]["name"] for t in tools}:
        valid = ", ".join(t["function"]["name"] for t in tools or []) or "none given"
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools ({valid})", "tool_choice")
    return ToolSetup(tools, "named", named=name, parallel=parallel, schema=tool_calls_schema(tools, name))


def structured_outputs_for(setup: ToolSetup) -> StructuredOutputsParams | None:
    """The constraint that enforces ``required`` / a named function (None for none / auto)."""
    return None if setup.schema is None else StructuredOutputsParams(json=setup.schema)


def after_reasoning(params: SamplingParams, start_after: str | None) -> SamplingParams:
    """``params`` whose constraint (tool_choice, response_format, structured_outputs) starts after
    ``start_after`` (the reasoning parser's end marker, when the reply opens in reasoning)."""
    constraint = params.structured_outputs
    if not start_after or constraint is None or constraint.start_after is not None:
        return params
    return params.replace(structured_outputs=msgspec.structs.replace(constraint, start_after=start_after))


def template_tool_calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant ``tool_calls`` for the chat template: arguments as objects (templates ``tojson`` them)."""
    result = []
    for call in tool_calls:
        call = dict(call)
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                call["function"] = {**function, "arguments": json.loads(function["arguments"])}
            except ValueError:
                pass
        result.append(call)
    return result


@dataclass(slots=True)
class ParsedDelta:
    """What one piece of generated text adds to a choice."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceParser:
    """Reasoning first (its content goes on), then tool calls, for one choice's text."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel: bool = True) -> None:
        self.reasoning, self.tools, self.parallel = reasoning, tools, parallel
        self.has_tool_calls = False

    def feed(self, text: str) -> ParsedDelta:
        if self.reasoning is None:
            return self._tools(ParsedDelta(content=text), final=False)
        reasoning, content = self.reasoning.feed(text)
        return self._tools(ParsedDelta(reasoning, content), final=False)

    def finish(self) -> ParsedDelta:
        if self.reasoning is None:
            return self._tools(ParsedDelta(), final=True)
        reasoning, content = self.reasoning.finish()
        return self._tools(ParsedDelta(reasoning, content), final=True)

    def _tools(self, delta: ParsedDelta, final: bool) -> ParsedDelta:
        if self.tools is None:
            return delta
        parsed = self.tools.feed(delta.content)
        if final:
            done = self.tools.finish()
            parsed.content += done.content
            parsed.tool_calls += done.tool_calls
        delta.content = parsed.content
        delta.tool_calls = [c for c in parsed.tool_calls if self.parallel or c.index == 0]
        self.has_tool_calls = self.has_tool_calls or bool(delta.tool_calls)
        return delta


def choice_parser(served: ServedParsers, setup: ToolSetup, prompt_text: str) -> ChoiceParser | None:
    """A fresh parser chain for one choice, or None when the request needs no parsing."""
    reasoning = None
    if served.reasoning is not None:
        reasoning = served.reasoning(starts_in_reasoning=served.reasoning.prompt_opens_reasoning(prompt_text))
    tools: ToolParser | None = None
    if setup.mode in ("required", "named"):
        tools = ConstrainedCallsParser(setup.tools)
    elif setup.mode == "auto":
        if served.tool is None:
            raise bad_request(
                "this server has no tool parser for its model's chat template; start fw serve with "
                f"--enforce-parser NAME (valid: {', '.join(sorted(registries.tool_parsers().names()))})",
                "tools",
            )
        tools = served.tool(setup.tools)
    if reasoning is None and tools is None:
        return None
    return ChoiceParser(reasoning, tools, setup.parallel)
