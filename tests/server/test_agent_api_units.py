"""Small pieces of the agent-facing APIs: the response store's cap and TTL, the stats line,
the generation_config defaults, and --chat-template's checks."""

from __future__ import annotations

import pytest

from cli.serve_cmd import read_chat_template
from framework.engine.outputs import EngineStats
from framework.errors import ConfigError
from framework.sampling_params import sampling_defaults
from framework.server.metrics import stats_line
from framework.server.responses_store import ResponseStore, StoredResponse


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(name: str) -> StoredResponse:
    return StoredResponse({"id": name}, [])


def test_store_keeps_at_most_max_entries_dropping_the_oldest():
    store = ResponseStore(max_entries=2, ttl_s=100, clock=Clock())
    for name in ("a", "b", "c"):
        store.put(name, stored(name))
    assert store.get("a") is None and [store.get(n).response["id"] for n in ("b", "c")] == ["b", "c"]
    store.put("b", stored("b2"))  # a rewrite refreshes: now c is the oldest
    store.put("d", stored("d"))
    assert store.get("c") is None and store.get("b").response["id"] == "b2" and len(store) == 2


def test_store_forgets_a_response_ttl_seconds_after_it_was_written():
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl_s=5, clock=clock)
    store.put("a", stored("a"))
    clock.now = 4.9
    assert store.get("a") is not None
    clock.now = 5.0
    assert store.get("a") is None and len(store) == 0
    assert not store.delete("a")


def test_stats_line_reports_throughput_over_the_interval():
    def stats(prompt, generated, queries, hits):
        return EngineStats(
            num_running=2,
            num_waiting=1,
            num_free_blocks=75,
            num_blocks=100,
            kv_cache_usage=0.25,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=0,
            prompt_tokens=prompt,
            generation_tokens=generated,
        )

    line = stats_line(stats(100, 40, 100, 0), stats(300, 90, 200, 50), 10.0)
    assert line == (
        "fw: stats: prompt 20.0 tok/s, generation 5.0 tok/s, running 2, waiting 1, KV cache 25.0%, "
        "prefix cache hits 50.0%"
    )


def test_sampling_defaults_take_the_numeric_sampling_keys_only():
    config = {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "do_sample": True,
        "eos_token_id": [1, 2],
        "min_p": "0.1",
        "repetition_penalty": True,
    }
    assert sampling_defaults(config) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_chat_template_flag_reads_a_file_or_text_and_refuses_what_does_not_parse(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    with pytest.raises(ConfigError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="does not parse"):
        read_chat_template("{% for m in messages %}")
