"""tool_choice at unit level: the constraint schema (checked with jsonschema), request validation,
parser selection, and the ``fw serve`` flags."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from framework.errors import ConfigError
from framework.parsers.generic import GenericToolParser
from framework.parsers.tool_choice import ConstrainedCallsParser, tool_calls_schema
from framework.server.chat_tools import check_parser_names, resolve_parsers, tool_setup
from framework.server.errors import APIError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def request(**fields):
    return SimpleNamespace(**{"tools": None, "tool_choice": None, "parallel_tool_calls": None, **fields})


def test_required_schema_accepts_calls_of_the_tools_and_rejects_the_rest():
    schema = tool_calls_schema(TOOLS)
    jsonschema.validate(
        [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}], schema
    )
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "nope", "parameters": {}}],
        {"name": "get_time", "parameters": {}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_schema_allows_exactly_that_one_call():
    schema = tool_calls_schema(TOOLS, "get_weather")
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    for bad in (
        [{"name": "get_time", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"city": "a"}}, {"name": "get_weather", "parameters": {"city": "b"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_a_constrained_reply_parses_into_tool_calls_whatever_the_models_format():
    reply = json.dumps(
        [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]
    )
    jsonschema.validate(json.loads(reply), tool_calls_schema(TOOLS))
    result = ConstrainedCallsParser(TOOLS).parse(reply)
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]


def test_tool_choice_modes():
    assert tool_setup(request()).mode == "none"
    assert tool_setup(request(tools=TOOLS)).mode == "auto"
    assert tool_setup(request(tools=TOOLS, tool_choice="none")).tools is None
    required = tool_setup(request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert required.mode == "required" and required.schema["maxItems"] == 1
    named = tool_setup(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.mode == "named" and named.schema["items"]["properties"]["name"]["enum"] == ["get_time"]
    offered = tool_setup(request(), extra_tools=TOOLS)  # MCP tools when the request brings none
    assert offered.mode == "auto" and offered.tools == TOOLS
    # a server without a tool parser offers them only when the request asks for a call
    assert tool_setup(request(), extra_tools=TOOLS, can_parse_calls=False).mode == "none"
    forced = tool_setup(request(tool_choice="required"), extra_tools=TOOLS, can_parse_calls=False)
    assert forced.mode == "required" and forced.tools == TOOLS


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(fields, param):
    with pytest.raises(APIError) as error:
        tool_setup(request(**fields))
    assert error.value.status == 400 and error.value.param == param


def test_parsers_come_from_the_flags_or_the_template():
    served = resolve_parsers(None, None, "{{ messages }}<tool_call></tool_call><think>")
    assert (served.tool_name, served.reasoning_name) == ("qwen", "qwen3")
    served = resolve_parsers("mistral", "none", "<tool_call><think>")
    assert (served.tool_name, served.reasoning_name, served.reasoning) == ("mistral", None, None)
    generic = resolve_parsers(None, None, "{{ messages }}")  # no tool markup: fw's generic format
    assert (generic.tool_name, generic.tool_path, generic.tool) == ("generic", "generic", GenericToolParser)
    off = resolve_parsers("none", None, "{{ messages }}")
    assert (off.tool, off.tool_path) == (None, "none")


def test_unknown_parser_names_list_the_valid_ones():
    with pytest.raises(
        ConfigError, match=r"--enforce-parser 'hermes2'.*valid: generic, harmony, hermes, json, llama3, mistral, qwen"
    ):
        check_parser_names("hermes2", None)
    with pytest.raises(ConfigError, match=r"--reasoning-parser 'r1'.*deepseek_r1, harmony, qwen3"):
        check_parser_names(None, "r1")
    # one check: the server's resolution says the same as the early check at fw serve
    for tool, reasoning in (("hermes2", None), (None, "r1")):
        with pytest.raises(ConfigError) as early:
            check_parser_names(tool, reasoning)
        with pytest.raises(ConfigError) as late:
            resolve_parsers(tool, reasoning, None)
        assert str(early.value) == str(late.value)


def test_serve_flags_reach_the_server_config(monkeypatch, tmp_path):
    from typer import Typer
    from typer.testing import CliRunner

    from cli import serve_cmd
    from framework.server import launcher

    calls = []
    monkeypatch.setattr(launcher, "run_server", lambda *args, **kwargs: calls.append(args) or 0)
    app = Typer()
    app.command("serve")(serve_cmd.serve)
    app.command("other")(lambda: None)
    runner = CliRunner()
    config_file = tmp_path / "mcp.json"
    config_file.write_text(json.dumps({"mcpServers": {"web": {"url": "http://127.0.0.1:1/mcp"}}}))
    result = runner.invoke(
        app,
        [
            "serve",
            "--enforce-parser",
            "llama3",
            "--reasoning-parser",
            "deepseek_r1",
            "--mcp-config",
            str(config_file),
            "--mcp-command",
            "python",
            "--mcp-args",
            "s.py -v",
        ],
    )
    assert result.exit_code == 0, result.output
    config = calls[0][1]
    assert (config.tool_parser, config.reasoning_parser) == ("llama3", "deepseek_r1")
    assert config.mcp_servers == {
        "web": {"url": "http://127.0.0.1:1/mcp"},
        "mcp": {"command": "python", "args": ["s.py", "-v"]},
    }
    bad = runner.invoke(app, ["serve", "--enforce-parser", "nope"])
    assert bad.exit_code != 0 and "valid:" in bad.output


def test_reasoning_then_a_tool_call_split_the_same_streamed_and_not():
    import random

    from framework.server.chat_tools import ServedParsers, ToolSetup, choice_parser

    served = resolve_parsers("qwen", "qwen3", None)
    assert isinstance(served, ServedParsers)
    setup = ToolSetup(tools=TOOLS, mode="auto")
    text = (
        "<think>\nThe user wants weather; <tool_call> is how I call.\n</think>\n\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )

    def run(pieces):
        parser = choice_parser(served, setup, prompt_text="<|im_start|>assistant\n")
        deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
        calls: dict[int, list[str]] = {}
        for d in deltas:
            for c in d.tool_calls:
                calls.setdefault(c.index, [c.name, ""])[1] += c.arguments
        return (
            "".join(d.reasoning for d in deltas),
            "".join(d.content for d in deltas),
            [tuple(v) for v in calls.values()],
        )

    expected = (
        "The user wants weather; <tool_call> is how I call.",
        "Checking.",
        [("get_weather", '{"city": "Oslo"}')],
    )
    assert run([text]) == expected
    for seed in range(6):
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            size = rng.randint(1, 7)
            pieces.append(text[i : i + size])
            i += size
        assert run(pieces) == expected


def test_every_constraint_starts_after_reasoning():
    """tool_choice's constraint and a response_format / structured_outputs one alike: a reply that
    opens in reasoning is constrained only after the end marker."""
    from framework import SamplingParams
    from framework.sampling_params import StructuredOutputsParams
    from framework.server.chat_tools import after_reasoning, structured_outputs_for

    setup = tool_setup(request(tools=TOOLS, tool_choice="required"))
    assert structured_outputs_for(tool_setup(request(tools=TOOLS))) is None  # auto: unconstrained
    constraint = structured_outputs_for(setup)
    assert constraint.json == setup.schema and constraint.start_after is None
    for given in (constraint, StructuredOutputsParams(json_object=True)):
        params = SamplingParams(structured_outputs=given)
        assert after_reasoning(params, "</think>").structured_outputs.start_after == "</think>"
        assert after_reasoning(params, None).structured_outputs.start_after is None
    own = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+", start_after="]"))
    assert after_reasoning(own, "</think>").structured_outputs.start_after == "]"  # the request's own marker stays
    assert after_reasoning(SamplingParams(), "</think>").structured_outputs is None


def test_auto_grammar_frees_text_and_holds_calls_to_the_tools_schemas():
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from framework.parsers.tool_choice import auto_tool_calls_tag
    from framework.sampling_params import StructuredOutputsParams
    from framework.server.chat_tools import ServedParsers, structured_outputs_for

    grammar = xgrammar.Grammar.from_structural_tag(json.dumps(auto_tool_calls_tag(TOOLS)))
    single = xgrammar.Grammar.from_structural_tag(json.dumps(auto_tool_calls_tag(TOOLS, parallel=False)))
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    for text in (
        "It is sunny.",
        call,
        "Let me look. " + call,
        call + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    ):
        assert accepts(grammar, text), text
    for text in (
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # not one of the tools
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',  # "city" is required
        '<tool_call>{"name": "get_weather", "arguments": {"city": 3}}</tool_call>',
        "<tool_call>hello",
    ):
        assert not accepts(grammar, text, require_termination=False), text  # refused as it is written
    assert not accepts(single, call + " and more")  # without parallel calls the reply ends after its call
    # the server asks for it only where fw's own prompt teaches the format
    generic = resolve_parsers(None, None, "{{ messages }}", lambda m, t: str(m))
    assert structured_outputs_for(tool_setup(request(tools=TOOLS)), generic) == StructuredOutputsParams(
        structural_tag=json.dumps(auto_tool_calls_tag(TOOLS))
    )
    assert structured_outputs_for(tool_setup(request(tools=TOOLS)), ServedParsers()) is None
