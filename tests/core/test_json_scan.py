"""The partial-JSON scanner under the tool parsers: where values end, incomplete vs malformed text,
and the resumable bracket scan of long arguments."""

from __future__ import annotations

import json

import pytest

from framework.parsers.json_scan import Incomplete, Malformed, container_end, scan_call, scan_value

ARGS = json.dumps({"code": 'print("}]{[ \\" done")\n' * 3, "n": [1, {"x": None}], "ok": True})


@pytest.mark.parametrize("value", ['"a\\"b"', "-1.5e3", "true", "null", '{"a": [1, 2, {"b": "}"}]}', "[]", ARGS])
def test_scan_value_finds_the_end_of_every_kind_of_value(value):
    text = value + ",rest"
    end = scan_value(text, 0)
    assert text[end:] == ",rest" and json.loads(text[:end]) == json.loads(value)
    for cut in range(1, len(value)):
        with pytest.raises(Incomplete):
            scan_value(value[:cut], 0)


@pytest.mark.parametrize("text,pos", [("{]", 1), ('{"a" 1}', 5), ("[1 2]", 3), ("nul!", 0), ("@", 0)])
def test_malformed_json_reports_where(text, pos):
    with pytest.raises(Malformed) as error:
        scan_value(text, 0)
    assert error.value.pos == pos


def test_container_end_resumes_from_its_cache_with_the_same_answer():
    text = "x" + ARGS + " tail"
    cache: dict = {}
    for size in range(2, len(text)):  # the text grows one character at a time, as in streaming
        try:
            end = container_end(text[:size], 1, cache)
        except Incomplete:
            continue
        break
    assert end == container_end(text, 1) == 1 + len(ARGS)


def test_scan_call_reads_name_and_arguments_spans_in_any_order():
    text = '{"arguments": {"a": "}"}, "name": "f", "extra": [1]}'
    scan = scan_call(text, 0)
    assert scan.name == "f" and scan.arguments(text) == '{"a": "}"}' and scan.end == len(text)
    partial = scan_call('{"name": "f", "arguments": {"a": "long str', 0)
    assert partial.name == "f" and partial.end is None
    assert partial.arguments('{"name": "f", "arguments": {"a": "long str') == '{"a": "long str'
