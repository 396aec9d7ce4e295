"""Model defaults through a real ``fw serve`` (tiny random-weight Llama): ``generation_config.json``'s
sampling defaults apply to requests that give none, ``--chat-template`` replaces the model's
template, ``reasoning_effort`` and ``chat_template_kwargs`` reach it; ``--vllm-metrics`` exports
vLLM's metric names and ``--log-stats-interval`` logs a stats line.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

#: Renders only the contents, then two words when the effort is low and one per kwarg ``extra``.
TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if reasoning_effort == 'low' %}t99 t98 {% endif %}"
    "{% if extra %}t97{% endif %}"
)
MESSAGES = [{"role": "user", "content": "t5 t9 t12"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, write_tiny_llama, serve_on_free_port):
    root = tmp_path_factory.mktemp("tiny-defaults")
    model_dir = write_tiny_llama(root / "model", "{{ 'the model template' }}")
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_p": 0.5, "do_sample": True}))
    template = root / "template.jinja"
    template.write_text(TEMPLATE)
    with serve_on_free_port(
        [
            "--m",
            str(model_dir),
            "--device",
            "cpu",
            "--served-model-name",
            "tiny",
            "--chat-template",
            str(template),
            "--vllm-metrics",
            "--log-stats-interval",
            "0.5",
        ]
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_generation_config_temperature_applies_when_the_request_gives_none(client):
    def text(**kwargs):
        return client.completions.create(model="tiny", prompt="t5 t9 t12", max_tokens=12, **kwargs).choices[0].text

    greedy = text(temperature=0)
    assert text(seed=1) == text(seed=2) == greedy  # the model's temperature 0
    assert len({text(temperature=1.0, seed=seed) for seed in range(4)}) > 1  # a request's own temperature wins

    def chat(**kwargs):
        return (
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, **kwargs)
            .choices[0]
            .message.content
        )

    assert chat(seed=1) == chat(seed=2) == chat(temperature=0)


def test_chat_template_flag_replaces_the_model_template(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    assert response.usage.prompt_tokens == 3  # "t5 t9 t12 ": the flag's template, not "the model template"


def test_reasoning_effort_and_chat_template_kwargs_reach_the_template(client, server):
    def prompt_tokens(**extra):
        return client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=1, extra_body=extra
        ).usage.prompt_tokens

    assert prompt_tokens(reasoning_effort="low") == 5
    assert prompt_tokens(reasoning_effort="high") == 3
    assert prompt_tokens(chat_template_kwargs={"extra": True}) == 4
    tokens = httpx.post(
        server.base_url + "/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": {"reasoning_effort": "low"}}
    )
    assert (
        httpx.post(server.base_url + "/detokenize", json={"tokens": tokens.json()["tokens"]}).json()["prompt"]
        == "t5 t9 t12 t99 t98"
    )
    with pytest.raises(openai.BadRequestError) as error:
        prompt_tokens(reasoning_effort="extreme")
    assert error.value.body["param"] == "reasoning_effort"


def test_vllm_metric_names_mirror_fw_names_and_stats_are_logged(client, server):
    client.completions.create(model="tiny", prompt="t5 t9", max_tokens=8)
    text = httpx.get(server.base_url + "/metrics").text
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    for name in (
        "num_requests_running",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "e2e_request_latency_seconds_sum",
    ):
        assert samples[f"vllm:{name}"] == samples[f"fw:{name}"], name
    assert samples["vllm:generation_tokens_total"] >= 8
    assert samples["vllm:gpu_cache_usage_perc"] == samples["fw:kv_cache_usage_perc"]
    assert samples["vllm:time_per_output_token_seconds_count"] == samples["fw:inter_token_latency_seconds_count"]
    deadline = time.monotonic() + 10
    while not any(line.startswith("fw: stats: ") for line in server.lines):
        assert time.monotonic() < deadline, server.lines[-5:]
        time.sleep(0.2)
    line = next(line for line in server.lines if line.startswith("fw: stats: "))
    assert "generation" in line and "tok/s" in line and "running" in line and "KV cache" in line
