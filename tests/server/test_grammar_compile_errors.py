"""A grammar that parses but fails to compile is a 400 naming the field, streamed or not, and the
server goes on serving (``fw serve`` on the tiny Llama, driven by the ``openai`` client).

xgrammar rejects almost every bad grammar while parsing it (a 400 at once, see
test_structured_outputs_server.py); a compile failure comes later, on the engine's compile thread.
To make one happen for real in the engine process, ``sitecustomize`` (on the server's PYTHONPATH)
makes the compiler raise, with xgrammar's own message format, on grammars that hold ``TRIGGER``.
"""

from __future__ import annotations

import os
import re

import httpx
import openai
import pytest

from framework.testing import metric_value

TRIGGER = "compile-fails"
SITECUSTOMIZE = f"""
import framework.engine.structured_outputs as so

_compile = so.StructuredOutputManager._compile
_trigger = {TRIGGER!r}
_spelled = " ".join('"%s"' % c for c in _trigger)  # a regex's literal, one character at a time

def _failing_compile(self, grammar):
    if _trigger in str(grammar) or _spelled in str(grammar):
        raise RuntimeError("[10:00:00] /project/cpp/grammar_compiler.cc:42: injected: too many states")
    return _compile(self, grammar)

so.StructuredOutputManager._compile = _failing_compile
"""
MESSAGES = [{"role": "user", "content": "t5 t9 t12"}]
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"enum": [TRIGGER]}}}


@pytest.fixture(scope="module")
def server(tiny_model_dir, serve_on_free_port, tmp_path_factory):
    site = tmp_path_factory.mktemp("failing-compiler")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
        with serve_on_free_port(["--m", str(tiny_model_dir), "--device", "cpu", "--served-model-name", "tiny"]) as proc:
            yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _check(error: openai.BadRequestError, param: str) -> None:
    assert error.status_code == 400
    body = error.body
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["code"] == "invalid_value", body
    assert re.fullmatch(
        rf"{re.escape(param)}: the grammar failed to compile: injected: too many states", body["message"]
    )


@pytest.mark.parametrize("stream", [False, True])
def test_chat_schema_that_fails_to_compile_is_a_400_naming_response_format(client, stream):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, response_format=BAD_SCHEMA, stream=stream
        )
    _check(excinfo.value, "response_format.json_schema.schema")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "field,value,param",
    [
        ("guided_regex", TRIGGER, "guided_regex"),
        ("structured_outputs", {"grammar": f'root ::= "{TRIGGER}"'}, "structured_outputs.grammar"),
    ],
)
def test_completion_grammar_that_fails_to_compile_is_a_400_naming_the_field(client, stream, field, value, param):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model="tiny", prompt="t5 t9", max_tokens=4, stream=stream, extra_body={field: value})
    _check(excinfo.value, param)


def aborted_requests(server) -> float:
    """``fw:request_success_total`` with finish reason abort, from /metrics."""
    return metric_value(httpx.get(server.base_url + "/metrics", timeout=30).text, "fw:request_success_total", '"abort"')


def test_the_server_keeps_serving_and_the_failed_requests_hold_nothing(client, server):
    aborted_before = aborted_requests(server)
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, response_format=BAD_SCHEMA)
    constrained = client.completions.create(
        model="tiny", prompt="t5 t9", max_tokens=4, temperature=0, extra_body={"guided_choice": ["t7", "t8"]}
    )
    # the grammar ended the reply (the tiny vocabulary decodes the choice's tokens with spaces between)
    assert constrained.choices[0].text.startswith(("t7", "t8")) and constrained.choices[0].finish_reason == "stop"
    free = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    assert free.choices[0].finish_reason == "length" and free.usage.completion_tokens == 3
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    for gauge in ("fw:num_requests_running", "fw:num_requests_waiting", "fw:num_kv_blocks_used"):
        assert metric_value(metrics, gauge) == 0.0, gauge
    assert aborted_requests(server) - aborted_before == 3  # the failed requests are counted as aborted
