"""``framework.layers.weight_prefetch`` (``FW_PREFETCH_WEIGHTS``): the setting's parsing, and on the
CPU, with the CUDA stream calls replaced by a log, the order of forks, prefetches, joins and matmuls
in a decode step of a tiny Llama. The GPU test runs it for real, inside CUDA graphs."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

import framework.layers.weight_prefetch as weight_prefetch
from framework import LLM, SamplingParams
from framework.engine.builder import EngineBuilder
from framework.errors import ConfigError
from framework.layers.weight_prefetch import ENV, PrefetchSetting, WeightPrefetcher, setting_from_env

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
PROMPT = {"prompt_token_ids": [3, 17, 9, 40]}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return folder


@pytest.mark.parametrize(("value", "expected"), [
    ("", None), ("off", None), ("0", None),
    ("bulk", PrefetchSetting("bulk", 32 * 2**20)),
    ("load:8", PrefetchSetting("load", 8 * 2**20)),
    ("auto:0.5", PrefetchSetting("auto", 2**19)),
])
def test_setting_reads_method_and_megabytes(value, expected):
    assert setting_from_env(value) == expected


@pytest.mark.parametrize("value", ["fast", "bulk:", "bulk:-1", "bulk:0", "bulk:lots", "Bulk", "bulk:inf", "bulk:nan",
                                   "bulk:1e-9", "load:5000"])
def test_a_bad_setting_names_the_valid_form(value):
    with pytest.raises(ConfigError, match=rf"FW_PREFETCH_WEIGHTS must be METHOD\[:MB\] with METHOD one of auto, load, "
                                          rf"bulk and MB a number from 0.015625 \(one bulk request\) to 4096, or off; "
                                          rf"got '{value}'"):
        setting_from_env(value)


def test_the_engine_builder_refuses_a_bad_setting_before_loading(monkeypatch):
    monkeypatch.setenv(ENV, "everything")
    with pytest.raises(ConfigError, match="FW_PREFETCH_WEIGHTS must be METHOD"):
        EngineBuilder("./no-such-model", device="cpu")


class StreamLog:
    """Stands in for ``torch.cuda``'s streams and the prefetch kernel, writing what they were asked.

    The side stream waiting for the main one is a fork; the main stream waiting for it, a join.
    """

    def __init__(self) -> None:
        self.events: list[str] = []
        self.names: dict[int, str] = {}

    def waits(self, event: str):
        return type("Stream", (), {"wait_stream": lambda _self, _other: self.events.append(event)})()

    def prefetch(self, weight, max_bytes, method) -> None:
        self.events.append(f"prefetch {self.names.get(id(weight), '?')} {max_bytes} {method}")


@pytest.fixture
def logged(tiny_llama, monkeypatch):
    """A tiny Llama on the CPU with a prefetcher (bulk, 1000 bytes) whose streams and kernel write
    to a :class:`StreamLog`: ``(llm, model, log, prefetcher)``."""
    llm = LLM(str(tiny_llama), load_format="dummy", num_blocks=16, device="cpu")
    model = llm.engine.core.runner.model
    log = StreamLog()
    main = log.waits("join")
    monkeypatch.setattr(torch.cuda, "Stream", lambda _device: log.waits("fork"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda _stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda _device=None: None)
    monkeypatch.setattr(weight_prefetch, "get_kernel", lambda op: log.prefetch)
    prefetcher = WeightPrefetcher(model, PrefetchSetting("bulk", 1000), torch.device("cpu"))
    return llm, model, log, prefetcher


def test_each_matmul_prefetches_the_next_layers_weight_and_the_next_matmul_waits_for_it(logged):
    llm, model, log, prefetcher = logged
    names = {module: name for name, module in model.named_modules()}
    log.names = {id(layer.weight): names[layer] for layer in prefetcher.layers}
    for layer in prefetcher.layers:
        layer.register_forward_pre_hook(lambda layer, args: log.events.append(f"matmul {names[layer]}"))
    log.events.clear()

    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # prefill records, 1 decode step

    linears = [f"model.layers.{i}.{part}" for i in range(2)
               for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    assert [names[layer] for layer in prefetcher.order] == linears
    prefill = [f"matmul {name}" for name in linears]
    decode = [f"matmul {linears[0]}"]
    for following in linears[1:]:
        decode += ["fork", f"prefetch {following} 1000 bulk", "join", f"matmul {following}"]
    assert log.events == prefill + decode
    prefetcher.remove()
    log.events.clear()
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert log.events == prefill + [f"matmul {name}" for name in linears]  # no forks, prefetches or joins


def test_a_forward_that_raised_leaves_no_join_for_the_next(logged):
    """A fork left unjoined by a forward that raised is dropped, not joined at the start of the next
    forward (which may be a CUDA-graph capture that never saw the fork)."""
    llm, model, log, prefetcher = logged
    prefetcher.recorded = True
    first, second = prefetcher.layers[0], prefetcher.layers[1]
    prefetcher.next_weight = {first: second.weight}
    first(torch.randn(1, first.input_size))  # forks a prefetch of the second layer's weight; then the forward raises
    assert prefetcher.pending and log.events[-2:] == ["fork", "prefetch ? 1000 bulk"]
    log.events.clear()
    prefetcher._before_model(model, ())  # the next forward starts
    second(torch.randn(1, second.input_size))
    assert not prefetcher.pending and log.events == []  # no join reached across into it
